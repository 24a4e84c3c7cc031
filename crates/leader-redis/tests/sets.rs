//! A shard set's records on Redis: a record whose holder stops renewing it is gone from the
//! set's next read once its lease has run out, which is why the members of a set on Redis
//! never probe each other's records (`LockSet::reads_show_expiry`).

mod common;

use std::time::Duration;

use leader_core::{Acquisition, LeaderElectionRecord, LockSet};

use common::{store, unique};

#[tokio::test]
async fn a_record_not_renewed_is_gone_from_the_read_after_its_lease() {
    let Some(store) = store().await else { return };
    let set = store.lock_set("member-1");
    assert!(set.reads_show_expiry());
    let key = format!("{}-member-1", unique("jobs"));
    let desired = LeaderElectionRecord {
        lease_duration: Duration::from_millis(500),
        ..leader_core::conformance::record("member-1", 0)
    };
    let taken = set
        .lock(&key)
        .try_acquire(&desired)
        .await
        .expect("try_acquire");
    assert!(matches!(taken, Some(Acquisition::Acquired(_))), "{taken:?}");
    let read = set.get_many(std::slice::from_ref(&key)).await;
    assert!(
        read[0].as_ref().expect("read").is_some(),
        "present while held"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    let read = set.get_many(std::slice::from_ref(&key)).await;
    assert!(
        read[0].as_ref().expect("read").is_none(),
        "still read after its lease: {read:?}"
    );
}
