//! The core conformance suite against a real Postgres, for both locks.

mod common;

use common::Factory;
use leader_core::conformance;

/// The suite on the table lock, or on the advisory lock.
async fn conforms(advisory: bool) {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory { store, advisory }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_lock_conforms() {
    conforms(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn advisory_lock_conforms() {
    conforms(true).await;
}
