//! The core conformance suite against a real Postgres, for both locks.

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
        advisory: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn advisory_lock_conforms() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory {
        store,
        advisory: true,
    })
    .await;
}
