//! The store's contract, record by record: absent, created, compare-and-swap, identical writes
//! moving the version (S14), fields and extensions kept, one winner of concurrent writes, bad
//! and odd records (S8), the lock's identity and election name.

use std::time::Duration;

use tokio::task::JoinSet;

use super::{
    LockFactory, assert_conflict, assert_stored, extensions, first_term, free, get, now, record,
    rivals, unique,
};
use crate::background::{Candidate, LEASE, RETRY};
use crate::{Acquisition, LockError, Observed, ResourceLock, Version};

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
        &lock.update(&Version::new("1"), &record("a", 1)).await,
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
    let (a, b) = rivals(factory, "create-conflict").await;
    let created = a.create(&record("a", 1)).await.expect("first create");
    assert_conflict(
        "create of an existing object",
        &b.create(&record("b", 1)).await,
    );
    assert_conflict(
        "create of an existing object by its holder",
        &a.create(&record("a", 2)).await,
    );
    assert_eq!(
        get("after conflicting creates", &*b).await,
        Some(created),
        "a failed create changed the record"
    );
}

/// `update` succeeds with the current version only, and every success yields a new version.
pub async fn update_is_compare_and_swap(factory: &dyn LockFactory) {
    let (a, b) = rivals(factory, "cas").await;
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
        &b.update(&v1.version, &record("b", 9)).await,
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
        &a.update(&released.version, &renewed).await,
    );
    assert_conflict(
        "update with an older version",
        &a.update(&v2.version, &renewed).await,
    );
}

/// A write of the record exactly as stored moves the version, or is refused (S14). Some
/// stores skip a write of what they hold (kube-apiserver's `GuaranteedUpdate`, Consul's
/// `kvsSetTxn`) and answer it with the version they had: a lock that took that answer as done
/// would leave a holder who believes it renewed beside a follower whose compare-and-swap on
/// the unchanged version succeeds. Updates and renewals alike, twice each; a renewal may keep
/// the version only where the store keeps the lease alive itself (`renewed_in_store`).
pub async fn identical_writes_move_the_version(factory: &dyn LockFactory) {
    let (a, b) = rivals(factory, "identical").await;
    let mut current = first_term("identical writes", &*a).await;
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
                    &b.update(&current.version, &record("b", 99)).await,
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

/// An acquisition keeps the stored extensions, whatever the candidate's record says: only a
/// holder changes them, with a compare-and-swap, so a store-clock acquisition by a candidate
/// that read them long ago never rolls them back; a handover request and a release keep them.
pub async fn acquisitions_keep_the_extensions(factory: &dyn LockFactory) {
    let (a, b) = rivals(factory, "extensions").await;
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
    let (a, b) = rivals(factory, "crashed-extensions").await;
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

/// Storage that is missing (a table not created, say) on a lock built without creating it:
/// reads and acquisitions are [`LockError::Misconfigured`], with a message that names each of
/// `mentions` (the storage, and what creates it); an elector on it keeps running without
/// leading, and leads once `create` has made the storage (S8).
///
/// # Panics
/// When the lock or the elector behaves otherwise.
pub async fn missing_storage_is_reported_until_it_exists(
    lock: impl ResourceLock + 'static,
    mentions: &[&str],
    create: impl std::future::Future<Output = ()>,
) {
    let err = lock.get().await.expect_err("no storage");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    let message = err.to_string();
    for mention in mentions {
        assert!(message.contains(mention), "{mention:?} not in {message}");
    }
    let err = lock
        .try_acquire(&record(lock.identity(), 0))
        .await
        .expect_err("no storage");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    let mut elector = Candidate::start(lock);
    elector
        .stays_alive_without_leading(Duration::from_millis(1500))
        .await;
    create.await;
    elector.wait_leading(Duration::from_secs(5)).await;
    elector.stop().await;
}

/// S16: a record a later release's holder wrote, with fields this release does not know, is
/// read with them, and every write within its term keeps them: a renewal, a write of its
/// extensions, a handover request written on the holder's behalf, a release. Skipped for a
/// store that keeps no such fields ([`LockFactory::keeps_unknown_fields`]).
pub async fn fields_of_a_later_release_survive(factory: &dyn LockFactory) {
    if !factory.keeps_unknown_fields() {
        return;
    }
    let (a, b) = rivals(factory, "later-release").await;
    let mut later = record("a", 1);
    later
        .unknown_fields
        .insert("holderRelease".into(), serde_json::json!("0.2.0"));
    later.unknown_fields.insert(
        "lease".into(),
        serde_json::json!({"kind": "session", "id": 7}),
    );
    let expected = later.unknown_fields.clone();
    let check = |context: &str, observed: &Observed| {
        assert_eq!(
            observed.record.unknown_fields, expected,
            "a later release's fields after {context}: {:?}",
            observed.record
        );
    };
    let held = a.create(&later).await.expect("create");
    let read = get("a later release's record", &*b)
        .await
        .expect("the record");
    check("a read", &read);
    let mut renewal = read.record.clone();
    renewal.renew_time = renewal.renewal_time(now());
    let renewed = a.renew(&held.version, &renewal).await.expect("renew");
    check("a renewal", &get("renewal", &*b).await.expect("the record"));
    let mut written = renewed.record.clone();
    written.renew_time = written.renewal_time(now());
    written
        .extensions
        .insert("conformance/later".into(), "1".into());
    a.update(&renewed.version, &written)
        .await
        .expect("an extension write");
    check(
        "an extension write",
        &get("write", &*b).await.expect("record"),
    );
    crate::request_handover(&*b, "b")
        .await
        .expect("a handover request");
    let requested = get("handover request", &*a).await.expect("the record");
    check("a handover request", &requested);
    let mut released = requested.record.clone();
    released.holder_identity.clear();
    a.update(&requested.version, &released)
        .await
        .expect("a release");
    check("a release", &get("release", &*b).await.expect("the record"));
    a.close().await;
    b.close().await;
}
