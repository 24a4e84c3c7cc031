//! The `leader-core` conformance suite and several electors on moto's DynamoDB.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dynamodb_lock_conforms() {
    let Some(store) = common::store_or_skip().await else {
        return;
    };
    conformance::run_all(&Factory { store }).await;
}

/// Two and ten electors each elect exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform_on_dynamodb() {
    let Some(store) = common::store_or_skip().await else {
        return;
    };
    conformance::electors(&Factory { store }, false).await;
}
