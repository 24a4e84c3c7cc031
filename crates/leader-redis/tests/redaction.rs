//! No error, description or `Debug` of a Redis lock URL or store shows the password, however it
//! is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No server is needed: the store
//! connects on first use.

use leader_core::LockTarget;
use leader_redis::{LockUrl, RedisStore};
use leader_test_support::secrets::{assert_hidden, passwords, tokens};

/// Lock URLs with each password, and with each token in place of the user.
fn urls() -> Vec<String> {
    let mut urls = Vec::new();
    for password in passwords() {
        urls.push(format!("redis://:{password}@127.0.0.1:1"));
        urls.push(format!("rediss://app:{password}@cache:6380/2?prefix=app:"));
    }
    for token in tokens() {
        urls.push(format!("redis://{token}@cache:6379/x"));
    }
    urls
}

#[tokio::test]
async fn redact_passwords_of_lock_urls_and_stores() {
    for url in urls() {
        match LockUrl::parse(&url) {
            Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
            Ok(parsed) => {
                assert_hidden(&url, &format!("{} {parsed:?}", parsed.describe()));
                let store = parsed.store();
                assert_hidden(&url, &format!("{store:?}"));
                match store.build().await {
                    Ok(store) => assert_hidden(&url, &format!("{store:?}")),
                    Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                }
            }
        }
        // The store takes a URL of its own too.
        let store = RedisStore::builder(url.as_str());
        assert_hidden(&url, &format!("{store:?}"));
        match store.build().await {
            Ok(store) => assert_hidden(&url, &format!("{store:?} {}", store.redacted_url())),
            Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
        }
    }
}
