//! The `leader-core` conformance suite and several electors on the test Consul server.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_consul_lock_conforms() {
    conformance::run_all(&Factory::start().await).await;
}

/// Two and ten electors each elect exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform() {
    conformance::electors(&Factory::start().await, false).await;
}
