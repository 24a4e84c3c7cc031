//! Leases as electors hold them: change notifications, store-clock acquisitions, the fencing
//! token floor (S5), one identity per process (S13), renewals that keep the lease, and wall
//! clocks that step (S14).

use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt;

use super::{LockFactory, first_term, free, get, now, record, rivals, unique};
use crate::background::{Candidate, LEASE, RENEW, RETRY, STEADY_LEASE, STEADY_RENEW};
use crate::{
    Acquisition, LeaderElectionRecord, LeaderElector, LockError, Observed, ResourceLock, Version,
};

/// A backend with change notifications reports a release by another candidate, and wakes
/// nobody for a renewal or for the holder's own write of its record (each notification costs
/// a request).
pub async fn change_notifications(factory: &dyn LockFactory) {
    let (a, b) = rivals(factory, "watch").await;
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
    let (a, b) = rivals(factory, "renewals").await;
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

/// A leader whose wall clock steps back an hour, then forward two (an hour ahead), while it
/// leads (S14): it keeps leading through every step with the same token, nobody else leads,
/// and the record's times stay in order (`renew_time` never before `acquire_time`, never going
/// back). When it shuts down the other takes over with a larger token. The leader's renew
/// deadline outlasts a loaded machine's stalls of the store
/// ([`STEADY_RENEW`](crate::background::STEADY_RENEW)): only the steps may cost it its term.
pub async fn wall_clock_steps(factory: &dyn LockFactory) {
    let name = unique("clock");
    let (clock, step) = crate::WallClock::stepped();
    let mut first = Candidate::build(
        LeaderElector::builder(factory.lock(&name, "stepped").await)
            .lease_duration(STEADY_LEASE)
            .renew_deadline(STEADY_RENEW)
            .retry_period(RETRY)
            .wall_clock(clock),
    );
    let token = first.wait_leading(Duration::from_secs(10)).await;
    let second = Candidate::start(factory.lock(&name, "steady").await);
    let reader = factory.lock(&name, "reader").await;
    let mut last = get("wall clock steps", &*reader).await.expect("the record");
    for by in [chrono::TimeDelta::hours(-1), chrono::TimeDelta::hours(2)] {
        step.step(by);
        // Past the lease the follower waits out (the leader's), and several renewals.
        let until = tokio::time::Instant::now() + STEADY_LEASE + RETRY * 4;
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

/// S3, S14: a renewal that the store applied but whose answer was lost (a timeout), sent again
/// from the holder's cache while its wall clock is behind the stored `renew_time` (so that it
/// writes exactly the bytes of the lost one), never extends a term that a follower may take.
/// A follower read the lost write and counts the lease from then; a retry that the store
/// answers as a success must therefore move the version past what that follower read (its
/// clock starts again), or be a renewal the store keeps itself (the follower waits for the
/// store). Anything else is a conflict, as a compare-and-swap on a version that moved is.
/// Checked for a renewal and for an update (a write of the record's extensions).
pub async fn lost_renewal_answers(factory: &dyn LockFactory) {
    let (a, b) = rivals(factory, "lost-answer").await;
    let mut cached = first_term("lost renewal answers", &*a).await;
    for operation in ["renew", "update"] {
        let context = format!("a {operation} whose answer was lost, sent again");
        // The holder's wall clock is an hour behind what the record shows: the renewal time
        // is the stored one and a step, the same for both sends.
        let mut renewal = cached.record.clone();
        renewal.renew_time = renewal.renewal_time(now() - chrono::TimeDelta::hours(1));
        // Applied; its answer never reaches the holder, whose cache stays as it was.
        write(&*a, operation, &cached.version, &renewal)
            .await
            .unwrap_or_else(|err| panic!("{context}: the first {operation} failed: {err}"));
        let seen = get(&context, &*b).await.expect("the record");
        match write(&*a, operation, &cached.version, &renewal).await {
            Err(err) if err.is_conflict() => {}
            Err(err) => panic!("{context}: {err}"),
            Ok(stored) => {
                let after = get(&context, &*b).await.expect("the record");
                if after.version == seen.version {
                    let held = b.try_acquire(&record("b", 0)).await.expect("try_acquire");
                    assert!(
                        matches!(
                            held,
                            Some(Acquisition::Held {
                                renewed_in_store: true,
                                ..
                            })
                        ),
                        "{context}: the store answered it as a success ({}) but left the \
                         version a follower read after the lost one ({}), and does not keep \
                         the lease alive itself ({held:?}): the holder counts its term from \
                         the retry, the follower from the lost write, and takes the lease \
                         while the holder still leads",
                        stored.version,
                        seen.version
                    );
                }
            }
        }
        // The holder carries on from the record as it now reads, as the elector does after a
        // conflict.
        cached = get(&context, &*a).await.expect("the record");
        assert!(
            cached.record.is_held_by("a"),
            "{context}: the holder lost the lease: {:?}",
            cached.record
        );
    }
    a.close().await;
    b.close().await;
}

/// A renewal or an update of `record` over `version`.
async fn write(
    lock: &dyn ResourceLock,
    operation: &str,
    version: &Version,
    record: &LeaderElectionRecord,
) -> Result<Observed, LockError> {
    match operation {
        "renew" => lock.renew(version, record).await,
        _ => lock.update(version, record).await,
    }
}

/// What a lock reports of a live holder (`leader status`, a shard set's view, a drain that
/// waits) shows its last renewal: a read after a renewal has the renewal's `renew_time`, or
/// the store tells how long the lease has left ([`ResourceLock::time_left`]). A reader
/// would otherwise take a holder that renews for one whose lease ran out.
pub async fn reads_show_the_last_renewal(factory: &dyn LockFactory) {
    let name = unique("last-renewal");
    let a = factory.lock(&name, "a").await;
    let reader = factory.lock(&name, "reader").await;
    let held = first_term("last renewal", &*a).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut renewal = held.record.clone();
    renewal.renew_time = renewal.renewal_time(now());
    a.renew(&held.version, &renewal).await.expect("renew");
    let read = get("last renewal", &*reader).await.expect("the record");
    if read.record.renew_time < renewal.renew_time {
        let left = reader.time_left().await.expect("time_left");
        assert!(
            left.is_some(),
            "a read after a renewal shows the renew time of before it ({} < {}) and the \
             store tells no time left: readers take a live holder for an expired one",
            read.record.renew_time,
            renewal.renew_time
        );
    }
    a.close().await;
}
