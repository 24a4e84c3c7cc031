//! No error, description or `Debug` of an object storage lock URL or store shows a secret put
//! in the URL, as user-info or as a parameter (`aws_secret_access_key=`, a SAS `sig=`, ...),
//! however it is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No store is needed:
//! building sends nothing.

use leader_core::LockTarget;
use leader_object_store::{BucketStore, LockUrl};
use leader_test_support::secrets::{assert_hidden, passwords, tokens};

/// URLs with each secret as user-info or as a parameter, and with each token as the user.
fn urls() -> Vec<String> {
    let mut urls = Vec::new();
    for secret in passwords() {
        urls.extend([
            format!("s3://AKIDEXAMPLE:{secret}@bucket/locks/"),
            format!("s3://bucket/locks/?aws_secret_access_key={secret}"),
            format!("s3://bucket/locks/?region=eu-west-1&aws_session_token={secret}"),
            format!("az://container/locks/?sv=2022-11-02&sig={secret}"),
            format!("gs://bucket/locks/?google_service_account_key={secret}"),
        ]);
    }
    for token in tokens() {
        urls.push(format!("gs://{token}@bucket/locks/"));
    }
    urls
}

#[test]
fn redact_secrets_of_lock_urls_and_stores() {
    leader_object_store::ensure_crypto_provider();
    for url in urls() {
        match LockUrl::parse(&url) {
            Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
            Ok(parsed) => {
                assert_hidden(&url, &format!("{} {parsed:?}", parsed.describe()));
                match parsed.store() {
                    Ok(store) => assert_hidden(&url, &format!("{store:?}")),
                    Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
                }
            }
        }
        // The store takes a URL of its own too.
        let store = BucketStore::from_url(&url);
        assert_hidden(&url, &format!("{store:?}"));
        match store.build() {
            Ok(store) => assert_hidden(&url, &format!("{store:?}")),
            Err(err) => assert_hidden(&url, &format!("{err} {err:?}")),
        }
    }
}
