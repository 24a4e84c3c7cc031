//! The core conformance suite against a real NATS server with JetStream, the shard protocol on
//! a key per record.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn key_value_lock_conforms() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory { store }).await;
}
