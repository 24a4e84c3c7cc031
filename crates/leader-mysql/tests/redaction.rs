//! No error, description or `Debug` of a MySQL lock URL or store shows the password, however it
//! is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No server is needed: the pool
//! connects lazily.

use leader_mysql::{LockUrl, MysqlStore, MysqlStoreBuilder};
use leader_test_support::redaction::{StoreUrl, assert_urls_hidden};
use leader_test_support::secrets::passwords;

#[tokio::test]
async fn redact_passwords_of_lock_urls_and_stores() {
    let urls = passwords().into_iter().flat_map(|password| {
        [
            format!("mysql://app:{password}@127.0.0.1:1/app"),
            format!("mariadb://app:{password}@db/app?table=locks&require_ssl=false"),
            format!("mysql://app:{password}@db/app?lock=advisory"),
        ]
    });
    // The store takes a URL of its own too.
    let store_url = StoreUrl {
        builder: |url| MysqlStore::builder(url),
        redacted: MysqlStore::redacted_url,
    };
    let build = async |b: MysqlStoreBuilder| b.build().await;
    assert_urls_hidden(urls, LockUrl::parse, LockUrl::store, build, Some(store_url)).await;
}
