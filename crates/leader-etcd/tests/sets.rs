//! A shard set's records on etcd: a member's records share one etcd lease, a round of renewals
//! is one keep-alive whatever the number of records, a record someone else wrote is not renewed
//! by it, and the records go with the lease when the member dies or the lease is revoked.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use leader_core::backend::{Known, Reread};
use leader_core::conformance::renewals;
use leader_core::{Acquisition, LeaderElectionRecord, LockSet, Observed};
use leader_etcd::{EtcdLockSet, EtcdStore};
use tokio::time::{Instant, sleep};

use common::{store, unique};

const RECORDS: usize = 50;

fn desired(identity: &str, lease: Duration) -> LeaderElectionRecord {
    {
        let mut record = leader_core::conformance::record(identity, 0);
        record.lease_duration = lease;
        record
    }
}

/// Takes every key of `keys` for the set's member.
async fn take_all(
    set: &EtcdLockSet,
    keys: &[String],
    identity: &str,
    lease: Duration,
) -> Vec<(String, Observed)> {
    let mut taken = Vec::new();
    for key in keys {
        let acquired = set
            .lock(key)
            .try_acquire(&desired(identity, lease))
            .await
            .expect("try_acquire");
        let Some(Acquisition::Acquired(observed)) = acquired else {
            panic!("{key} not taken: {acquired:?}");
        };
        taken.push((key.clone(), observed));
    }
    taken
}

/// The etcd leases the keys are on, as etcd tells (0: on none; absent keys left out).
async fn leases_of(store: &EtcdStore, keys: &[String]) -> Vec<i64> {
    let mut client = store.client().await.expect("client");
    let mut leases = Vec::new();
    for key in keys {
        let full = store.lock(key, "reader").key().to_owned();
        let read = client.get(full, None).await.expect("get");
        leases.extend(read.kvs().first().map(|kv| kv.lease()));
    }
    leases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_records_share_one_lease_and_a_round_is_one_keep_alive() {
    let Some(store) = store().await else { return };
    let name = unique("jobs");
    let set = store.lock_set(&name, "member-1");
    let keys: Vec<String> = (0..RECORDS).map(|n| format!("{name}-shard-{n}")).collect();
    let before = store.requests_sent();
    let mut taken = take_all(&set, &keys, "member-1", Duration::from_secs(15)).await;
    let taking = store.requests_sent() - before;
    // Per record taken one after the other: a read (of a key not seen yet), a keep-alive of
    // the member's lease (confirmed after the attempt began) and a transaction; and the grant.
    assert!(
        taking <= 3 * RECORDS as u64 + 2,
        "{taking} requests to take {RECORDS} records"
    );
    let leases: BTreeSet<i64> = leases_of(&store, &keys).await.into_iter().collect();
    assert_eq!(leases.len(), 1, "one lease for all: {leases:?}");
    assert!(!leases.contains(&0), "the records are on a lease");

    // The first round may find the set's watch not running yet (each record then rewritten);
    // once it runs, a round is the lease's keep-alive alone.
    let mut last_round = u64::MAX;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let before = store.requests_sent();
        let renewed = set.renew_many(&renewals(&taken)).await;
        last_round = store.requests_sent() - before;
        for ((key, held), renewed) in taken.iter_mut().zip(renewed) {
            *held = renewed.unwrap_or_else(|err| panic!("{key} not renewed: {err}"));
        }
        if last_round == 1 {
            break;
        }
        sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        last_round, 1,
        "a round of {RECORDS} renewals in one keep-alive"
    );
    let still: BTreeSet<i64> = leases_of(&store, &keys).await.into_iter().collect();
    assert_eq!(still, leases, "the records stay on the member's lease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_someone_else_wrote_is_not_renewed_by_the_keep_alive() {
    let Some(store) = store().await else { return };
    let name = unique("jobs");
    let set = store.lock_set(&name, "member-1");
    let keys: Vec<String> = (0..4).map(|n| format!("{name}-shard-{n}")).collect();
    let taken = take_all(&set, &keys, "member-1", Duration::from_secs(15)).await;
    // The set's watch runs from the first acquisition on.
    sleep(Duration::from_millis(300)).await;
    // Record 2 overwritten behind the member's back (an operator, a stray process).
    let other = store.lock(&keys[2], "member-2");
    leader_core::ResourceLock::update(
        &other,
        &taken[2].1.version,
        &desired("member-2", Duration::from_secs(15)),
    )
    .await
    .expect("taken by member-2");
    sleep(Duration::from_millis(300)).await;
    let renewed = set.renew_many(&renewals(&taken)).await;
    for (i, result) in renewed.iter().enumerate() {
        if i == 2 {
            assert!(
                result
                    .as_ref()
                    .is_err_and(leader_core::LockError::is_conflict),
                "record 2 renewed though member-2 wrote it: {result:?}"
            );
        } else {
            assert!(result.is_ok(), "record {i} not renewed: {result:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_records_go_with_its_lease() {
    let Some(store) = store().await else { return };
    let name = unique("jobs");
    let keys: Vec<String> = (0..10).map(|n| format!("{name}-shard-{n}")).collect();

    // Revoked (`etcdctl lease revoke`): every record goes, every renewal is refused, and the
    // member takes them again on a new lease.
    let set = store.lock_set(&name, "member-1");
    let taken = take_all(&set, &keys, "member-1", Duration::from_secs(15)).await;
    let lease = leases_of(&store, &keys).await[0];
    let mut client = store.client().await.expect("client");
    client.lease_revoke(lease).await.expect("revoke");
    assert!(
        leases_of(&store, &keys).await.is_empty(),
        "keys gone with the lease"
    );
    for result in set.renew_many(&renewals(&taken)).await {
        assert!(
            result
                .as_ref()
                .is_err_and(leader_core::LockError::is_conflict),
            "renewed on a revoked lease: {result:?}"
        );
    }
    take_all(&set, &keys, "member-1", Duration::from_secs(2)).await;
    let again: BTreeSet<i64> = leases_of(&store, &keys).await.into_iter().collect();
    assert_eq!(again.len(), 1, "taken again on one lease: {again:?}");
    assert!(!again.contains(&lease), "not on the revoked lease");

    // The member dies (its set dropped, nothing released): etcd expires its lease, 2 s, and
    // every record with it; another member then takes them.
    drop(set);
    let died = Instant::now();
    while !leases_of(&store, &keys).await.is_empty() {
        assert!(
            died.elapsed() < Duration::from_secs(10),
            "the records outlived their member's lease"
        );
        sleep(Duration::from_millis(100)).await;
    }
    let other = store.lock_set(&name, "member-2");
    take_all(&other, &keys, "member-2", Duration::from_secs(2)).await;
}

/// A record on the member's own lease that its runner no longer counts as a term (one that
/// ended by its deadline while the lease, kept alive for the others, kept the record) is taken
/// again by that member, with the next token; never by another process given the same
/// identity (S13), whose lease it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_on_the_members_own_lease_is_taken_again_by_it_alone() {
    let Some(store) = store().await else { return };
    let name = unique("jobs");
    let keys = vec![format!("{name}-shard-0")];
    let set = store.lock_set(&name, "member-1");
    let first = take_all(&set, &keys, "member-1", Duration::from_secs(15)).await;
    let token = first[0].1.record.leader_transitions;

    let twin = store.lock_set(&name, "member-1");
    let held = twin
        .lock(&keys[0])
        .try_acquire(&desired("member-1", Duration::from_secs(15)))
        .await
        .expect("try_acquire");
    assert!(
        matches!(held, Some(Acquisition::Held { .. })),
        "another process with the same identity took it: {held:?}"
    );

    let again = take_all(&set, &keys, "member-1", Duration::from_secs(15)).await;
    assert!(
        again[0].1.record.leader_transitions > token,
        "taken again with token {} after {token}",
        again[0].1.record.leader_transitions
    );
}

/// A handover request written on a shard's record (`leader handover` on its key) ends the
/// holder's term, since its renewal finds the record changed; the record stays on the
/// member's lease, which lives on, so when the member comes to take it again it releases it to
/// the candidate the request names instead, who takes it with the next token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_request_on_a_shard_hands_it_over() {
    let Some(store) = store().await else { return };
    let name = unique("jobs");
    let keys = vec![format!("{name}-shard-0")];
    let set = store.lock_set(&name, "member-1");
    let taken = take_all(&set, &keys, "member-1", Duration::from_secs(15)).await;
    sleep(Duration::from_millis(300)).await;
    let operator = store.lock(&keys[0], "operator");
    leader_core::request_handover(&operator, "member-2")
        .await
        .expect("handover asked");
    sleep(Duration::from_millis(300)).await;
    let renewed = set.renew_many(&renewals(&taken)).await;
    assert!(
        renewed[0]
            .as_ref()
            .is_err_and(leader_core::LockError::is_conflict),
        "renewed over a handover request: {renewed:?}"
    );
    let again = set
        .lock(&keys[0])
        .try_acquire(&desired("member-1", Duration::from_secs(15)))
        .await
        .expect("try_acquire");
    let Some(Acquisition::Held { observed, .. }) = again else {
        panic!("member-1 took the shard over the request: {again:?}");
    };
    assert!(observed.record.is_free(), "released: {observed:?}");
    assert_eq!(observed.record.handover_to(), Some("member-2"));
    let other = store.lock_set(&name, "member-2");
    let handed = take_all(&other, &keys, "member-2", Duration::from_secs(15)).await;
    assert!(handed[0].1.record.leader_transitions > taken[0].1.record.leader_transitions);
}

/// Reads of the set's records as a reader that never holds them: `get_many` of a fresh set
/// (one range read), for comparison.
async fn read_fresh(store: &EtcdStore, name: &str, keys: &[String]) -> Vec<Option<Observed>> {
    store
        .lock_set(name, "reader")
        .get_many(keys)
        .await
        .into_iter()
        .map(|r| r.expect("read"))
        .collect()
}

/// Once the set's watch has a start (a range read of the set), a member's round, renewals and
/// read together, is one request (the keep-alive): the read comes from the watch. It shows
/// another client's write once the watch reports it, and this member's own writes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_is_one_request_and_its_read_comes_from_the_watch() {
    let Some(store) = store().await else { return };
    let name = unique("jobs");
    let set = store.lock_set(&name, "member-1");
    let mut keys: Vec<String> = (0..RECORDS).map(|n| format!("{name}-shard-{n}")).collect();
    // A lease of a part of a millisecond, which the stored record does not keep: a read must
    // answer what is stored, never what this member wrote.
    let lease = Duration::from_micros(15_000_250);
    let mut taken = take_all(&set, &keys, "member-1", lease).await;
    // A key nobody holds is read too.
    keys.push(format!("{name}-roster"));
    let unknown = vec![leader_core::backend::Known::Nothing; keys.len()];
    let round = async |set: &EtcdLockSet, taken: &mut Vec<(String, Observed)>| {
        let before = store.requests_sent();
        let answer = set.renew_and_read(&renewals(taken), &keys, &unknown).await;
        let sent = store.requests_sent() - before;
        for ((key, held), renewed) in taken.iter_mut().zip(answer.renewed) {
            *held = renewed.unwrap_or_else(|err| panic!("{key} not renewed: {err}"));
        }
        let read: Vec<Option<Observed>> = answer
            .read
            .into_iter()
            .map(|r| match r.expect("read") {
                leader_core::backend::Reread::Now(observed) => observed,
                leader_core::backend::Reread::Same => panic!("unchanged, though nothing was known"),
            })
            .collect();
        (sent, read)
    };
    let mut last = (u64::MAX, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        last = round(&set, &mut taken).await;
        if last.0 == 1 {
            break;
        }
        sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        last.0, 1,
        "a round of {RECORDS} renewals and a read in one request"
    );
    assert_eq!(
        last.1,
        read_fresh(&store, &name, &keys).await,
        "the read from the watch differs from a range read"
    );
    // A reader that holds what it read is told that nothing changed: renewals through the
    // member's lease keep every record's revision.
    let held = last.1.clone();
    let known: Vec<Known<'_>> = held
        .iter()
        .map(|read| {
            read.as_ref()
                .map_or(Known::Absent, |o| Known::Version(&o.version))
        })
        .collect();
    let changed = |answers: Vec<Result<Reread, leader_core::LockError>>| -> Vec<usize> {
        answers
            .into_iter()
            .enumerate()
            .filter(|(_, answer)| !matches!(answer, Ok(Reread::Same)))
            .map(|(i, _)| i)
            .collect()
    };
    let before = store.requests_sent();
    let unchanged = set.get_changed(&keys, &known).await;
    assert_eq!(store.requests_sent(), before, "read from the watch");
    assert_eq!(
        changed(unchanged),
        Vec::<usize>::new(),
        "records said changed"
    );

    // Another client's write: seen once the watch reports it, still without a request.
    let elsewhere = common::store().await.expect("another client");
    let other = elsewhere.lock(&keys[RECORDS], "member-2");
    leader_core::ResourceLock::create(&other, &desired("member-2", Duration::from_secs(15)))
        .await
        .expect("created by member-2");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (sent, read) = round(&set, &mut taken).await;
        assert_eq!(sent, 1, "a round in one request");
        let holder = read[RECORDS]
            .as_ref()
            .map(|o| o.record.holder_identity.clone());
        if holder.as_deref() == Some("member-2") {
            // Only that record is sent again, as the range read has it.
            let answers = set.get_changed(&keys, &known).await;
            let fresh = read_fresh(&store, &name, &keys).await;
            assert_eq!(
                answers[RECORDS].as_ref().expect("read"),
                &Reread::Now(fresh[RECORDS].clone()),
            );
            assert_eq!(changed(answers), vec![RECORDS], "records said changed");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "another client's write never read"
        );
        sleep(Duration::from_millis(50)).await;
    }

    // This member's own write: read at once (from etcd if the watch has not reported it).
    let (key, held) = taken.pop().expect("taken");
    let released = {
        let mut record = held.record.clone();
        record.holder_identity = String::new();
        record
    };
    let written = set
        .lock(&key)
        .update(&held.version, &released)
        .await
        .expect("released");
    let read = set.get_many(std::slice::from_ref(&key)).await;
    let read = read[0].as_ref().expect("read").as_ref().expect("present");
    assert_eq!(
        read.version, written.version,
        "a read missed this member's write"
    );
    assert_eq!(read.record.holder_identity, "");
}

/// A set whose records together pass the 4 MiB a gRPC answer holds by default (here 200
/// records of 32 KiB with their extensions) is read whole: in pages, at one revision, each
/// taken up to far more. One range read failed every round before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_larger_than_one_answer_is_read_whole() {
    let Some(store) = store().await else { return };
    let name = unique("large");
    let set = store.lock_set(&name, "member-1");
    let keys: Vec<String> = (0..200).map(|i| format!("{name}-shard-{i}")).collect();
    let mut record = leader_core::conformance::record("member-1", 1);
    record
        .extensions
        .insert("padding".to_owned(), "x".repeat(16 * 1024));
    for key in &keys {
        set.lock(key).create(&record).await.expect("create");
    }
    let read = set.get_many(&keys).await;
    let prefix = store.lock(format!("{name}-shard-"), "x").key().to_owned();
    store
        .client()
        .await
        .expect("client")
        .delete(
            prefix,
            Some(etcd_client::DeleteOptions::new().with_prefix()),
        )
        .await
        .expect("clean up");
    for (key, answer) in keys.iter().zip(read) {
        let observed = answer
            .unwrap_or_else(|err| panic!("{key}: {err}"))
            .unwrap_or_else(|| panic!("{key}: absent"));
        assert_eq!(observed.record.extensions, record.extensions, "{key}");
    }
}
