//! A password in an `etcd://` URL logs in as written: percent-decoded, never read as form data
//! (where `+` is a space and `&` ends the value), against a real etcd server with
//! authentication on.

mod common;

use common::PrivateEtcd;
use leader_core::ResourceLock;
use leader_etcd::LockUrl;

/// A password as generators make them, with the characters form data gives a meaning to.
const PASSWORD: &str = "Ab+c&d=e+f%g";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_with_plus_ampersand_and_equals_log_in() {
    let Some(etcd) = PrivateEtcd::start() else {
        return;
    };
    etcd.enable_auth(PASSWORD).await;

    let port = etcd.client_port;
    for written in [
        // `%` can only be written encoded; everything else raw, encoded, or mixed.
        "Ab+c&d=e+f%25g",
        "Ab%2Bc%26d%3De%2Bf%25g",
        "Ab+c%26d=e%2Bf%25g",
    ] {
        let url = format!("etcd://root:{written}@127.0.0.1:{port}/?prefix=creds/");
        let parsed = LockUrl::parse(&url).expect(&url);
        let store = parsed
            .store()
            .build()
            .await
            .unwrap_or_else(|err| panic!("{url}: {err}"));
        let lock = store.lock("creds", "a");
        lock.get()
            .await
            .unwrap_or_else(|err| panic!("{url}: {err}"));
    }
}
