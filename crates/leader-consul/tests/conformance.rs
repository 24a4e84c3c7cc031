//! The `leader-core` conformance suite and several electors on the test Consul server.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_consul_lock_conforms() {
    conformance::run_all(&Factory::start().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_electors_elect_exactly_one() {
    conformance::electors_elect_exactly_one(&Factory::start().await, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_electors_elect_exactly_one() {
    conformance::electors_elect_exactly_one(&Factory::start().await, 10).await;
}
