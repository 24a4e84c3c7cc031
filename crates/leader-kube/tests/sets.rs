//! A shard set's Leases on the test API server: a round's read is one list, whatever the
//! number of records, and answers as each Lease's own read.

mod common;

use common::{KubeApiServer, client};
use leader_core::{LockSet, ResourceLock};
use leader_kube::LeaseLock;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sets_read_is_one_list() {
    let api = KubeApiServer::start().await;
    let base = LeaseLock::new(client(&api), "default", "jobs-members", "member-1").expect("names");
    let set = base.lock_set("jobs", "member-1").expect("a set");
    let keys: Vec<String> = (0..20).map(|n| format!("jobs-shard-{n}")).collect();
    for key in &keys[..15] {
        set.lock(key)
            .create(&leader_core::conformance::record("member-1", 1))
            .await
            .expect("create");
    }
    // A Lease of another election in the namespace is left out.
    let other = LeaseLock::new(client(&api), "default", "nightly", "x").expect("names");
    other
        .create(&leader_core::conformance::record("x", 1))
        .await
        .expect("create");

    let before = api.lists();
    let read = set.get_many(&keys).await;
    assert_eq!(api.lists() - before, 1, "one list for twenty records");
    assert_eq!(read.len(), keys.len());
    for (key, batch) in keys.iter().zip(&read) {
        let single = set.lock(key).get().await.expect("get");
        assert_eq!(batch.as_ref().expect("read"), &single, "{key}");
    }
    assert!(
        read[15..].iter().all(|r| matches!(r, Ok(None))),
        "absent Leases"
    );

    // A service account without `list` on leases: every record says so, typed.
    api.deny("list");
    let read = set.get_many(&keys).await;
    assert!(
        read.iter()
            .all(|r| matches!(r, Err(leader_core::LockError::Forbidden { .. }))),
        "{:?}",
        read.first()
    );
}
