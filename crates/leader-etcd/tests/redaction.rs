//! No error, description or `Debug` of an etcd lock URL (several members in its authority) or
//! store builder shows the password, however it is written (`/`, `?`, `#`, `@`, `:` raw or
//! percent-encoded). No server is needed.

use leader_core::LockTarget;
use leader_etcd::{EtcdStore, LockUrl};
use leader_test_support::secrets::{assert_hidden, passwords};

#[test]
fn redact_passwords_of_lock_urls_and_store_builders() {
    for password in passwords() {
        for url in [
            format!("etcd://app:{password}@127.0.0.1:1,127.0.0.1:2/?prefix=x/"),
            format!("etcds://app:{password}@a:2379/"),
            format!("etcd://app:{password}@a:2379,b:2379/?member_timeout=soon"),
            format!("etcd://app:{password}@/x"),
        ] {
            match LockUrl::parse(&url) {
                Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                Ok(parsed) => {
                    assert_hidden(&url, &format!("{} {parsed:?}", parsed.describe()));
                    assert_hidden(&url, &format!("{:?}", parsed.store()));
                }
            }
        }
        let endpoint = format!("http://app:{password}@127.0.0.1:1");
        let store = EtcdStore::builder([endpoint.as_str()]).user("app", &password);
        assert_hidden(&endpoint, &format!("{store:?}"));
    }
}

/// A member that does not answer is named in the error with its password hidden. (A listener
/// that never accepts: the connection opens, and no answer comes.)
#[tokio::test]
async fn a_member_that_does_not_answer_is_named_without_its_password() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let password = "s3cret-of-the-member";
    let endpoint = format!("http://app:{password}@127.0.0.1:{port}");
    // The connection opens lazily: the build may pass, the first request cannot.
    let built = EtcdStore::builder([endpoint.as_str()])
        .timeout(std::time::Duration::from_millis(300))
        .build()
        .await;
    let err = match built {
        Err(err) => err,
        Ok(store) => {
            use leader_core::ResourceLock;
            store.lock("x", "a").get().await.expect_err("no answer")
        }
    };
    let shown = format!("{err} {err:?}");
    assert!(shown.contains("app:***@127.0.0.1"), "{shown}");
    assert!(
        !shown.contains(password),
        "{endpoint}: the password shows in {shown}"
    );
    drop(silent);
}
