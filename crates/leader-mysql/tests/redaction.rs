//! No error, description or `Debug` of a MySQL lock URL or store shows the password, however it
//! is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No server is needed: the pool
//! connects lazily.

use leader_mysql::{LockUrl, MysqlStore};
use leader_test_support::secrets::{
    assert_built_hidden, assert_hidden, assert_parsed_hidden, passwords,
};

#[tokio::test]
async fn redact_passwords_of_lock_urls_and_stores() {
    for password in passwords() {
        for url in [
            format!("mysql://app:{password}@127.0.0.1:1/app"),
            format!("mariadb://app:{password}@db/app?table=locks&require_ssl=false"),
            format!("mysql://app:{password}@db/app?lock=advisory"),
        ] {
            if let Some(parsed) = assert_parsed_hidden(&url, LockUrl::parse(&url)) {
                assert_built_hidden(&url, parsed.store(), async |b| b.build().await).await;
            }
            // The store takes a URL of its own too.
            let builder = MysqlStore::builder(url.as_str());
            if let Some(store) = assert_built_hidden(&url, builder, async |b| b.build().await).await
            {
                assert_hidden(&url, store.redacted_url());
            }
        }
    }
}
