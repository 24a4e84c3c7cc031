//! Blocking queries as Consul runs them, on the test Consul server: a query on a missing key
//! does not wake for writes to other keys (`KVS.Get` returns `errNotFound` to
//! `blockingquery.Query`), and a restored snapshot wakes every query and sends the index
//! backwards (`FSM.Restore` abandons the state store). The change stream stays correct in
//! both, and fencing tokens never go back with the data.

mod common;

use std::time::Duration;

use common::{ConsulApiServer, lock, store};
use futures_util::StreamExt;
use leader_core::conformance::record;
use leader_core::{Acquisition, LeaderElectionRecord, ResourceLock};

/// The change stream of `lock`, consumed as the elector does (a query always in flight): a
/// receiver of its items.
async fn changes(lock: &impl ResourceLock) -> tokio::sync::mpsc::UnboundedReceiver<()> {
    let mut stream = lock.watch().await.expect("watch").expect("a stream");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(()) = stream.next().await {
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    // Let its first blocking query start.
    tokio::time::sleep(Duration::from_millis(100)).await;
    rx
}

async fn reported(changes: &mut tokio::sync::mpsc::UnboundedReceiver<()>) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(2), changes.recv()).await,
        Ok(Some(()))
    )
}

/// A follower watching an election nobody ran yet wakes when its key is created, and neither
/// for writes to other keys nor with a request each.
#[tokio::test]
async fn a_watch_on_a_missing_key_wakes_for_its_creation_only() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let follower = lock(&store, "missing", "b");
    let mut changes = changes(&follower).await;
    let reads = || api.requests().get("GET /v1/kv").copied().unwrap_or(0);
    let before = reads();
    for i in 0..20 {
        api.put_raw(&format!("{}other-{i}", store.prefix()), b"x");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(changes.try_recv().is_err(), "woken by writes to other keys");
    assert_eq!(reads(), before, "a blocking query answered for other keys");

    let a = lock(&store, "missing", "a");
    let taken = a.try_acquire(&record("a", 0)).await.expect("try");
    assert!(matches!(taken, Some(Acquisition::Acquired(_))));
    assert!(
        reported(&mut changes).await,
        "not woken by the key's creation"
    );
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
    let held = b.renew(&held.version, &held.record).await.expect("renew");
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
