//! Electors on a real three-server ZooKeeper ensemble: exactly one leads, a release wakes the
//! followers through the persistent watch.

mod common;

use common::Factory;
use leader_core::conformance;

/// Two and ten electors each elect exactly one; a release wakes the followers (a watch), and
/// one takes over well within a retry period.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::electors(&Factory { store }, true).await;
}
