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

/// A token that expired (etcd forgets a simple token after `--auth-token-ttl` without use; a
/// JWT after its TTL) is replaced by logging in again: a holder whose renewals go on the lease's
/// keep-alive stream sends no other request for a whole term, and its next one (a release, a
/// read as a candidate) once failed with "invalid auth token" until the process restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_auth_token_is_replaced_by_logging_in_again() {
    let Some(etcd) = PrivateEtcd::start_with(&["--auth-token-ttl", "1"]) else {
        return;
    };
    etcd.enable_auth(PASSWORD).await;
    let store = leader_etcd::EtcdStore::builder([etcd.endpoint()])
        .user("root", PASSWORD)
        .build()
        .await
        .expect("store");
    let lock = store.lock("expiring", "a");
    lock.get().await.expect("a read with a new token");
    // Past the token's TTL, and past the server's check of it (every TTL).
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    lock.get().await.expect("a read after the token expired");
}
