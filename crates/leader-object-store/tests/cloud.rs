//! The conformance suite and several electors against a real bucket, on request:
//!
//! ```text
//! LEADER_OBJECT_STORE_E2E_URL=s3://my-bucket/leader-e2e/ AWS_REGION=eu-west-1 \
//!   cargo test -p leader-object-store --test cloud -- --ignored
//! LEADER_OBJECT_STORE_E2E_URL=gs://my-bucket/leader-e2e/ GOOGLE_SERVICE_ACCOUNT=key.json \
//!   cargo test -p leader-object-store --test cloud -- --ignored
//! ```
//!
//! Credentials come from the environment as `object_store` reads them; they need the
//! permissions of `deploy/object-store/`. Reported as ignored, not passed, when not asked for.

mod common;

use common::Factory;
use leader_core::conformance;
use leader_object_store::BucketStore;

fn bucket() -> Factory {
    let url = std::env::var("LEADER_OBJECT_STORE_E2E_URL")
        .expect("set LEADER_OBJECT_STORE_E2E_URL=s3://BUCKET/PREFIX/ (or gs://, az://)");
    let url = format!("{}/{:08x}/", url.trim_end_matches('/'), fastrand::u32(..));
    leader_object_store::ensure_crypto_provider();
    Factory {
        store: BucketStore::from_url(&url).build().expect("a store"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a real bucket: set LEADER_OBJECT_STORE_E2E_URL and the store's credentials"]
async fn a_real_bucket_conforms() {
    conformance::run_all(&bucket()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a real bucket: set LEADER_OBJECT_STORE_E2E_URL and the store's credentials"]
async fn ten_electors_elect_exactly_one_on_a_real_bucket() {
    conformance::electors_elect_exactly_one(&bucket(), 10).await;
}
