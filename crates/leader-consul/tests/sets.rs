//! A shard set's records on the test Consul server: a round's read is one transaction, its
//! renewals one transaction per 42 records (Consul's transactions hold at most 128 operations,
//! a renewal three), and a record lost in a transaction leaves the others renewed.

mod common;

use common::{ConsulApiServer, store};
use leader_core::conformance::renewals;
use leader_core::{Acquisition, LeaderElectionRecord, LockSet, Observed, ResourceLock};

const RECORDS: usize = 100;

fn desired(identity: &str) -> LeaderElectionRecord {
    leader_core::conformance::record(identity, 0)
}

fn txns(api: &ConsulApiServer) -> usize {
    api.requests().get("PUT /v1/txn").copied().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_costs_a_read_and_a_renewal_per_42_records() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let set = store.lock_set("jobs", "member-1").expect("a set");
    let keys: Vec<String> = (0..RECORDS).map(|n| format!("jobs-shard-{n}")).collect();
    let mut taken = Vec::new();
    for key in &keys {
        let acquired = set
            .lock(key)
            .try_acquire(&desired("member-1"))
            .await
            .expect("try_acquire");
        let Some(Acquisition::Acquired(observed)) = acquired else {
            panic!("{key} not taken: {acquired:?}");
        };
        taken.push((key.clone(), observed));
    }

    let before = txns(&api);
    let read = set.get_many(&keys).await;
    assert_eq!(txns(&api) - before, 1, "the set read in one transaction");
    for ((key, held), read) in taken.iter().zip(&read) {
        let read = read.as_ref().expect("read").as_ref().expect("present");
        assert_eq!(read, held, "{key} as its lock stored it");
    }

    let before = txns(&api);
    let renewed = set.renew_many(&renewals(&taken)).await;
    assert_eq!(
        txns(&api) - before,
        RECORDS.div_ceil(42),
        "{RECORDS} records renewed in transactions of 42"
    );
    let renewed: Vec<Observed> = renewed.into_iter().map(|r| r.expect("renewed")).collect();
    for ((_, held), now) in taken.iter_mut().zip(&renewed) {
        assert_ne!(held.version, now.version, "the renewal key written");
        *held = now.clone();
    }

    // Record 3 taken over behind this member's back (as after a freeze): its transaction is
    // refused as a whole, and its other 41 records are renewed one by one.
    let other = store.lock(&keys[3], "member-2").expect("a lock");
    other
        .update(&taken[3].1.version, &desired("member-2"))
        .await
        .expect("taken over");
    let before = txns(&api);
    let renewed = set.renew_many(&renewals(&taken)).await;
    let sent = txns(&api) - before;
    for (n, answer) in renewed.iter().enumerate() {
        if n == 3 {
            assert!(
                answer.as_ref().is_err_and(|e| e.is_conflict()),
                "the record taken over is lost: {answer:?}"
            );
        } else {
            answer.as_ref().expect("the others renewed");
        }
    }
    assert_eq!(sent, 3 + 42, "the refused transaction's records one by one");
}

/// A token Consul no longer takes refuses the whole set, and each record's own request the
/// same: a round that meets it answers every record so in its one read and one transaction per
/// 42 renewals, never a request per record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_costs_no_request_per_record() {
    let api = ConsulApiServer::start().await;
    api.require_token("member");
    let store = leader_consul::ConsulStore::builder(api.url())
        .prefix(common::prefix())
        .token("member")
        .build()
        .expect("a store");
    let set = store.lock_set("jobs", "member-1").expect("a set");
    let keys: Vec<String> = (0..RECORDS).map(|n| format!("jobs-shard-{n}")).collect();
    let mut taken = Vec::new();
    for key in &keys {
        let Ok(Some(Acquisition::Acquired(observed))) =
            set.lock(key).try_acquire(&desired("member-1")).await
        else {
            panic!("{key} not taken");
        };
        taken.push((key.clone(), observed));
    }
    api.revoke("member");
    let all = |api: &ConsulApiServer| api.requests().values().sum::<usize>();
    let before = all(&api);
    let read = set.get_many(&keys).await;
    assert_eq!(all(&api) - before, 1, "one read");
    assert!(
        read.iter()
            .all(|r| matches!(r, Err(leader_core::LockError::Forbidden { .. }))),
        "{read:?}"
    );
    let before = txns(&api);
    let renewed = set.renew_many(&renewals(&taken)).await;
    assert_eq!(
        txns(&api) - before,
        RECORDS.div_ceil(42),
        "one per 42 renewals"
    );
    assert!(
        renewed
            .iter()
            .all(|r| matches!(r, Err(leader_core::LockError::Forbidden { .. }))),
        "{renewed:?}"
    );
}
