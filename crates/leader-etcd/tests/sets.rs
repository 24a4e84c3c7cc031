//! A shard set's records on a real etcd: all of a member's records on one etcd lease, a round of
//! renewals one keep-alive message whatever their number, and that lease's end the end of every
//! record on it.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use etcd_client::GetOptions;
use leader_core::{Acquisition, LeaderElectionRecord, LockSet, Observed, Renewal};
use leader_etcd::{EtcdLockSet, EtcdStore};

const RECORDS: usize = 20;

fn desired(identity: &str) -> LeaderElectionRecord {
    leader_core::conformance::record(identity, 0)
}

/// `RECORDS` records of a fresh set taken by `set`: their keys and what was stored.
async fn take_all(set: &EtcdLockSet, name: &str) -> Vec<(String, Observed)> {
    let mut taken = Vec::new();
    for n in 0..RECORDS {
        let key = format!("{name}-shard-{n}");
        let acquired = set
            .lock(&key)
            .try_acquire(&desired(set.identity()))
            .await
            .expect("try_acquire");
        let Some(Acquisition::Acquired(observed)) = acquired else {
            panic!("{key} not taken: {acquired:?}");
        };
        taken.push((key, observed));
    }
    taken
}

fn renewals(taken: &[(String, Observed)]) -> Vec<Renewal> {
    taken
        .iter()
        .map(|(key, observed)| Renewal {
            key: key.clone(),
            version: observed.version.clone(),
            record: observed.record.clone(),
        })
        .collect()
}

/// The etcd leases the set's record keys are on, by key.
async fn leases(store: &EtcdStore, name: &str) -> BTreeMap<String, i64> {
    let prefix = format!(
        "{}{name}-shard-",
        common::prefix().unwrap_or_else(|| leader_etcd::DEFAULT_PREFIX.to_owned())
    );
    let read = store
        .client()
        .await
        .expect("client")
        .get(prefix.clone(), Some(GetOptions::new().with_prefix()))
        .await
        .expect("read");
    read.kvs()
        .iter()
        .filter(|kv| !kv.key_str().unwrap_or("").contains('.'))
        .map(|kv| (kv.key_str().unwrap_or("").to_owned(), kv.lease()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_renewals_is_one_keep_alive() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = common::unique("one-lease");
    let set = store.lock_set("member-1");
    let taken = take_all(&set, &name).await;
    let on = leases(&store, &name).await;
    assert_eq!(on.len(), RECORDS, "every record written: {on:?}");
    let distinct: BTreeSet<i64> = on.values().copied().collect();
    assert_eq!(distinct.len(), 1, "one etcd lease for all: {on:?}");
    assert!(distinct.iter().all(|&l| l != 0), "on a lease: {on:?}");

    let renewals = renewals(&taken);
    // The first round opens the keep-alive stream.
    for renewed in set.renew_many(&renewals).await {
        renewed.expect("renewed");
    }
    for _ in 0..3 {
        let before = store.requests_sent();
        for renewed in set.renew_many(&renewals).await {
            renewed.expect("renewed");
        }
        assert_eq!(
            store.requests_sent() - before,
            1,
            "a round of {RECORDS} renewals is one keep-alive"
        );
    }

    // A release takes its record off the lease; the others go on, still one message a round.
    let (released_key, held) = &taken[0];
    let mut free = held.record.clone();
    free.holder_identity = String::new();
    set.lock(released_key)
        .update(&held.version, &free)
        .await
        .expect("release");
    let on = leases(&store, &name).await;
    assert_eq!(
        on.get(&format!(
            "{}{released_key}",
            common::prefix().unwrap_or_else(|| leader_etcd::DEFAULT_PREFIX.to_owned())
        )),
        Some(&0)
    );
    let rest = &renewals[1..];
    let before = store.requests_sent();
    for renewed in set.renew_many(rest).await {
        renewed.expect("renewed after another's release");
    }
    assert_eq!(store.requests_sent() - before, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_gone_ends_every_record_and_frees_them() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = common::unique("lease-gone");
    let set = store.lock_set("member-1");
    let taken = take_all(&set, &name).await;
    let lease = *leases(&store, &name)
        .await
        .values()
        .next()
        .expect("a record");
    // What etcd does when the member stops keeping it alive, at once.
    store
        .client()
        .await
        .expect("client")
        .lease_revoke(lease)
        .await
        .expect("revoke");
    let renewed = set.renew_many(&renewals(&taken)).await;
    assert!(
        renewed
            .iter()
            .all(|r| r.as_ref().is_err_and(|e| e.is_conflict())),
        "every record lost with the lease: {renewed:?}"
    );
    assert!(
        leases(&store, &name).await.is_empty(),
        "the keys went with it"
    );

    // Another member takes them, with greater tokens; the first takes new ones on a new lease.
    let other = store.lock_set("member-2");
    let again = take_all(&other, &name).await;
    for ((_, before), (_, after)) in taken.iter().zip(&again) {
        assert!(after.record.leader_transitions > before.record.leader_transitions);
    }
    let on: BTreeSet<i64> = leases(&store, &name).await.values().copied().collect();
    assert_eq!(on.len(), 1);
    assert!(!on.contains(&lease));
}
