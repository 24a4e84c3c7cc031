//! No error, description or `Debug` of a Redis lock URL or store shows the password, however it
//! is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No server is needed: the store
//! connects on first use.

use leader_redis::{LockUrl, RedisStore};
use leader_test_support::secrets::{
    assert_built_hidden, assert_hidden, assert_parsed_hidden, passwords, tokens,
};

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
        if let Some(parsed) = assert_parsed_hidden(&url, LockUrl::parse(&url)) {
            assert_built_hidden(&url, parsed.store(), async |b| b.build().await).await;
        }
        // The store takes a URL of its own too.
        let builder = RedisStore::builder(url.as_str());
        if let Some(store) = assert_built_hidden(&url, builder, async |b| b.build().await).await {
            assert_hidden(&url, store.redacted_url());
        }
    }
}
