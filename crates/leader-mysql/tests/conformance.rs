//! The core conformance suite against a real MySQL or MariaDB, with the shard protocol on the
//! batched set.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_lock_conforms() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory {
        store,
        named: false,
    })
    .await;
}
