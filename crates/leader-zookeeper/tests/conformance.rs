//! The core conformance suite against a real three-server ZooKeeper ensemble, the shard
//! protocol on an election znode per record.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zookeeper_lock_conforms() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory { store }).await;
}
