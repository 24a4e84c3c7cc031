//! No error, description or `Debug` of a Redis lock URL or store shows the password, however it
//! is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No server is needed: the store
//! connects on first use.

use leader_redis::{LockUrl, RedisStore, RedisStoreBuilder};
use leader_test_support::redaction::{StoreUrl, assert_urls_hidden};
use leader_test_support::secrets::{passwords, tokens};

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
    // The store takes a URL of its own too.
    let store_url = StoreUrl {
        builder: |url| RedisStore::builder(url),
        redacted: RedisStore::redacted_url,
    };
    let build = async |b: RedisStoreBuilder| b.build().await;
    assert_urls_hidden(
        urls(),
        LockUrl::parse,
        LockUrl::store,
        build,
        Some(store_url),
    )
    .await;
}
