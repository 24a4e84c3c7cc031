//! No error, description or `Debug` of a ZooKeeper lock URL (a digest `user:password@` before
//! several servers) or store shows the password, however it is written (`/`, `?`, `#`, `@`,
//! `:` raw or percent-encoded). No server is needed: nothing listens where the URLs point.

use leader_core::LockTarget;
use leader_test_support::secrets::{assert_hidden, passwords};
use leader_zookeeper::{LockUrl, ZooKeeperStore};

/// Lock URLs with `password` as the digest's, valid and not.
fn urls(password: &str) -> [String; 6] {
    [
        format!("zk://app:{password}@127.0.0.1:1/?connect_timeout=300ms"),
        format!("zookeeper://app:{password}@127.0.0.1:1,127.0.0.1:2/kafka?connect_timeout=300ms"),
        format!("zk://app:{password}@[::1]:1/a/b?prefix=/locks&connect_timeout=300ms"),
        format!("zk://app:{password}@h:99999/x"),
        format!("zk://app:{password}@h/x?session_timeout=soon"),
        format!("zk://app:{password}@/x"),
    ]
}

#[tokio::test]
async fn redact_digest_passwords_of_lock_urls_and_stores() {
    let mut parsed_urls = 0;
    for password in passwords() {
        for url in urls(&password) {
            match LockUrl::parse(&url) {
                Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                Ok(parsed) => {
                    parsed_urls += 1;
                    let described = parsed.describe();
                    assert!(described.contains("app:***@"), "{url}: {described}");
                    assert_hidden(&url, &format!("{described} {parsed:?}"));
                    let store = parsed.store();
                    assert_hidden(&url, &format!("{store:?}"));
                    match store.build().await {
                        Ok(store) => panic!("{url}: nothing listens, yet {store:?}"),
                        Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                    }
                    match parsed.open("jobs", "a").await {
                        Ok(lock) => panic!("{url}: nothing listens, yet {}", lock.describe()),
                        Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                    }
                }
            }
        }
        let store = ZooKeeperStore::builder("127.0.0.1:1").digest("app", &password);
        assert_hidden(&password, &format!("{store:?}"));
    }
    // The passwords that a URL can hold (percent-encoded, or a raw `@` or `:`) got as far as
    // connecting.
    assert!(parsed_urls >= 30, "only {parsed_urls} URLs parsed");
}
