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
