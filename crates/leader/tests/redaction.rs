//! `leader::open` and `LockUrl` never show a password, however it is written (`/`, `?`, `#`,
//! `@`, `:` raw or percent-encoded): not in a ZooKeeper digest URL, and not in a string that is
//! no URL at all because its `://` is mistyped. No server is needed.

use leader::{LockUrl, LockUrlError, OpenError};
use leader_test_support::secrets::{assert_hidden, passwords};

/// Lock URLs mistyped around `://` (or without it), with `password` after a user.
fn malformed(password: &str) -> [String; 9] {
    [
        format!("postgres:/app:{password}@db/app"),
        format!("postgres//app:{password}@db/app"),
        format!("postgres:app:{password}@db/app"),
        format!("postgresql:\\\\app:{password}@db/app"),
        format!("mysql:///app:{password}@db/app"),
        format!("app:{password}@db:5432/app"),
        format!("redis:/:{password}@cache"),
        format!("app:{password}@db/app?next=http://x"),
        format!("zk:/app:{password}@z1:2181,z2:2181/kafka"),
    ]
}

#[tokio::test]
async fn lock_urls_that_are_no_urls_are_refused_without_their_password() {
    for password in passwords() {
        for url in malformed(&password) {
            match leader::open(&url, "jobs", "a").await {
                Err(OpenError::Url(err @ LockUrlError::Invalid { .. })) => {
                    assert_hidden(&url, &format!("{err} {err:?}"));
                }
                // `mysql:///...` is a URL with no host: its crate refuses it.
                Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                Ok(lock) => panic!("{url}: opened {}", lock.describe()),
            }
        }
    }
}

#[cfg(feature = "zookeeper")]
#[tokio::test]
async fn zookeeper_digest_passwords_never_show() {
    for password in passwords() {
        for url in [
            format!("zk://app:{password}@127.0.0.1:1/?connect_timeout=300ms"),
            format!(
                "zookeeper://app:{password}@127.0.0.1:1,127.0.0.1:2/kafka?connect_timeout=300ms"
            ),
            format!("zk://app:{password}@h/x?bucket=y"),
        ] {
            match LockUrl::parse(&url) {
                Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                Ok(parsed) => {
                    assert_hidden(&url, &format!("{parsed} {parsed:?}"));
                    match leader::open(&url, "jobs", "a").await {
                        Ok(lock) => panic!("{url}: nothing listens, yet {}", lock.describe()),
                        Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                    }
                    match leader::open_set(&url, "jobs", "a").await {
                        Ok(_) => panic!("{url}: nothing listens, yet a set opened"),
                        Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                    }
                }
            }
        }
    }
}
