//! No error, description or `Debug` of a Postgres lock URL or store shows the password, however
//! it is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No server is needed: the
//! store connects lazily.

use leader_postgres::{LockUrl, PostgresStore, PostgresStoreBuilder};
use leader_test_support::redaction::{StoreUrl, assert_urls_hidden};
use leader_test_support::secrets::{assert_hidden, passwords};

#[tokio::test]
async fn redact_passwords_of_lock_urls_and_stores() {
    let urls = passwords().into_iter().flat_map(|password| {
        [
            format!("postgres://app:{password}@127.0.0.1:1/app"),
            format!("postgresql://app:{password}@db/app?sslmode=disable&table=locks"),
            format!("postgres://app:{password}@db/app?advisory=maybe"),
        ]
    });
    // The store takes a connection string of its own too.
    let store_url = StoreUrl {
        builder: |url| PostgresStore::builder(url),
        redacted: PostgresStore::redacted_url,
    };
    let build = async |b: PostgresStoreBuilder| b.build().await;
    assert_urls_hidden(urls, LockUrl::parse, LockUrl::store, build, Some(store_url)).await;
}

/// Key-value connection strings: quoted values and spaces around `=`.
#[tokio::test]
async fn redact_passwords_of_key_value_connection_strings() {
    for conn in [
        "host=127.0.0.1 port=1 user=app password='p4ss w0rd'",
        "host=127.0.0.1 port=1 user=app password = p4ss/w0rd",
        r"host=127.0.0.1 port=1 password='p4ss\' w0rd' user=app",
    ] {
        let store = PostgresStore::builder(conn);
        assert_hidden(conn, &format!("{store:?}"));
        match store.build().await {
            Ok(store) => assert_hidden(conn, &format!("{store:?} {}", store.redacted_url())),
            Err(err) => assert_hidden(conn, &format!("{err} {err:?}")),
        }
    }
}
