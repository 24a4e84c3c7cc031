//! The lock never picks rustls' process-wide crypto provider for the application: without
//! one, a store is refused with a message saying what to do; with the application's own, the
//! lock uses it and installs nothing. A test binary of its own, since a provider installed
//! once stays for the whole process.

use std::sync::Arc;

use leader_core::LockError;
use leader_object_store::BucketStore;

#[test]
fn the_lock_uses_the_applications_crypto_provider_and_installs_none() {
    let build = || {
        BucketStore::from_url("s3://bucket/locks/")
            .option("aws_region", "us-east-1")
            .option("aws_endpoint", "http://127.0.0.1:9")
            .option("allow_http", "true")
            .build()
    };
    // Nothing installed: refused, saying what to do, and nothing installed by the refusal.
    match build() {
        Err(LockError::Misconfigured { message, .. }) => {
            assert!(
                message.contains("crypto provider") && message.contains("install_default"),
                "{message}"
            );
        }
        other => panic!("built without a crypto provider: {other:?}"),
    }
    assert!(rustls::crypto::CryptoProvider::get_default().is_none());
    // memory:// makes no HTTP client and needs none.
    BucketStore::from_url("memory://")
        .build()
        .expect("memory://");
    assert!(rustls::crypto::CryptoProvider::get_default().is_none());

    // The application installs its own (here a ring provider of its own making): the lock
    // builds with it and leaves it in place.
    let chosen = Arc::new(rustls::crypto::ring::default_provider());
    rustls::crypto::CryptoProvider::install_default(chosen.as_ref().clone())
        .expect("the application's provider");
    let installed = rustls::crypto::CryptoProvider::get_default()
        .expect("installed")
        .clone();
    build().expect("built with the application's provider");
    leader_object_store::ensure_crypto_provider();
    assert!(Arc::ptr_eq(
        &installed,
        rustls::crypto::CryptoProvider::get_default().expect("installed")
    ));
}
