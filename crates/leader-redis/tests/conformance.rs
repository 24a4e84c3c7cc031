//! The core conformance suite against a real Redis.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_lock_conforms() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory::new(store)).await;
}
