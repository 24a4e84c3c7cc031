//! The core conformance suite against the test API server, through a real kube client.

mod common;

use common::{Factory, KubeApiServer};
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_lock_conforms() {
    conformance::run_all(&Factory {
        api: KubeApiServer::start().await,
    })
    .await;
}
