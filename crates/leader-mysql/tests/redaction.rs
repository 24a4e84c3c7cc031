//! No error, description or `Debug` of a MySQL lock URL or store shows the password, however it
//! is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No server is needed: the pool
//! connects lazily.

use leader_core::LockTarget;
use leader_mysql::{LockUrl, MysqlStore};
use leader_test_support::secrets::{assert_hidden, passwords};

#[tokio::test]
async fn redact_passwords_of_lock_urls_and_stores() {
    for password in passwords() {
        for url in [
            format!("mysql://app:{password}@127.0.0.1:1/app"),
            format!("mariadb://app:{password}@db/app?table=locks&require_ssl=false"),
            format!("mysql://app:{password}@db/app?lock=advisory"),
        ] {
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
            let store = MysqlStore::builder(url.as_str());
            assert_hidden(&url, &format!("{store:?}"));
            match store.build().await {
                Ok(store) => {
                    assert_hidden(&url, &format!("{store:?} {}", store.redacted_url()));
                }
                Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
            }
        }
    }
}
