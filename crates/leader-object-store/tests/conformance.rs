//! The `leader-core` conformance suite and several electors, on moto's S3 server and on
//! object_store's in-memory store.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_s3_lock_conforms() {
    let Some(store) = common::s3_or_skip() else {
        return;
    };
    conformance::run_all(&Factory { store }).await;
}

/// In a bucket with versioning on, every write makes a version of its own, but S3's
/// precondition still compares the ETag, a digest of the bytes: a write of the bytes stored
/// must not count as moving the record (S14).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_s3_lock_conforms_in_a_versioned_bucket() {
    if leader_test_support::s3_bucket_or_skip().is_none() {
        return;
    }
    let bucket = format!("leader-versioned-{:08x}", fastrand::u32(..));
    leader_test_support::create_versioned_bucket(&leader_test_support::s3_endpoint(), &bucket)
        .expect("a versioned bucket");
    let store = common::s3_builder(&bucket, "locks/")
        .build()
        .expect("a store");
    conformance::run_all(&Factory { store }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_in_memory_lock_conforms() {
    conformance::run_all(&Factory {
        store: common::memory(),
    })
    .await;
}

/// Two and ten electors on S3 each elect exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform_on_s3() {
    let Some(store) = common::s3_or_skip() else {
        return;
    };
    conformance::electors(&Factory { store }, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_electors_elect_exactly_one_in_memory() {
    conformance::electors_elect_exactly_one(
        &Factory {
            store: common::memory(),
        },
        10,
    )
    .await;
}
