//! A conformance suite for [`ResourceLock`] implementations (feature `testing`).
//!
//! Not API-stable: checks are added as the contract is sharpened, and a new check may fail a
//! backend that passed before; that is its purpose.
//!
//! Every backend of this workspace runs it against a real server, and a third-party backend can run
//! it the same way: implement [`LockFactory`] and call [`run_all`] from a test. Each check uses an
//! election name of its own with a random suffix, so the suite can share a server with other tests.
//! A failed check panics with a message that names the broken rule.
//!
//! ```ignore
//! #[tokio::test]
//! async fn conformance() {
//!     leader_core::conformance::run_all(&MyFactory::connect().await).await;
//! }
//! ```

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, SubsecRound, Utc};
use futures_util::StreamExt;
use tokio::task::JoinSet;

mod shards;

pub use shards::{Interval, ShardLog, balanced, batches_answer_as_their_locks, shard_protocol};

use crate::background::{Candidate, LEASE, RENEW, RETRY};
use crate::{
    Acquisition, LeaderElectionRecord, LeaderElector, LockError, Observed, ResourceLock, Version,
    request_handover,
};

/// Makes locks of one backend for the suite.
#[async_trait]
pub trait LockFactory: Send + Sync {
    /// A lock on election `name` for candidate `identity`. Locks with the same name contend for the
    /// same stored object.
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock>;

    /// Stores, under election `name`, a value that is not a valid record, as a broken writer
    /// would (the wrong type, garbage bytes, nonsense fields), and returns `true`; or returns
    /// `false` when the store checks what it holds so that no such value can be stored (a
    /// Kubernetes API server validates every Lease), and the check that needs one is skipped.
    async fn corrupt(&self, name: &str) -> bool;

    /// How much longer than the suite's default bounds the store may take to expire a lease
    /// whose holder is gone without a word (the default bounds suit stores that expire a lease
    /// within a few seconds of its duration). A Consul session, for one, lives at least 10 s
    /// and is invalidated up to twice its TTL after its last renewal. Default: none.
    fn extra_expiry(&self) -> Duration {
        Duration::ZERO
    }

    /// The backend's own [`LockSet`](crate::LockSet) for member `identity`, when it has one
    /// (batched reads and renewals): the suite checks that its batches answer as the locks of
    /// its keys would, and runs the shard protocol on it. Default: none, and the shard protocol
    /// runs on locks from [`lock`](Self::lock), one request per record.
    async fn lock_set(&self, identity: &str) -> Option<Box<dyn crate::LockSet>> {
        let _ = identity;
        None
    }
}

/// Runs every check of the suite, one after the other.
pub async fn run_all(factory: &dyn LockFactory) {
    absent_object(factory).await;
    create_then_get(factory).await;
    create_conflicts_when_present(factory).await;
    update_is_compare_and_swap(factory).await;
    identical_writes_move_the_version(factory).await;
    fields_round_trip(factory).await;
    acquisitions_keep_the_extensions(factory).await;
    extensions_outlive_a_crashed_holder(factory).await;
    concurrent_creates_have_one_winner(factory).await;
    concurrent_updates_have_one_winner(factory).await;
    invalid_record_is_reported_and_kept(factory).await;
    odd_records_do_not_block_the_election(factory).await;
    identity_and_describe(factory).await;
    election_name_is_the_given_name(factory).await;
    change_notifications(factory).await;
    store_clock_acquisition(factory).await;
    fencing_token_floor(factory).await;
    renewals_keep_the_lease(factory).await;
    handover_requests(factory).await;
    electors_elect_one_and_hand_over(factory).await;
    wall_clock_steps(factory).await;
    planned_handover(factory).await;
    one_identity_one_process(factory).await;
    batches_answer_as_their_locks(factory).await;
    shard_protocol(factory).await;
}

fn unique(test: &str) -> String {
    format!("conformance-{test}-{:08x}", fastrand::u32(..))
}

/// Times as every backend can store them: whole microseconds.
fn now() -> DateTime<Utc> {
    Utc::now().trunc_subsecs(6)
}

/// The renewals, now, of records held as `taken` says (key, record as stored): what a shard
/// set member's round sends to [`LockSet::renew_many`](crate::LockSet::renew_many).
pub fn renewals(taken: &[(String, Observed)]) -> Vec<crate::Renewal> {
    taken
        .iter()
        .map(|(key, observed)| {
            let mut record = observed.record.clone();
            record.renew_time = record.renewal_time(now());
            crate::Renewal {
                key: key.clone(),
                version: observed.version.clone(),
                record,
            }
        })
        .collect()
}

/// A record held by `holder`, with a whole-second lease as every backend can store it.
pub fn record(holder: &str, leader_transitions: u64) -> LeaderElectionRecord {
    let now = now();
    LeaderElectionRecord {
        holder_identity: holder.to_owned(),
        lease_duration: Duration::from_secs(15),
        acquire_time: now,
        renew_time: now,
        leader_transitions,
        strategy: None,
        preferred_holder: None,
        extensions: std::collections::BTreeMap::new(),
    }
}

fn assert_stored(context: &str, written: &LeaderElectionRecord, stored: &Observed) {
    let mut expected = written.clone();
    assert!(
        stored.record.leader_transitions >= written.leader_transitions,
        "{context}: the stored leader_transitions ({}) is lower than written ({})",
        stored.record.leader_transitions,
        written.leader_transitions
    );
    expected.leader_transitions = stored.record.leader_transitions;
    assert_eq!(
        stored.record, expected,
        "{context}: the stored record differs from the written one"
    );
}

fn assert_conflict<T: std::fmt::Debug>(context: &str, result: Result<T, LockError>) {
    match result {
        Err(LockError::Conflict { .. }) => {}
        other => panic!("{context}: expected a conflict, got {other:?}"),
    }
}

async fn get(context: &str, lock: &dyn ResourceLock) -> Option<Observed> {
    lock.get()
        .await
        .unwrap_or_else(|err| panic!("{context}: get failed: {err}"))
}

/// `get` of an object that does not exist is `None`; `update` of it is a conflict.
pub async fn absent_object(factory: &dyn LockFactory) {
    let lock = factory.lock(&unique("absent"), "a").await;
    assert_eq!(
        get("absent object", &*lock).await,
        None,
        "absent object: get must return None"
    );
    assert_conflict(
        "update of an absent object",
        lock.update(&Version::new("1"), &record("a", 1)).await,
    );
    assert_eq!(
        get("absent object after update", &*lock).await,
        None,
        "a failed update created the object"
    );
}

/// `create` stores the record and `get` returns it with the same version.
pub async fn create_then_get(factory: &dyn LockFactory) {
    let lock = factory.lock(&unique("create"), "a").await;
    let written = record("a", 1);
    let created = lock.create(&written).await.expect("create of a new object");
    assert_stored("create", &written, &created);
    assert_eq!(
        get("get after create", &*lock).await,
        Some(created),
        "get must return what create stored"
    );
}

/// A second `create`, from any candidate, is a conflict and changes nothing.
pub async fn create_conflicts_when_present(factory: &dyn LockFactory) {
    let name = unique("create-conflict");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let created = a.create(&record("a", 1)).await.expect("first create");
    assert_conflict(
        "create of an existing object",
        b.create(&record("b", 1)).await,
    );
    assert_conflict(
        "create of an existing object by its holder",
        a.create(&record("a", 2)).await,
    );
    assert_eq!(
        get("after conflicting creates", &*b).await,
        Some(created),
        "a failed create changed the record"
    );
}

/// `update` succeeds with the current version only, and every success yields a new version.
pub async fn update_is_compare_and_swap(factory: &dyn LockFactory) {
    let name = unique("cas");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let v1 = a.create(&record("a", 1)).await.expect("create");
    let renewed = record("a", v1.record.leader_transitions);
    let v2 = a
        .update(&v1.version, &renewed)
        .await
        .expect("update with the current version");
    assert_stored("update", &renewed, &v2);
    assert_ne!(v1.version, v2.version, "an update must change the version");
    assert_conflict(
        "update with a stale version",
        b.update(&v1.version, &record("b", 9)).await,
    );
    assert_eq!(
        get("after a stale update", &*b).await,
        Some(v2.clone()),
        "a stale update changed the record"
    );
    // Another candidate takes over from the current version (after a release, as a backend
    // that ties the lease to a session, such as an advisory lock, requires).
    let released = a
        .update(&v2.version, &free(v2.record.leader_transitions))
        .await
        .expect("release");
    let taken = record("b", released.record.leader_transitions + 1);
    let v3 = b
        .update(&released.version, &taken)
        .await
        .expect("update by another candidate");
    assert_stored("takeover", &taken, &v3);
    assert_conflict(
        "update with the version before the takeover",
        a.update(&released.version, &renewed).await,
    );
    assert_conflict(
        "update with an older version",
        a.update(&v2.version, &renewed).await,
    );
}

/// A write of the record exactly as stored moves the version, or is refused (S14). Some
/// stores skip a write of what they hold (kube-apiserver's `GuaranteedUpdate`, Consul's
/// `kvsSetTxn`) and answer it with the version they had: a lock that took that answer as done
/// would leave a holder who believes it renewed beside a follower whose compare-and-swap on
/// the unchanged version succeeds. Updates and renewals alike, twice each; a renewal may keep
/// the version only where the store keeps the lease alive itself (`renewed_in_store`).
pub async fn identical_writes_move_the_version(factory: &dyn LockFactory) {
    let name = unique("identical");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let mut current = match a.try_acquire(&record("a", 1)).await.expect("try_acquire") {
        Some(Acquisition::Acquired(taken)) => taken,
        None => a.create(&record("a", 1)).await.expect("create"),
        Some(other) => panic!("identical writes: a free lease was not acquired: {other:?}"),
    };
    for operation in ["update", "update", "renew", "renew"] {
        let same = current.record.clone();
        let written = match operation {
            "update" => a.update(&current.version, &same).await,
            _ => a.renew(&current.version, &same).await,
        };
        match written {
            Ok(stored) if stored.version != current.version => {
                assert_conflict(
                    &format!(
                        "identical writes: an update at the version before an identical {operation}"
                    ),
                    b.update(&current.version, &record("b", 99)).await,
                );
                current = stored;
            }
            Ok(stored) if operation == "renew" => {
                let seen = b.try_acquire(&record("b", 0)).await.expect("try_acquire");
                assert!(
                    matches!(
                        seen,
                        Some(Acquisition::Held {
                            renewed_in_store: true,
                            ..
                        })
                    ),
                    "identical writes: a renewal of the record as stored kept its version ({}) \
                     though the store does not keep the lease alive itself ({seen:?}): a \
                     follower's compare-and-swap on it would succeed",
                    current.version.as_str()
                );
                current = stored;
            }
            Ok(_) => panic!(
                "identical writes: an {operation} of the record as stored was answered with \
                 the version it had ({}): a store that skipped it renewed nothing, and a \
                 follower's compare-and-swap on that version would succeed",
                current.version.as_str()
            ),
            Err(err) => {
                assert!(
                    !err.is_conflict(),
                    "identical writes: an {operation} at the current version conflicted: {err}"
                );
                current = get("identical writes", &*a).await.expect("the record");
            }
        }
    }
}

/// A released lease: an empty holder.
fn free(leader_transitions: u64) -> LeaderElectionRecord {
    let mut free = record("", leader_transitions);
    free.lease_duration = Duration::from_secs(1);
    free
}

/// Free records (released leases), strategy and preferred holder survive a round trip.
pub async fn fields_round_trip(factory: &dyn LockFactory) {
    let lock = factory.lock(&unique("fields"), "a").await;
    let mut written = record("a", 7);
    written.preferred_holder = Some("b".into());
    written.strategy = Some("OldestEmulationVersion".into());
    let created = lock.create(&written).await.expect("create");
    assert_stored(
        "create with strategy and preferred holder",
        &written,
        &created,
    );
    let free = free(created.record.leader_transitions);
    let released = lock.update(&created.version, &free).await.expect("release");
    assert_stored("release (empty holder)", &free, &released);
    assert_eq!(
        get("after release", &*lock).await,
        Some(released.clone()),
        "get after release"
    );
    // Extensions: any keys and values a feature writes, JSON with quotes and unicode included.
    let mut extended = record("a", released.record.leader_transitions + 1);
    extended.extensions = extensions();
    let written = lock
        .update(&released.version, &extended)
        .await
        .expect("update with extensions");
    assert_stored("update with extensions", &extended, &written);
    assert_eq!(
        get("after extensions", &*lock)
            .await
            .map(|o| o.record.extensions),
        Some(extensions()),
        "extensions as stored"
    );
    let mut renewal = written.record.clone();
    renewal.renew_time = renewal.renewal_time(now());
    let renewed = lock.renew(&written.version, &renewal).await.expect("renew");
    assert_eq!(
        get("after a renewal", &*lock)
            .await
            .map(|o| o.record.extensions),
        Some(extensions()),
        "a renewal keeps the extensions"
    );
    let mut cleared = renewed.record.clone();
    cleared.extensions.clear();
    let cleared = lock
        .update(&renewed.version, &cleared)
        .await
        .expect("clear");
    assert!(cleared.record.extensions.is_empty());
    assert_eq!(
        get("after clearing", &*lock)
            .await
            .map(|o| o.record.extensions.is_empty()),
        Some(true),
        "extensions removed"
    );
}

/// Extensions as a feature would write them.
fn extensions() -> std::collections::BTreeMap<String, String> {
    std::collections::BTreeMap::from([
        (
            "cron/nightly-report".to_owned(),
            r#"{"at":"2026-01-01T00:00:00Z","token":7,"outcome":"started: \"ok\" ✓"}"#.to_owned(),
        ),
        ("shards".to_owned(), "16".to_owned()),
    ])
}

/// An acquisition keeps the stored extensions, whatever the candidate's record says: only a
/// holder changes them, with a compare-and-swap, so a store-clock acquisition by a candidate
/// that read them long ago never rolls them back; a handover request and a release keep them.
pub async fn acquisitions_keep_the_extensions(factory: &dyn LockFactory) {
    let name = unique("extensions");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let mut held = record("a", 1);
    held.extensions = extensions();
    let created = a.create(&held).await.expect("create");
    let requested = crate::request_handover(&*b, "b")
        .await
        .expect("handover request");
    assert_eq!(
        requested.record.extensions,
        extensions(),
        "a handover request keeps the extensions"
    );
    let mut released = requested.record.clone();
    released.holder_identity.clear();
    released.preferred_holder = None;
    let released = a
        .update(&requested.version, &released)
        .await
        .expect("release");
    assert_eq!(
        released.record.extensions,
        extensions(),
        "a release keeps them"
    );
    let mut stale = record("b", 0);
    stale.extensions =
        std::collections::BTreeMap::from([("cron/nightly-report".to_owned(), "stale".to_owned())]);
    let taken = match b.try_acquire(&stale).await.expect("try_acquire") {
        Some(Acquisition::Acquired(taken)) => Some(taken),
        Some(Acquisition::Handed { observed, .. }) => Some(observed),
        None => None,
        other => panic!("try_acquire of a free lease must acquire, got {other:?}"),
    };
    if let Some(taken) = taken {
        assert_eq!(
            taken.record.extensions,
            extensions(),
            "a store-clock acquisition keeps the stored extensions, not the candidate's"
        );
        assert_eq!(
            get("after the acquisition", &*b)
                .await
                .map(|o| o.record.extensions),
            Some(extensions())
        );
    }
    let _ = created;
    a.close().await;
    b.close().await;
}

/// The extensions outlive a holder that crashed: a store that expires the lease by dropping the
/// record (an etcd key on a lease, a Redis key with a TTL) keeps them apart, and the next
/// acquisition carries them on; a store that keeps the record keeps them in it. Work recorded
/// there (a scheduled job's last firing, say) is never lost with its leader.
pub async fn extensions_outlive_a_crashed_holder(factory: &dyn LockFactory) {
    let name = unique("crashed-extensions");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let lease = Duration::from_secs(1);
    let mut held = record("a", 1);
    held.lease_duration = lease;
    held.extensions = extensions();
    a.create(&held).await.expect("create");
    // Crashed: nothing renews it, nothing releases it.
    drop(a);
    let crashed = tokio::time::Instant::now();
    let mut desired = record("b", 0);
    desired.lease_duration = lease;
    loop {
        let attempt = b.try_acquire(&desired).await.expect("try_acquire");
        // Whether the store expires the lease itself: then it takes it over once expired.
        let store_expires = matches!(
            attempt,
            Some(Acquisition::Held {
                renewed_in_store: true,
                ..
            })
        );
        let taken = match attempt {
            Some(Acquisition::Acquired(taken)) => Some(taken),
            Some(Acquisition::Handed { observed, .. }) => Some(observed),
            _ => None,
        };
        if let Some(taken) = taken {
            assert_eq!(
                taken.record.extensions,
                extensions(),
                "an acquisition after the holder crashed carries the extensions on"
            );
            assert_eq!(
                get("after the takeover", &*b)
                    .await
                    .map(|o| o.record.extensions),
                Some(extensions()),
                "the extensions as stored after the takeover"
            );
            break;
        }
        match get("after the crash", &*b).await {
            // A store that keeps the record (candidates count the lease on their own clock).
            Some(observed) => assert_eq!(
                observed.record.extensions,
                extensions(),
                "the record of a crashed holder keeps its extensions"
            ),
            // Expired by the store since the attempt above found it held: the next attempt
            // takes it, and must bring the extensions back (checked above).
            None if store_expires => {}
            None => panic!(
                "the record of a crashed holder is gone and no acquisition brought its \
                 extensions back"
            ),
        }
        if !store_expires && crashed.elapsed() > lease * 2 {
            // Taken over on the candidates' clocks, by an update of the record as read: it
            // carries the extensions above.
            break;
        }
        assert!(
            crashed.elapsed() < lease * 3 + Duration::from_secs(5) + factory.extra_expiry(),
            "the store did not expire the lease of a crashed holder"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    b.close().await;
}

/// Of many concurrent creates, exactly one succeeds and the others conflict.
pub async fn concurrent_creates_have_one_winner(factory: &dyn LockFactory) {
    let name = unique("concurrent-create");
    let mut tasks = JoinSet::new();
    for i in 0..8 {
        let lock = factory.lock(&name, &format!("c{i}")).await;
        tasks.spawn(async move { lock.create(&record(lock.identity(), 1)).await });
    }
    let results = tasks.join_all().await;
    let winners = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(
        winners, 1,
        "concurrent creates: exactly one must win, got {results:?}"
    );
    assert!(
        results
            .iter()
            .all(|r| r.as_ref().is_ok() || r.as_ref().is_err_and(LockError::is_conflict)),
        "concurrent creates: the losers must see conflicts, got {results:?}"
    );
}

/// Of many concurrent updates from one version, exactly one succeeds.
pub async fn concurrent_updates_have_one_winner(factory: &dyn LockFactory) {
    let name = unique("concurrent-update");
    let first = factory.lock(&name, "c0").await;
    let created = first.create(&record("c0", 1)).await.expect("create");
    let base = first
        .update(&created.version, &free(1))
        .await
        .expect("release");
    let mut tasks = JoinSet::new();
    for i in 0..8 {
        let lock = factory.lock(&name, &format!("c{i}")).await;
        let version = base.version.clone();
        tasks.spawn(async move { lock.update(&version, &record(lock.identity(), 2)).await });
    }
    let results = tasks.join_all().await;
    let winners: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(
        winners.len(),
        1,
        "concurrent updates: exactly one must win, got {results:?}"
    );
    assert!(
        results
            .iter()
            .all(|r| r.as_ref().is_ok() || r.as_ref().is_err_and(LockError::is_conflict)),
        "concurrent updates: the losers must see conflicts, got {results:?}"
    );
    assert_eq!(
        get("after concurrent updates", &*first).await.as_ref(),
        Some(winners[0])
    );
}

/// A stored value that is not a record is reported as [`LockError::InvalidRecord`] and never
/// overwritten by `create` or `update`.
pub async fn invalid_record_is_reported_and_kept(factory: &dyn LockFactory) {
    let name = unique("invalid");
    let lock = factory.lock(&name, "a").await;
    if !factory.corrupt(&name).await {
        eprintln!(
            "conformance: this store holds no undecodable value; invalid-record check skipped"
        );
        return;
    }
    let err = lock
        .get()
        .await
        .expect_err("get of a corrupt record must fail");
    assert!(
        matches!(err, LockError::InvalidRecord { .. }),
        "get of a corrupt record: expected InvalidRecord, got {err:?}"
    );
    let message = err.to_string();
    assert_eq!(
        message.matches("invalid lock record").count(),
        1,
        "the message says what is wrong once: {message}"
    );
    assert!(
        lock.create(&record("a", 1)).await.is_err(),
        "create over a corrupt record must fail"
    );
    for version in ["0", "1", "2"] {
        assert!(
            lock.update(&Version::new(version), &record("a", 1))
                .await
                .is_err(),
            "update over a corrupt record must fail"
        );
    }
    if let Ok(Some(Acquisition::Acquired(observed))) = lock.try_acquire(&record("a", 1)).await {
        panic!("try_acquire over a corrupt record must fail, it stored {observed:?}");
    }
    let err = lock
        .get()
        .await
        .expect_err("the corrupt record must still be there");
    assert!(
        matches!(err, LockError::InvalidRecord { .. }),
        "after writes: {err:?}"
    );
}

/// S8: a record that decodes but carries odd values another client may write (a zero lease
/// duration, a renewal before the acquisition, as from a holder whose clock stepped back) is
/// read as it is, and an elector takes it over once its lease has run out.
pub async fn odd_records_do_not_block_the_election(factory: &dyn LockFactory) {
    let stepped_back = {
        let mut r = record("gone", 4);
        r.lease_duration = Duration::from_secs(1);
        r.renew_time = r.acquire_time - chrono::Duration::days(1);
        r
    };
    let zero = {
        let mut r = record("gone", 4);
        r.lease_duration = Duration::ZERO;
        r
    };
    for (what, odd) in [
        ("renewal before acquisition", stepped_back),
        ("zero lease", zero),
    ] {
        let name = unique("odd");
        let writer = factory.lock(&name, "gone").await;
        let stored = writer.create(&odd).await.expect("create an odd record");
        // A store may already have expired a zero lease.
        if let Some(read) = get(what, &*writer).await {
            assert_eq!(read, stored, "{what}: must read as stored");
        }
        // The writer is gone, as another client would be.
        drop(writer);
        let mut candidate = Candidate::start_with(factory.lock(&name, "next").await, RETRY);
        let token = candidate
            .wait_leading(LEASE * 3 + factory.extra_expiry())
            .await;
        assert!(
            token > stored.record.leader_transitions,
            "{what}: fencing token {token} after {}",
            stored.record.leader_transitions
        );
        candidate.stop().await;
    }
}

/// `identity` is the one given and `describe` names the lock.
pub async fn identity_and_describe(factory: &dyn LockFactory) {
    let lock = factory.lock(&unique("identity"), "candidate-7").await;
    assert_eq!(lock.identity(), "candidate-7");
    assert!(!lock.describe().is_empty(), "describe must not be empty");
}

/// A lock made for election `name` reports `name` as its election's name, without the store,
/// prefix or path its description adds: the name an elector built without a name of its own
/// shows in its status and metric labels.
pub async fn election_name_is_the_given_name(factory: &dyn LockFactory) {
    let name = unique("name");
    let lock = factory.lock(&name, "candidate-7").await;
    assert_eq!(
        lock.election_name(),
        Some(name.as_str()),
        "election_name must be the name the lock was made for ({})",
        lock.describe()
    );
}

/// A backend with change notifications reports a release by another candidate, and wakes
/// nobody for a renewal or for the holder's own write of its record (each notification costs
/// a request).
pub async fn change_notifications(factory: &dyn LockFactory) {
    let name = unique("watch");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let created = a.create(&record("a", 1)).await.expect("create");
    let Some(mut changes) = b.watch().await.expect("watch") else {
        return;
    };
    // Let subscriptions that are set up in the background settle.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut renewal = created.record.clone();
    renewal.renew_time = renewal.renewal_time(Utc::now());
    let renewed = a.update(&created.version, &renewal).await.expect("renew");
    let woken = tokio::time::timeout(Duration::from_millis(500), changes.next()).await;
    assert!(woken.is_err(), "a renewal woke the followers: {woken:?}");
    // The holder's own writes of its record (what it keeps in the extensions, a scheduled
    // job's firing, say) wake neither the followers nor the holder itself: each wake costs a
    // request.
    let mut own = a.watch().await.expect("the holder's watch");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut written = renewed.record.clone();
    written.renew_time = written.renewal_time(Utc::now());
    written
        .extensions
        .insert("conformance/own".into(), "1".into());
    let renewed = a.update(&renewed.version, &written).await.expect("write");
    let woken = tokio::time::timeout(Duration::from_millis(500), changes.next()).await;
    assert!(
        woken.is_err(),
        "the holder's write woke the followers: {woken:?}"
    );
    if let Some(own) = own.as_mut() {
        let woken = tokio::time::timeout(Duration::from_millis(500), own.next()).await;
        assert!(
            woken.is_err(),
            "the holder's own write woke the holder: {woken:?}"
        );
    }
    a.update(&renewed.version, &free(created.record.leader_transitions))
        .await
        .expect("release");
    let notified = tokio::time::timeout(Duration::from_secs(5), changes.next()).await;
    assert!(
        matches!(notified, Ok(Some(()))),
        "no change notification within 5 s of a release"
    );
}

/// A backend with a store-clock acquisition takes absent and free leases, refuses held ones and
/// raises `leader_transitions` on every acquisition.
pub async fn store_clock_acquisition(factory: &dyn LockFactory) {
    let name = unique("try-acquire");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let Some(first) = a.try_acquire(&record("a", 0)).await.expect("try_acquire") else {
        return;
    };
    let Acquisition::Acquired(first) = first else {
        panic!("try_acquire of an absent object must acquire, got {first:?}");
    };
    assert!(
        first.record.leader_transitions >= 1,
        "the first acquisition must have a token >= 1"
    );
    match b.try_acquire(&record("b", 0)).await.expect("try_acquire") {
        Some(Acquisition::Held {
            observed,
            expires_in,
            ..
        }) => {
            assert_eq!(observed, first, "Held must return the stored record");
            if let Some(left) = expires_in {
                assert!(
                    left <= first.record.lease_duration && !left.is_zero(),
                    "a lease just taken has between zero and its duration left, not {left:?}"
                );
            }
        }
        other => panic!("try_acquire of a held lease must report it held, got {other:?}"),
    }
    // S13: another lock object of the holder's identity (another process given the same
    // identity) must not take the unexpired lease.
    let twin = factory.lock(&name, "a").await;
    match twin
        .try_acquire(&record("a", 0))
        .await
        .expect("try_acquire")
    {
        Some(Acquisition::Held { observed, .. }) => assert_eq!(
            observed.record.leader_transitions, first.record.leader_transitions,
            "Held must return the stored record"
        ),
        other => panic!(
            "a second lock of the holder's identity took its unexpired lease (S13: one identity, \
             one process), got {other:?}"
        ),
    }
    twin.close().await;
    // The holder takes its own term again as the elector does: with a compare-and-swap.
    let mut retake = first.record.clone();
    retake.leader_transitions += 1;
    let again = a
        .update(&first.version, &retake)
        .await
        .expect("the holder takes its own term again");
    assert!(
        again.record.leader_transitions > first.record.leader_transitions,
        "re-acquisition by the same identity must raise the fencing token"
    );
    let released = a
        .update(&again.version, &free(again.record.leader_transitions))
        .await
        .expect("release");
    if released.record.is_free() {
        assert_eq!(
            a.time_left().await.expect("time_left"),
            None,
            "a released lease has no time left"
        );
    } else {
        // The backend handed the lease to the candidate waiting for it.
        assert_eq!(released.record.holder_identity, "b");
        assert!(released.record.leader_transitions > again.record.leader_transitions);
    }
    let asked = tokio::time::Instant::now();
    match b.try_acquire(&record("b", 0)).await.expect("try_acquire") {
        Some(Acquisition::Acquired(taken)) => assert!(
            taken.record.leader_transitions > again.record.leader_transitions,
            "a takeover must raise the fencing token"
        ),
        Some(Acquisition::Handed {
            observed,
            alive_since,
        }) => {
            assert!(
                !released.record.is_free(),
                "only a lease a release handed over is Handed, not a free one"
            );
            assert_eq!(observed.record.holder_identity, "b");
            assert_eq!(
                observed.record.leader_transitions, released.record.leader_transitions,
                "the token is the one the release handed over"
            );
            assert!(
                alive_since <= asked,
                "a handed lease was confirmed alive before the attempt began"
            );
        }
        other => panic!("try_acquire of a free lease must acquire, got {other:?}"),
    }
    if let Some(left) = b.time_left().await.expect("time_left") {
        assert!(
            left <= record("b", 0).lease_duration,
            "a lease just taken has at most its duration left, not {left:?}"
        );
    }
}

/// For a backend with a store-clock acquisition: an acquisition takes at least the token the
/// elector asks for (a floor, for an election moved from another store), and never less than
/// one more than the stored one.
pub async fn fencing_token_floor(factory: &dyn LockFactory) {
    let name = unique("floor");
    let a = factory.lock(&name, "a").await;
    let Some(first) = a
        .try_acquire(&record("a", 1000))
        .await
        .expect("try_acquire")
    else {
        return;
    };
    let Acquisition::Acquired(first) = first else {
        panic!("try_acquire of an absent object must acquire, got {first:?}");
    };
    assert!(
        first.record.leader_transitions >= 1000,
        "an acquisition must take at least the token asked for, got {}",
        first.record.leader_transitions
    );
    let released = a
        .update(&first.version, &free(first.record.leader_transitions))
        .await
        .expect("release");
    let b = factory.lock(&name, "b").await;
    let taken = match b.try_acquire(&record("b", 5)).await.expect("try_acquire") {
        Some(Acquisition::Acquired(taken)) => taken,
        Some(Acquisition::Handed { observed, .. }) => observed,
        other => panic!("try_acquire of a free lease must acquire, got {other:?}"),
    };
    assert!(
        taken.record.leader_transitions > released.record.leader_transitions,
        "a floor below the stored token must not lower it: {} after {}",
        taken.record.leader_transitions,
        released.record.leader_transitions
    );
    a.close().await;
    b.close().await;
}

/// S13: two processes given one identity never lead at once. At the lock: a lease handed over
/// by a release goes to at most one of two lock objects of the same identity. With electors:
/// one leads, the other never does while that term lasts, and says so (its status reports the
/// conflict, and its readiness fails); once the leader is gone the other takes over.
pub async fn one_identity_one_process(factory: &dyn LockFactory) {
    let name = unique("identity-twins");
    let holder = factory.lock(&name, "holder").await;
    let twins = [
        factory.lock(&name, "twin").await,
        factory.lock(&name, "twin").await,
    ];
    if let Some(Acquisition::Acquired(held)) = holder
        .try_acquire(&record("holder", 0))
        .await
        .expect("try_acquire")
    {
        for twin in &twins {
            let waiting = twin.try_acquire(&record("twin", 0)).await.expect("try");
            assert!(
                matches!(waiting, Some(Acquisition::Held { .. })),
                "a held lease must be reported held, got {waiting:?}"
            );
        }
        holder
            .update(&held.version, &free(held.record.leader_transitions))
            .await
            .expect("release");
        // Which of the two lock objects acquired (the same one again is its own lease).
        let mut taken = [false, false];
        for _ in 0..2 {
            for (i, twin) in twins.iter().enumerate() {
                if let Some(Acquisition::Acquired(_) | Acquisition::Handed { .. }) =
                    twin.try_acquire(&record("twin", 0)).await.expect("try")
                {
                    taken[i] = true;
                }
            }
        }
        assert!(
            !(taken[0] && taken[1]),
            "both lock objects of one identity acquired a lease only one may hold (S13): a \
             lease is handed to a lock object, never to its identity alone"
        );
    }
    for lock in twins.iter().chain([&holder]) {
        lock.close().await;
    }

    let name = unique("identity-electors");
    let mut first = Candidate::start_with(factory.lock(&name, "twin").await, RETRY);
    first.wait_leading(Duration::from_secs(10)).await;
    let elector = LeaderElector::builder(factory.lock(&name, "twin").await)
        .lease_duration(LEASE)
        .renew_deadline(RENEW)
        .retry_period(RETRY)
        .build()
        .expect("valid timings");
    let status = elector.status();
    let health = elector.health_check(Duration::ZERO);
    let mut second = Candidate::run(elector);
    // A lease the store keeps alive is found alive once it outlived a lease twice over.
    let within = LEASE * 3 + RETRY * 4 + factory.extra_expiry();
    let started = tokio::time::Instant::now();
    while status.identity_conflict().is_none() {
        assert!(
            started.elapsed() < within,
            "no identity conflict reported within {within:?} of a second process of the \
             leader's identity starting"
        );
        assert!(
            !second.state.borrow().is_leading(),
            "two processes of one identity both lead (S13)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let conflict = status.identity_conflict().expect("reported");
    assert_eq!(conflict.identity, "twin");
    assert!(
        health.ready().is_err(),
        "a replica whose identity another process leads with is not ready"
    );
    assert!(
        first.state.borrow().is_leading() && !second.state.borrow().is_leading(),
        "the first process leads, the second does not"
    );
    // Once the leader is gone (it releases), the other takes over, and the conflict is over.
    first.stop().await;
    second
        .wait_leading(Duration::from_secs(10) + factory.extra_expiry())
        .await;
    assert!(
        status.identity_conflict().is_none(),
        "the conflict ends with the other process's term"
    );
    second.stop().await;
}

/// For a backend with a store-clock acquisition: the holder's renewals keep its lease alive in
/// the store past its duration (another candidate's acquisition reports it held), a renewal
/// from a version someone else wrote over conflicts, and once the holder stops renewing the
/// store lets another candidate take it.
pub async fn renewals_keep_the_lease(factory: &dyn LockFactory) {
    let name = unique("renewals");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let short = |holder: &str| {
        let mut r = record(holder, 0);
        r.lease_duration = Duration::from_secs(1);
        r
    };
    let Some(Acquisition::Acquired(mut held)) = a.try_acquire(&short("a")).await.expect("try")
    else {
        return;
    };
    let started = tokio::time::Instant::now();
    // Whether the store expires leases itself, as its answers say.
    let mut store_expires = false;
    while started.elapsed() < Duration::from_millis(2500) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut renewal = held.record.clone();
        renewal.renew_time = renewal.renewal_time(now());
        held = a.renew(&held.version, &renewal).await.expect("renew");
        assert_eq!(held.record.holder_identity, "a");
        match b.try_acquire(&short("b")).await.expect("try_acquire") {
            Some(Acquisition::Held {
                expires_in,
                renewed_in_store,
                ..
            }) => store_expires |= expires_in.is_some() || renewed_in_store,
            other => panic!("a lease renewed in time must stay held, got {other:?}"),
        }
    }
    // Someone else writes (a handover request): once the holder's change stream has reported
    // it, as the elector waits for, a renewal from before that write conflicts. Repeated, since
    // what the stream reports and what the renewal consults may race.
    let mut written = held.clone();
    for round in 0..10 {
        let changes = a.watch().await.expect("watch");
        let current = get("renewals", &*b).await.expect("the record");
        let mut request = current.record.clone();
        // The last one names b, which takes the lease below.
        request.preferred_holder = Some(if round % 2 == 0 { "c" } else { "b" }.into());
        written = b
            .update(&current.version, &request)
            .await
            .expect("a request");
        if let Some(mut changes) = changes {
            let notified = tokio::time::timeout(Duration::from_secs(5), changes.next()).await;
            assert!(
                matches!(notified, Ok(Some(()))),
                "the holder's change stream did not report a handover request within 5 s"
            );
        }
        let stale = a.renew(&held.version, &held.record).await;
        assert!(
            stale.as_ref().is_err_and(LockError::is_conflict),
            "round {round}: a renewal from before someone else's write must conflict once the \
             holder was notified of it: {stale:?}"
        );
        // The holder carries on from the record as it now reads.
        let mut renewal = written.record.clone();
        renewal.renew_time = renewal.renewal_time(now());
        held = a.renew(&written.version, &renewal).await.expect("renew");
    }
    if !store_expires {
        // Held with no time from the store: candidates count the lease on their own clock.
        return;
    }
    // The holder is gone (a lock bound to its session ends it), so nobody renews; the store
    // expires the lease (an etcd lessor checks every 500 ms, and a TTL is whole seconds).
    drop(a);
    let stopped = tokio::time::Instant::now();
    loop {
        if let Some(Acquisition::Acquired(taken)) =
            b.try_acquire(&short("b")).await.expect("try_acquire")
        {
            assert!(taken.record.leader_transitions > written.record.leader_transitions);
            break;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(5) + factory.extra_expiry(),
            "the store did not expire a lease nobody renewed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A handover request is a compare-and-swap write that leaves the holder in place: the holder's
/// next renewal from its cached version conflicts; a notifying backend wakes watchers for it;
/// once released with the request kept, a store-clock acquisition takes it only for the
/// candidate it names.
pub async fn handover_requests(factory: &dyn LockFactory) {
    let name = unique("request");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let c = factory.lock(&name, "c").await;
    let operator = factory.lock(&name, "operator").await;
    assert!(
        matches!(
            request_handover(&*operator, "b").await,
            Err(crate::HandoverError::NoElection { .. })
        ),
        "a request for an election nobody ran is refused"
    );
    let held = a.create(&record("a", 1)).await.expect("create");
    let changes = b.watch().await.expect("watch");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let requested = request_handover(&*operator, "b").await.expect("request");
    assert_eq!(requested.record.handover_to(), Some("b"));
    assert_eq!(requested.record.holder_identity, "a", "the holder stays");
    assert_eq!(
        requested.record.leader_transitions, held.record.leader_transitions,
        "a request is no acquisition"
    );
    assert_ne!(requested.version, held.version, "a request is a write");
    let read = get("a request", &*b).await.expect("the record");
    assert_eq!(read.record.handover_to(), Some("b"));
    if let Some(mut changes) = changes {
        let notified = tokio::time::timeout(Duration::from_secs(5), changes.next()).await;
        assert!(
            matches!(notified, Ok(Some(()))),
            "no change notification within 5 s of a handover request"
        );
    }
    let mut renewal = held.record.clone();
    renewal.renew_time = renewal.renewal_time(Utc::now());
    let stale = a.update(&held.version, &renewal).await;
    assert!(
        stale.as_ref().is_err_and(LockError::is_conflict),
        "a renewal from before the request must lose its compare-and-swap: {stale:?}"
    );
    // The holder releases, keeping the request, as the elector does.
    let mut released = read.record.clone();
    released.holder_identity = String::new();
    let released = a.update(&read.version, &released).await.expect("release");
    assert_eq!(released.record.handover_to(), Some("b"));
    match c.try_acquire(&record("c", 0)).await.expect("try_acquire") {
        None => return,
        Some(Acquisition::Held { observed, .. }) => {
            assert_eq!(observed.record.handover_to(), Some("b"));
        }
        Some(taken) => {
            panic!("a lease reserved for b was taken by c by the store's clock: {taken:?}")
        }
    }
    match b.try_acquire(&record("b", 0)).await.expect("try_acquire") {
        Some(Acquisition::Acquired(taken)) => {
            assert!(taken.record.leader_transitions > released.record.leader_transitions);
            assert_eq!(taken.record.handover_to(), None, "an acquisition clears it");
        }
        // The release handed it to b already.
        Some(Acquisition::Handed { observed, .. }) if released.record.holder_identity == "b" => {
            assert_eq!(observed.record.handover_to(), None, "a handover clears it");
        }
        other => panic!("the named candidate must take a lease reserved for it, got {other:?}"),
    }
}

/// Three electors: a handover request makes the leader step down and release, the named
/// candidate takes over with a larger token while the third stands back, never two leaders at
/// once; done to each follower in turn. A request naming a candidate that never comes delays
/// the election by at most the stand-back window and a lease.
pub async fn planned_handover(factory: &dyn LockFactory) {
    let name = unique("planned");
    let ids = ["a", "b", "c"];
    let mut electors = Vec::new();
    for id in ids {
        electors.push(Candidate::start_with(factory.lock(&name, id).await, RETRY));
    }
    let operator = factory.lock(&name, "operator").await;
    let leading = |electors: &[Candidate]| {
        electors
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                e.state
                    .borrow()
                    .leadership()
                    .map(|l| (i, l.fencing_token()))
            })
            .collect::<Vec<_>>()
    };
    // Watches every 5 ms for `within`: never two leaders; returns the first leader whose token
    // is above `after`, if one comes.
    let watch = async |electors: &[Candidate], within: Duration, after: u64| {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let now = leading(electors);
            assert!(now.len() <= 1, "two electors lead at once: {now:?}");
            if let Some(&(i, token)) = now.first()
                && token > after
            {
                return Some((i, token));
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let (mut leader, mut token) = watch(&electors, Duration::from_secs(10), 0)
        .await
        .expect("a leader within 10 s");
    for _ in 0..2 {
        let target = (leader + 1) % ids.len();
        request_handover(&*operator, ids[target])
            .await
            .expect("handover request");
        // The leader sees it at its next renewal at the latest, then stops and releases.
        let (next, next_token) = watch(&electors, RETRY * 3 + Duration::from_secs(2), token)
            .await
            .unwrap_or_else(|| panic!("{} did not take over in time", ids[target]));
        assert_eq!(
            next, target,
            "the lease went to {} instead of the named {}",
            ids[next], ids[target]
        );
        (leader, token) = (next, next_token);
    }
    // A named candidate that never comes: the others stand back for a lease, then one leads.
    request_handover(&*operator, "gone")
        .await
        .expect("handover request");
    let requested = tokio::time::Instant::now();
    let within = RETRY * 3 + LEASE * 2 + Duration::from_secs(2);
    watch(&electors, within, token).await.unwrap_or_else(|| {
        panic!("no leader {within:?} after a handover to a candidate that never came")
    });
    let took = requested.elapsed();
    assert!(
        took >= LEASE / 2,
        "the others must stand back for the named candidate, yet one led {took:?} after the request"
    );
    for elector in electors {
        elector.stop().await;
    }
}

/// Two electors on real time: exactly one leads; when it shuts down (releasing), the other takes
/// over with a larger fencing token.
pub async fn electors_elect_one_and_hand_over(factory: &dyn LockFactory) {
    let name = unique("electors");
    let mut electors = Vec::new();
    for id in ["a", "b"] {
        electors.push(Candidate::start_with(
            factory.lock(&name, id).await,
            Duration::from_millis(300),
        ));
    }
    let leading = |electors: &[Candidate]| {
        electors
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.leading_token().map(|token| (i, token)))
            .collect::<Vec<_>>()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (first, token) = loop {
        let now_leading = leading(&electors);
        assert!(
            now_leading.len() <= 1,
            "two electors lead at once: {now_leading:?}"
        );
        if let [one] = now_leading[..] {
            break one;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no leader within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    electors[first].shutdown.cancel();
    let other = 1 - first;
    let new_token = electors[other].wait_leading(Duration::from_secs(10)).await;
    assert!(
        new_token > token,
        "fencing token must grow across a handover: {token} then {new_token}"
    );
    assert!(!electors[first].is_leading(), "the old leader still leads");
    for elector in electors {
        elector.stop().await;
    }
}

/// A leader whose wall clock steps back an hour, then forward two (an hour ahead), while it
/// leads (S14): it keeps leading through every step with the same token, nobody else leads,
/// and the record's times stay in order (`renew_time` never before `acquire_time`, never going
/// back). When it shuts down the other takes over with a larger token.
pub async fn wall_clock_steps(factory: &dyn LockFactory) {
    let name = unique("clock");
    let (clock, step) = crate::WallClock::stepped();
    let mut first = Candidate::build(
        LeaderElector::builder(factory.lock(&name, "stepped").await)
            .lease_duration(LEASE)
            .renew_deadline(RENEW)
            .retry_period(RETRY)
            .wall_clock(clock),
    );
    let token = first.wait_leading(Duration::from_secs(10)).await;
    let second = Candidate::start(factory.lock(&name, "steady").await);
    let reader = factory.lock(&name, "reader").await;
    let mut last = get("wall clock steps", &*reader).await.expect("the record");
    for by in [chrono::TimeDelta::hours(-1), chrono::TimeDelta::hours(2)] {
        step.step(by);
        // Past a lease of the follower's own wait, and several renewals.
        let until = tokio::time::Instant::now() + LEASE * 2;
        while tokio::time::Instant::now() < until {
            assert_eq!(
                first.leading_token(),
                Some(token),
                "wall clock stepped by {by}: the leader lost its term"
            );
            assert!(
                !second.is_leading(),
                "wall clock stepped by {by}: two lead at once"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let now = get("wall clock steps", &*reader).await.expect("the record");
        assert_eq!(now.record.holder_identity, "stepped");
        assert!(
            now.record.renew_time >= now.record.acquire_time
                && now.record.renew_time >= last.record.renew_time,
            "wall clock stepped by {by}: the record's times went back: {:?} then {:?}",
            last.record,
            now.record
        );
        last = now;
    }
    first.stop().await;
    let mut second = second;
    let next = second.wait_leading(LEASE * 4).await;
    assert!(next > token, "fencing token {token} then {next}");
    second.stop().await;
}

/// `n` electors on one election: a leader within 10 s, never two at once, no change of hands
/// without a fault; when the leader shuts down, exactly one other takes over with a larger
/// fencing token.
pub async fn electors_elect_exactly_one(factory: &dyn LockFactory, n: usize) {
    let name = unique("many");
    let mut electors = Vec::new();
    for i in 0..n {
        electors.push(Candidate::start_with(
            factory.lock(&name, &format!("e{i}")).await,
            Duration::from_millis(500),
        ));
    }
    let leaders = |electors: &[Candidate]| {
        electors
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.leading_token().map(|token| (i, token)))
            .collect::<Vec<_>>()
    };
    let watch_for =
        async |electors: &[_], duration: Duration, mut current: Option<(usize, u64)>| {
            let until = tokio::time::Instant::now() + duration;
            while tokio::time::Instant::now() < until {
                let now = leaders(electors);
                assert!(
                    now.len() <= 1,
                    "{n} electors: several lead at once: {now:?}"
                );
                if let Some(held) = current {
                    assert_eq!(
                        now,
                        [held],
                        "{n} electors: leadership changed hands with no fault"
                    );
                }
                current = current.or(now.first().copied());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            current
        };
    let mut first = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while first.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} electors: no leader within 10 s"
        );
        first = watch_for(&electors, Duration::from_millis(50), None).await;
    }
    let (index, token) = watch_for(&electors, Duration::from_secs(3), first)
        .await
        .expect("a leader");
    electors.remove(index).stop().await;
    let mut next = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while next.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} electors: no new leader within 10 s"
        );
        next = watch_for(&electors, Duration::from_millis(20), None).await;
    }
    let (_, next_token) = watch_for(&electors, Duration::from_secs(1), next)
        .await
        .expect("a leader");
    assert!(
        next_token > token,
        "fencing token {token} then {next_token}"
    );
    for elector in electors {
        elector.stop().await;
    }
}

/// For a backend with change notifications: a released lease is taken over well within a retry
/// period (2 s here, up to 4.4 s with jitter), because the follower is woken at once. Returns
/// how long the handover took.
pub async fn release_is_taken_over_at_once(factory: &dyn LockFactory) -> Duration {
    let name = unique("handover");
    let retry = Duration::from_secs(2);
    let mut leader = Candidate::start_with(factory.lock(&name, "first").await, retry);
    let token = leader.wait_leading(Duration::from_secs(10)).await;
    let mut follower = Candidate::start_with(factory.lock(&name, "second").await, retry);
    // Let the follower subscribe and read the record.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let released = tokio::time::Instant::now();
    leader.stop().await;
    let next = follower.wait_leading(retry).await;
    let took = released.elapsed();
    assert!(took < retry / 4, "handover after a release took {took:?}");
    assert!(next > token, "fencing token {token} then {next}");
    follower.stop().await;
    took
}
