//! Blocking queries as Consul runs them, on the test Consul server: a query on a missing key
//! does not wake for writes to other keys (`KVS.Get` returns `errNotFound` to
//! `blockingquery.Query`), and a restored snapshot wakes every query and sends the index
//! backwards (`FSM.Restore` abandons the state store). The change stream stays correct in
//! both, and fencing tokens never go back with the data.

mod common;

use common::cluster::Cluster;
use common::scenarios::{self, changes, reported};
use common::{ConsulApiServer, lock, store};
use leader_core::conformance::record;
use leader_core::{Acquisition, LeaderElectionRecord, ResourceLock};

#[tokio::test]
async fn a_watch_on_a_missing_key_wakes_for_its_creation_only() {
    scenarios::a_watch_on_a_missing_key_wakes_for_its_creation_only(&Cluster::test().await).await;
}

/// A snapshot restored (the record back to a free one with an older token, the index
/// backwards): the follower's change stream reports it at once, the holder's next renewal
/// conflicts, and the next acquisition's fencing token is above every one the acquiring lock
/// has seen, not the restored token plus one, which was given out already.
#[tokio::test]
async fn a_restored_snapshot_wakes_watchers_and_never_lowers_a_token() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let a = lock(&store, "restore", "a");
    let first = acquired(a.try_acquire(&record("a", 0)).await.expect("try"));
    let released = a
        .update(&first.version, &free(first.record.leader_transitions))
        .await
        .expect("release");
    let snapshot = api.snapshot();

    let b = lock(&store, "restore", "b");
    let held = acquired(b.try_acquire(&record("b", 0)).await.expect("try"));
    assert!(held.record.leader_transitions > released.record.leader_transitions);
    let renewal = leader_test_support::record_writes::renewal(&held.record);
    let held = b.renew(&held.version, &renewal).await.expect("renew");
    let c = lock(&store, "restore", "c");
    assert!(matches!(
        c.try_acquire(&record("c", 0)).await.expect("try"),
        Some(Acquisition::Held { .. })
    ));
    let mut changes = changes(&c).await;

    api.restore(&snapshot);
    assert!(reported(&mut changes).await, "the restore was not reported");
    let renewal = b.renew(&held.version, &held.record).await;
    assert!(
        renewal.is_err_and(|e| e.is_conflict()),
        "the holder goes on"
    );

    let taken = acquired(c.try_acquire(&record("c", 0)).await.expect("try"));
    assert!(
        taken.record.leader_transitions > held.record.leader_transitions,
        "token {} after {} was given out",
        taken.record.leader_transitions,
        held.record.leader_transitions
    );
    // The stream goes on after the index went backwards.
    c.update(&taken.version, &free(taken.record.leader_transitions))
        .await
        .expect("release");
    assert!(reported(&mut changes).await, "a release after the restore");
}

fn acquired(acquisition: Option<Acquisition>) -> leader_core::Observed {
    match acquisition {
        Some(Acquisition::Acquired(observed)) => observed,
        other => panic!("{other:?}"),
    }
}

fn free(leader_transitions: u64) -> LeaderElectionRecord {
    record("", leader_transitions)
}
