//! Deterministic tests of the elector on tokio's paused clock, with injected faults.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use leader_core::backend::HolderCheck;
use leader_core::background::Candidate;
use leader_core::faults::{Fault, Faults, FaultyLock};
use leader_core::{
    CancellationToken, ConfigError, LeaderElectionRecord, LeaderElector, LeaderElectorBuilder,
    LeaderState, Leadership, MAX_LEASE_DURATION, MemoryLock, MemoryStore, ResourceLock, StepDown,
    StepDownReason,
};
use tokio::time::{Instant, sleep};

use common::{
    LEASE, RENEW, RETRY, Switch, TestLock, after_last_acquisition, builder, lose_a_term,
    stored_record,
};

fn faulty(store: &MemoryStore, identity: &str) -> (FaultyLock<MemoryLock>, Faults) {
    let lock = FaultyLock::new(store.lock("election", identity));
    let faults = lock.faults();
    (lock, faults)
}

/// Ends `candidate` as a crash would, without a release, and waits until its term `leadership`
/// is over (its token is cancelled when the elector goes away).
async fn crash(candidate: &Candidate, leadership: Leadership) {
    candidate.task.abort();
    leadership.lost().await;
}

/// A leader `a` that never releases and a follower `b` whose requests go through a fault
/// wrapper, on a store that judges expiry by its own clock: `a`, its term, `b` and `b`'s
/// faults.
async fn store_clock_pair(store: &MemoryStore) -> (Candidate, Leadership, Candidate, Faults) {
    let mut a = Candidate::build(
        builder(store.lock("election", "a").with_store_clock(true)).release_on_cancel(false),
    );
    let first = a.leadership().await;
    let lock = FaultyLock::new(store.lock("election", "b").with_store_clock(true));
    let faults = lock.faults();
    let b = Candidate::build(builder(lock));
    (a, first, b, faults)
}

/// Writes a record held by `holder` straight into the store, as another process would.
async fn write_holder(store: &MemoryStore, holder: &str, lease: Duration, transitions: u64) {
    let lock = store.lock("election", holder);
    let now = Utc::now();
    let record = LeaderElectionRecord::new(holder, lease, now, transitions);
    match lock.get().await.expect("get") {
        None => drop(lock.create(&record).await.expect("create")),
        Some(current) => drop(
            lock.update(&current.version, &record)
                .await
                .expect("update"),
        ),
    }
}

#[tokio::test]
async fn build_rejects_invalid_timings_with_the_rule_broken() {
    let lock = || MemoryLock::new("election", "a");
    let err = |b: LeaderElectorBuilder| b.build().expect_err("must be rejected");
    assert_eq!(
        err(builder(lock()).lease_duration(RENEW)),
        ConfigError::LeaseNotLongerThanRenewDeadline {
            lease_duration: RENEW,
            renew_deadline: RENEW
        }
    );
    assert_eq!(
        err(builder(lock()).renew_deadline(Duration::from_millis(2400))),
        ConfigError::RenewDeadlineNotLongerThanRetry {
            renew_deadline: Duration::from_millis(2400),
            retry_period: RETRY,
            factor: 1.2
        }
    );
    assert_eq!(
        err(builder(lock()).retry_period(Duration::ZERO)),
        ConfigError::ZeroRetryPeriod
    );
    // Timings past every clock's range are refused, where they panicked once running (a
    // deadline past `Instant`'s end, a retry period times the jitter past `Duration`'s).
    let over = MAX_LEASE_DURATION + Duration::from_millis(1);
    for (lease, renew, retry, setting, value) in [
        (over, RENEW, RETRY, "lease duration", over),
        (LEASE, Duration::MAX, RETRY, "renew deadline", Duration::MAX),
        (LEASE, RENEW, Duration::MAX, "retry period", Duration::MAX),
    ] {
        assert_eq!(
            err(builder(lock())
                .lease_duration(lease)
                .renew_deadline(renew)
                .retry_period(retry)),
            ConfigError::TimingTooLong {
                setting,
                value,
                max: MAX_LEASE_DURATION
            }
        );
    }
    let year = builder(lock())
        .lease_duration(MAX_LEASE_DURATION)
        .renew_deadline(MAX_LEASE_DURATION / 2)
        .retry_period(MAX_LEASE_DURATION / 4)
        .build()
        .expect("a lease of a year is valid");
    assert_eq!(year.config().lease.lease_duration, MAX_LEASE_DURATION);
    assert_eq!(
        err(builder(lock()).jitter(f64::NAN)).to_string(),
        "jitter (NaN) must be a finite number between 0 and 10"
    );
    assert_eq!(
        err(builder(lock()).jitter(-1.0)),
        ConfigError::InvalidJitter(-1.0)
    );
    assert!(matches!(
        err(builder(lock()).request_timeout(Duration::from_secs(11))),
        ConfigError::InvalidRequestTimeout { .. }
    ));
    assert!(matches!(
        err(builder(lock()).request_timeout(Duration::ZERO)),
        ConfigError::InvalidRequestTimeout { .. }
    ));
    assert_eq!(
        err(builder(MemoryLock::new("election", ""))),
        ConfigError::EmptyIdentity
    );
    let message = err(builder(lock()).lease_duration(RENEW)).to_string();
    assert!(
        message.contains("lease duration") && message.contains("renew deadline"),
        "{message}"
    );

    let ok = builder(lock())
        .build()
        .expect("client-go defaults are valid");
    assert_eq!(ok.config().lease.request_timeout, RENEW / 2);
    assert_eq!(ok.config().lease.stop_grace, LEASE - RENEW);
}

#[tokio::test(start_paused = true)]
async fn a_lone_candidate_leads_and_renews_in_one_request() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let mut a = Candidate::build(builder(lock));
    let leadership = a.leadership().await;
    assert_eq!(leadership.fencing_token(), 1);
    assert_eq!(leadership.identity(), "a");
    sleep(RETRY * 10 + Duration::from_millis(1)).await;
    assert!(!leadership.is_lost());
    let calls = faults.calls();
    let after_acquire: Vec<_> = calls
        .iter()
        .skip_while(|c| c.operation != "create")
        .skip(1)
        .collect();
    assert_eq!(after_acquire.len(), 10, "ten renewals: {calls:?}");
    assert!(
        after_acquire.iter().all(|c| c.operation == "renew"),
        "renewals must not read first: {calls:?}"
    );
    let stored = stored_record(&store, "election").await;
    assert!(stored.is_held_by("a"));
    assert!(stored.renew_time > stored.acquire_time);
    drop(leadership);
    a.stop().await;
}

/// S3: a renewal that hangs past the renew deadline cancels the leadership on time.
#[tokio::test(start_paused = true)]
async fn a_hung_renewal_cancels_leadership_at_the_renew_deadline() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let started = Instant::now();
    let mut a = Candidate::build(builder(lock));
    let leadership = a.leadership().await;
    // The first renewal starts at 2 s and succeeds; the next, at 4 s, hangs.
    sleep(Duration::from_secs(3)).await;
    faults.hang(true);
    leadership.lost().await;
    assert_eq!(
        Instant::now() - started,
        RETRY + RENEW,
        "lost exactly at last renewal start + deadline"
    );
    assert!(!a.is_leading());
    faults.hang(false);
    drop(leadership);
    let stopped = a.stop().await;
    assert_eq!(stopped[0].reason, StepDownReason::RenewDeadlineExceeded);
}

/// The leadership's deadline, readable from any thread, follows the renewals: the start of the
/// last successful one plus the renew deadline, and it stops moving when renewals hang.
#[tokio::test(start_paused = true)]
async fn the_term_deadline_follows_the_renewals() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let started = Instant::now();
    let mut a = Candidate::build(builder(lock));
    let leadership = a.leadership().await;
    let deadline = leadership.deadline();
    assert_eq!(
        deadline.get(),
        (started + RENEW).into_std(),
        "set at acquisition"
    );
    // Renewals at 2 s, 4 s and 6 s succeed; the one at 8 s hangs.
    sleep(Duration::from_secs(7)).await;
    assert_eq!(deadline.get(), (started + RETRY * 3 + RENEW).into_std());
    faults.hang(true);
    sleep(Duration::from_secs(4)).await;
    assert_eq!(
        deadline.get(),
        (started + RETRY * 3 + RENEW).into_std(),
        "a hung renewal extends nothing"
    );
    leadership.lost().await;
    assert_eq!(
        Instant::now().into_std(),
        deadline.get(),
        "the term ended at it"
    );
    faults.hang(false);
    drop(leadership);
    a.stop().await;
}

/// S3: a renewal answered after the deadline does not extend the term.
#[tokio::test(start_paused = true)]
async fn a_renewal_answered_after_the_deadline_does_not_extend_the_term() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let started = Instant::now();
    let mut a = Candidate::build(builder(lock).request_timeout(RENEW));
    let leadership = a.leadership().await;
    sleep(Duration::from_secs(3)).await;
    // The renewal at 4 s reaches the store at once but its answer comes 9 s later, at 13 s.
    faults.delay_responses(Duration::from_secs(9));
    leadership.lost().await;
    assert_eq!(Instant::now() - started, RETRY + RENEW);
    let calls = faults.calls();
    let late = calls
        .iter()
        .find(|c| c.sent - started == Duration::from_secs(4))
        .expect("renewal at 4 s");
    assert!(
        late.reached.is_some(),
        "the late renewal did reach the store"
    );
    drop(leadership);
    a.stop().await;
}

/// S2 and kubernetes#47671: a follower waits the holder's lease duration, counted from the moment
/// its read returned.
#[tokio::test(start_paused = true)]
async fn a_follower_waits_the_holders_lease_from_when_its_read_returned() {
    let store = MemoryStore::new();
    let holder_lease = Duration::from_secs(20);
    write_holder(&store, "ghost", holder_lease, 4).await;
    let (lock, faults) = faulty(&store, "b");
    // Only the first read is slow (its answer takes 5 s): a follower that counted from when it
    // sent that read, rather than from when the answer came, would take over 5 s early.
    faults.delay_responses(Duration::from_secs(5));
    let mut b = Candidate::build(builder(lock));
    sleep(Duration::from_millis(10_500)).await; // try_acquire probe and first get have returned
    faults.delay_responses(Duration::ZERO);
    let leadership = b.leadership().await;
    assert_eq!(
        leadership.fencing_token(),
        5,
        "takeover raises the fencing token"
    );
    let calls = faults.calls();
    let first_read = calls
        .iter()
        .find(|c| c.operation == "get")
        .and_then(|c| c.returned)
        .expect("first read returned");
    let takeover = calls
        .iter()
        .find(|c| c.operation == "update")
        .and_then(|c| c.reached)
        .expect("takeover reached the store");
    assert!(
        takeover >= first_read + holder_lease,
        "took over {:?} after the read returned; the holder's lease is {holder_lease:?}",
        takeover - first_read
    );
    // Woken at expiry, not at the next retry tick.
    assert!(
        takeover - first_read < holder_lease + Duration::from_secs(2),
        "{:?}",
        takeover - first_read
    );
    drop(leadership);
    b.stop().await;
}

/// S2: a holder that keeps renewing is never taken over, however long the follower waits.
#[tokio::test(start_paused = true)]
async fn a_follower_never_takes_over_a_renewed_lease() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")));
    let a_leads = a.leadership().await;
    let new_leaders = Arc::new(Mutex::new(Vec::new()));
    let seen = new_leaders.clone();
    let b = Candidate::build(
        builder(store.lock("election", "b"))
            .on_new_leader(move |id| seen.lock().unwrap().push(id.to_owned())),
    );
    sleep(Duration::from_secs(120)).await;
    assert!(!a_leads.is_lost());
    assert!(!b.is_leading());
    assert_eq!(b.state.borrow().leader(), Some("a"));
    assert_eq!(*new_leaders.lock().unwrap(), ["a"]);
    drop(a_leads);
    // "Stopped leading" only for a candidate that led (client-go#1187).
    assert!(b.stop().await.is_empty());
    assert_eq!(a.stop().await.len(), 1);
}

/// S14 on a store that skips identical writes (as kube-apiserver and Consul do): the leader's
/// wall clock steps back an hour, then forward to an hour ahead; it keeps its term, nobody
/// else leads, and every renewal moves the version, with `renew_time` never going back.
#[tokio::test(start_paused = true)]
async fn a_wall_clock_that_steps_changes_what_the_record_shows_never_who_leads() {
    let store = MemoryStore::skipping_identical_writes();
    let (clock, step) = leader_core::WallClock::stepped();
    let mut a = Candidate::build(builder(store.lock("election", "a")).wall_clock(clock));
    let a_leads = a.leadership().await;
    let b = Candidate::build(builder(store.lock("election", "b")));
    let reader = store.lock("election", "reader");
    let mut last = reader.get().await.expect("get").expect("record");
    for by in [chrono::TimeDelta::hours(-1), chrono::TimeDelta::hours(2)] {
        step.step(by);
        for _ in 0..20 {
            sleep(RETRY).await;
            assert!(
                !a_leads.is_lost(),
                "stepped by {by}: the leader lost its term"
            );
            assert!(!b.is_leading(), "stepped by {by}: two lead");
        }
        let now = reader.get().await.expect("get").expect("record");
        assert_ne!(now.version, last.version, "stepped by {by}");
        assert!(
            now.record.renew_time > last.record.renew_time
                && now.record.renew_time > now.record.acquire_time,
            "stepped by {by}: {:?} then {:?}",
            last.record,
            now.record
        );
        last = now;
    }
    drop(a_leads);
    assert!(b.stop().await.is_empty());
    assert_eq!(a.stop().await.len(), 1);
}

/// S5 and S7: after losing leadership the elector runs again, and its next term has a larger
/// fencing token even though its identity is the same.
#[tokio::test(start_paused = true)]
async fn re_acquisition_by_the_same_identity_raises_the_fencing_token() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let mut a = Candidate::build(builder(lock));
    lose_a_term(&mut a, &faults).await;
    let second = a.leadership().await;
    assert!(
        second.fencing_token() > 1,
        "token {}",
        second.fencing_token()
    );
    let record = stored_record(&store, "election").await;
    assert_eq!(record.leader_transitions, second.fencing_token());
    drop(second);
    let stopped = a.stop().await;
    assert_eq!(stopped.len(), 2);
    assert_eq!(stopped[0].reason, StepDownReason::RenewDeadlineExceeded);
}

/// S6: release waits for the leader's work to stop, then frees the lease.
#[tokio::test(start_paused = true)]
async fn release_waits_for_the_work_to_stop() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let finished = Arc::new(Mutex::new(None));
    let done = finished.clone();
    let mut a = Candidate::build(builder(lock).on_started_leading(move |leadership| {
        let done = done.clone();
        async move {
            leadership.lost().await;
            sleep(Duration::from_secs(3)).await; // cleanup after losing leadership
            *done.lock().unwrap() = Some(Instant::now());
        }
    }));
    drop(a.leadership().await);
    sleep(Duration::from_secs(5)).await;
    let stopped = a.stop().await;
    let finished = finished.lock().unwrap().expect("work finished");
    let release = faults.calls().into_iter().last().expect("release call");
    assert_eq!(release.operation, "update");
    assert!(
        release.reached.expect("reached") >= finished,
        "released before the work stopped"
    );
    let record = stored_record(&store, "election").await;
    assert!(record.is_free(), "lease released: {record:?}");
    assert_eq!(stopped.len(), 1);
    assert!(stopped[0].released);
    assert_eq!(stopped[0].reason, StepDownReason::Shutdown);
}

/// S6: work that ignores the cancellation is aborted after the grace and the lease is not
/// released (it expires instead), so no one else starts while it might still run.
#[tokio::test(start_paused = true)]
async fn work_that_does_not_stop_keeps_the_lease_from_being_released() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(
        builder(store.lock("election", "a"))
            .stop_grace(Duration::from_secs(1))
            .on_started_leading(|_leadership| std::future::pending()),
    );
    drop(a.leadership().await);
    let stopped = a.stop().await;
    assert!(!stopped[0].released);
    let record = stored_record(&store, "election").await;
    assert!(
        record.is_held_by("a"),
        "lease must be left to expire: {record:?}"
    );
}

/// Work run with `run_while_leading` is dropped the moment leadership ends.
#[tokio::test(start_paused = true)]
async fn run_while_leading_drops_the_work_when_leadership_ends() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let ticks = Arc::new(Mutex::new(Vec::new()));
    let log = ticks.clone();
    let elector = builder(lock).build().unwrap();
    let mut state = elector.subscribe();
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn(
        elector.run_while_leading(shutdown.clone(), move |leadership| {
            let log = log.clone();
            async move {
                loop {
                    log.lock()
                        .unwrap()
                        .push((leadership.fencing_token(), Instant::now()));
                    sleep(Duration::from_secs(1)).await;
                }
            }
        }),
    );
    state.wait_for(LeaderState::is_leading).await.unwrap();
    faults.hang(true);
    sleep(Duration::from_secs(30)).await;
    let last = ticks.lock().unwrap().last().copied().unwrap();
    assert!(
        last.1 - started < RETRY + RENEW,
        "work ran after the deadline: {:?}",
        last.1 - started
    );
    faults.hang(false);
    shutdown.cancel();
    task.await.unwrap().expect("the elector ran");
}

/// A renewal that loses the compare-and-swap reads the record (slow path) and keeps leading
/// when the record is still this term's.
#[tokio::test(start_paused = true)]
async fn a_lost_compare_and_swap_on_renewal_takes_the_slow_path() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let mut a = Candidate::build(builder(lock));
    let leadership = a.leadership().await;
    faults.fail_next(Fault::Conflict);
    sleep(RETRY * 2).await;
    let ops: Vec<_> = faults.calls().iter().map(|c| c.operation).collect();
    assert_eq!(
        ops,
        ["try_acquire", "get", "create", "renew", "get", "renew"]
    );
    assert!(!leadership.is_lost());
    drop(leadership);
    a.stop().await;
}

/// The leader steps down at its next renewal when someone else took the record.
#[tokio::test(start_paused = true)]
async fn a_leader_whose_record_was_taken_steps_down() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")));
    let leadership = a.leadership().await;
    write_holder(&store, "intruder", LEASE, 7).await;
    let started = Instant::now();
    leadership.lost().await;
    assert!(Instant::now() - started <= RETRY);
    drop(leadership);
    assert_eq!(a.state.borrow().leader(), Some("intruder"));
    // Release must not free the intruder's lease.
    let stopped = a.stop().await;
    assert_eq!(stopped[0].reason, StepDownReason::Lost);
    let record = stored_record(&store, "election").await;
    assert!(record.is_held_by("intruder"));
}

/// S5: a record deleted under the election (by hand, by a bucket's lifecycle rule, by a
/// cache's eviction) and written anew gives out no token a candidate saw: the next term's
/// token is above the last one seen, not 1 again.
#[tokio::test(start_paused = true)]
async fn a_deleted_record_gives_out_no_token_seen_again() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")));
    let b = Candidate::build(builder(store.lock("election", "b")));
    let first = a.leadership().await;
    write_holder(&store, "intruder", LEASE, 7).await;
    first.lost().await;
    drop(first);
    sleep(RETRY * 2).await;
    store.delete("election");
    while !a.is_leading() && !b.is_leading() {
        sleep(RETRY).await;
    }
    let record = stored_record(&store, "election").await;
    assert_eq!(record.leader_transitions, 8, "{record:?}");
    a.stop().await;
    b.stop().await;
}

/// S2: a record deleted under a live holder (by hand, a bucket's lifecycle rule, an operator's
/// edit) is not taken by a candidate that saw the holder's lease running before that lease
/// ends on its clock: the holder leads on until a renewal meets the deletion (here its renew
/// deadline, its renewals hanging), and nobody leads beside it. On every kind of lock:
/// compare-and-swap alone, and a one-request acquisition that would create the record it
/// found gone.
#[tokio::test(start_paused = true)]
async fn a_record_deleted_under_its_holder_is_waited_out() {
    for one_request in [false, true] {
        let store = MemoryStore::new();
        let lock = |identity: &str| {
            store
                .lock("election", identity)
                .with_store_clock(one_request)
        };
        let holder = FaultyLock::new(lock("a"));
        let hang = holder.faults();
        let mut a = Candidate::build(builder(holder).release_on_cancel(false));
        let first = a.leadership().await;
        let mut b = Candidate::build(builder(lock("b")));
        // The follower sees a few of the holder's renewals.
        sleep(RETRY * 3).await;
        hang.hang(true);
        store.delete("election");
        let deleted = Instant::now();
        let second = b.leadership().await;
        assert!(
            first.is_lost(),
            "b led beside a, {:?} after the deletion ({one_request})",
            Instant::now() - deleted
        );
        // A lease from the first read that found the record gone, a jittered retry period
        // after the deletion at most.
        assert!(
            Instant::now() - deleted <= LEASE + RETRY * 3,
            "b waited {:?} ({one_request})",
            Instant::now() - deleted
        );
        // S5: above the token the deleted record carried.
        assert_eq!(second.fencing_token(), 2, "({one_request})");
        drop((first, second));
        hang.hang(false);
        a.stop().await;
        b.stop().await;
    }
}

/// S2 for a record that may be gone: while a lease it saw runs, a follower asks the store as
/// the lock's one-request acquisition knows the holder (`HolderCheck`): one that judges by the
/// record alone is not sent (it would create a record found gone), the record is read
/// instead; one that also tells a holder whose process ended is sent after a read that found
/// the record; one that needs the holder's session, which a deletion does not free, and a
/// store that assigns leases are sent at every attempt. The first attempt, before any lease
/// was seen, always sends it.
#[tokio::test(start_paused = true)]
async fn a_follower_asks_the_store_as_its_acquisition_knows_the_holder() {
    for (check, want) in [
        (HolderCheck::Record, &["get"][..]),
        (HolderCheck::Process, &["get", "try_acquire"][..]),
        (HolderCheck::Session, &["try_acquire"][..]),
        (HolderCheck::Assigned, &["try_acquire"][..]),
    ] {
        let store = MemoryStore::new();
        let lock = |identity: &str| store.lock("election", identity).with_store_clock(true);
        let mut a = Candidate::build(builder(lock("a")));
        let first = a.leadership().await;
        let follower = TestLock::new(lock("b"));
        let follower = FaultyLock::new(match check {
            // A store that assigns leases, whose acquisition takes up only a lease given.
            HolderCheck::Assigned => follower.assigned(&Arc::default()),
            _ => follower.holder_check(check),
        });
        let faults = follower.faults();
        let b = Candidate::build(builder(follower));
        sleep(RETRY * 5).await;
        let calls: Vec<&str> = faults.calls().iter().map(|c| c.operation).collect();
        assert_eq!(calls.first(), Some(&"try_acquire"), "{check:?}: {calls:?}");
        let later: BTreeSet<&str> = calls[1..].iter().copied().collect();
        assert_eq!(
            later,
            want.iter().copied().collect::<BTreeSet<_>>(),
            "{check:?}: {calls:?}"
        );
        assert!(calls.len() > 3, "{check:?}: {calls:?}");
        b.stop().await;
        drop(first);
        a.stop().await;
    }
}

/// Where the store keeps leases alive itself (an etcd lease, a Redis key's TTL), the store
/// deletes the record when the lease ends: that deletion is the expiry by its clock (S1), and
/// the follower takes the election at once, not a lease later.
#[tokio::test(start_paused = true)]
async fn a_record_the_store_deleted_at_its_expiry_is_taken_at_once() {
    let store = MemoryStore::new();
    let lock = |identity: &str| {
        store
            .lock("election", identity)
            .with_store_clock(true)
            .with_renewal_in_store(true)
    };
    let mut a = Candidate::build(builder(lock("a")).release_on_cancel(false));
    let first = a.leadership().await;
    let mut b = Candidate::build(builder(lock("b")));
    sleep(RETRY * 3).await;
    crash(&a, first).await;
    store.delete("election");
    let deleted = Instant::now();
    let second = b.leadership().await;
    assert!(
        Instant::now() - deleted <= RETRY * 2,
        "waited {:?} for a record the store deleted",
        Instant::now() - deleted
    );
    drop(second);
    b.stop().await;
}

/// Outages and bad data are reported and retried; the elector recovers when they are gone, and
/// never overwrites a record it could not read (S8).
#[tokio::test(start_paused = true)]
async fn errors_are_retried_and_bad_data_is_never_overwritten() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    faults.fail_all(Some(Fault::Unavailable));
    let mut a = Candidate::build(builder(lock));
    sleep(Duration::from_secs(30)).await;
    assert!(!a.is_leading());
    faults.fail_all(None);
    store.corrupt("election", "{\"holderIdentity\": 42");
    sleep(Duration::from_secs(30)).await;
    assert!(!a.is_leading());
    assert!(
        store.lock("election", "x").get().await.is_err(),
        "the corrupt value must be kept"
    );
    store.delete("election");
    let leadership = a.leadership().await;
    assert_eq!(leadership.fencing_token(), 1);
    drop(leadership);
    a.stop().await;
}

/// Backends that decide expiry on the store's clock take over in one request.
#[tokio::test(start_paused = true)]
async fn store_clock_backends_take_over_after_the_lease() {
    let store = MemoryStore::new();
    let (a, first, mut b, faults) = store_clock_pair(&store).await;
    sleep(Duration::from_secs(1)).await;
    let crashed = Instant::now();
    crash(&a, first).await;
    let second = b.leadership().await;
    assert!(
        Instant::now() - crashed >= LEASE - Duration::from_secs(2),
        "took over early"
    );
    assert_eq!(second.fencing_token(), 2);
    // Between the store's answers, while the lease runs, the follower reads the record (a
    // record gone under the holder is not created anew); the store's clock decides.
    let calls = faults.calls();
    assert!(
        calls
            .iter()
            .all(|c| matches!(c.operation, "try_acquire" | "get")),
        "one request per attempt: {calls:?}"
    );
    assert_eq!(
        calls.last().map(|c| c.operation),
        Some("try_acquire"),
        "taken in one request"
    );
    drop(second);
    b.stop().await;
}

/// A store that reports the time left on a held lease wakes the follower right when it runs
/// out by the store's clock, not a lease after the follower happened to notice the holder's
/// last renewal (up to a retry period late). The store's answer is of the version it read: a
/// renewal the follower noticed later only by reading (S2 for a record that may be gone) is
/// counted from then.
#[tokio::test(start_paused = true)]
async fn a_follower_wakes_when_the_store_says_the_lease_runs_out() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(
        builder(store.lock("election", "a").with_store_clock(true)).release_on_cancel(false),
    );
    let first = a.leadership().await;
    let acquired = Instant::now();
    // The follower asks 1.9 s after the holder's acquisition: it notices the lease 1.9 s late.
    sleep(Duration::from_millis(1900)).await;
    let mut b = Candidate::build(builder(store.lock("election", "b").with_store_clock(true)));
    // Crash the holder before its first renewal, at 2 s.
    sleep(Duration::from_millis(50)).await;
    crash(&a, first).await;
    let second = b.leadership().await;
    let taken = Instant::now() - acquired;
    assert!(
        taken >= LEASE && taken <= LEASE + Duration::from_millis(50),
        "taken over {taken:?} after the first acquisition; the lease ran out at {LEASE:?}"
    );
    drop(second);
    b.stop().await;
}

/// S2 by the store's clock after an outage: a renewal the follower first reads after failed
/// attempts may have been written at any time while they failed, so the follower asks the
/// store, whose clock judges it, rather than count a whole lease from that read.
#[tokio::test(start_paused = true)]
async fn a_version_first_read_after_an_outage_is_judged_by_the_store() {
    let store = MemoryStore::new();
    let (a, first, mut b, faults) = store_clock_pair(&store).await;
    sleep(RETRY * 3).await;
    // The follower's store goes out of reach; the holder renews on, then crashes.
    faults.fail_all(Some(Fault::Unavailable));
    sleep(RETRY * 3).await;
    crash(&a, first).await;
    sleep(LEASE * 2).await;
    faults.fail_all(None);
    let back = Instant::now();
    let second = b.leadership().await;
    let taken = Instant::now();
    let calls = faults.calls();
    let read = calls
        .iter()
        .find(|c| c.sent >= back && c.ok == Some(true))
        .expect("a request after the outage");
    assert_eq!(read.operation, "get", "{calls:?}");
    assert!(
        taken - read.sent <= RETRY,
        "taken {:?} after the first read of a lease that ran out by the store's clock",
        taken - read.sent
    );
    assert_eq!(second.fencing_token(), 2);
    drop(second);
    b.stop().await;
}

/// S6: a shutdown that cuts a renewal short, after the store applied it, still releases: the
/// cached version is stale, so the release reads the record and, finding it still this term's,
/// releases from the fresh version.
#[tokio::test(start_paused = true)]
async fn a_shutdown_during_a_renewal_that_reached_the_store_still_releases() {
    let store = MemoryStore::new();
    let (lock, faults) = faulty(&store, "a");
    let mut a = Candidate::build(builder(lock));
    drop(a.leadership().await);
    // The renewal at 2 s reaches the store at once; its answer would take 5 s.
    faults.delay_responses(Duration::from_secs(5));
    sleep(Duration::from_secs(3)).await;
    faults.delay_responses(Duration::ZERO);
    let renewed = faults
        .calls()
        .iter()
        .any(|c| c.operation == "renew" && c.reached.is_some() && c.returned.is_none());
    assert!(renewed, "a renewal is in flight: {:?}", faults.calls());
    let stopped = a.stop().await;
    assert!(stopped[0].released, "{stopped:?}");
    let record = stored_record(&store, "election").await;
    assert!(record.is_free(), "lease released: {record:?}");
}

/// S6: a release that meets a transient failure (the store out of reach for a moment, or
/// throttling) is sent again, so the others need not wait out a lease; one that keeps failing
/// gives up within a request timeout, so a shutdown with the store down stays bounded.
#[tokio::test(start_paused = true)]
async fn a_release_that_fails_for_a_moment_is_sent_again() {
    let store = MemoryStore::new();
    let releases = |faults: &Faults| {
        faults
            .calls()
            .into_iter()
            .filter(|c| c.operation == "update")
            .collect::<Vec<_>>()
    };
    let (stopped, faults, _) =
        stop_a_leader_with(&store, |f| f.fail_next(Fault::Unavailable)).await;
    assert!(stopped[0].released, "{stopped:?}");
    let record = stored_record(&store, "election").await;
    assert!(record.is_free(), "lease released: {record:?}");
    let tries = releases(&faults);
    assert_eq!(tries.len(), 2, "{tries:?}");
    assert_eq!(tries[0].ok, Some(false));

    // Refused for 4 s, then hanging: the try that hangs is cut short where the request
    // timeout from the first try ends, not given a request timeout of its own.
    let failing = |f: &Faults| {
        f.fail_all(Some(Fault::Unavailable));
        let f = f.clone();
        tokio::spawn(async move {
            sleep(Duration::from_secs(4)).await;
            f.fail_all(None);
            f.hang(true);
        });
    };
    let (stopped, faults, took) = stop_a_leader_with(&store, failing).await;
    assert!(!stopped[0].released, "{stopped:?}");
    let timeout = RENEW / 2;
    assert!(
        took <= timeout + Duration::from_millis(100),
        "a release that kept failing held the shutdown up for {took:?}"
    );
    let tries = releases(&faults).len();
    assert!(tries > 2, "the release was tried {tries} times");

    // A release that landed with its answer lost: the try sent again finds the lease freed
    // under this term's token, and says it was released.
    let lost = |f: &Faults| f.lose_next_answer("update", Fault::Unavailable);
    let (stopped, _, _) = stop_a_leader_with(&store, lost).await;
    assert!(stopped[0].released, "{stopped:?}");
    let record = stored_record(&store, "election").await;
    assert!(record.is_free(), "lease released: {record:?}");
}

/// An acquisition that landed with its answer lost (a timeout, a dropped connection) is known
/// again by the candidate that sent it, which takes it over (with the next token) within a
/// retry period or two, instead of waiting out its own lease as another process's (S13).
#[tokio::test(start_paused = true)]
async fn an_acquisition_whose_answer_was_lost_is_known_as_this_processs() {
    // A write by the follower's clock, from no record and from a released one; the store's
    // one-request acquisition, with the store's clock, and with a lease it keeps alive itself.
    let cases = [
        ("create", 0),
        ("update", 0),
        ("try_acquire", 1),
        ("try_acquire", 2),
    ];
    for (operation, kind) in cases {
        let store = MemoryStore::new();
        if operation == "update" {
            write_holder(&store, "", LEASE, 4).await;
        }
        let lock = match kind {
            0 => store.lock("election", "a"),
            1 => store.lock("election", "a").with_store_clock(true),
            _ => store.lock("election", "a").with_renewal_in_store(true),
        };
        let lock = FaultyLock::new(lock);
        let faults = lock.faults();
        faults.lose_next_answer(operation, Fault::Unavailable);
        let started = Instant::now();
        let mut a = Candidate::build(builder(lock));
        let leadership = a.leadership().await;
        let took = started.elapsed();
        assert!(
            took < LEASE,
            "{operation} ({kind}): led {took:?} after the lost answer; the lease is {LEASE:?}"
        );
        let record = stored_record(&store, "election").await;
        assert_eq!(record.holder_identity, "a");
        assert_eq!(record.leader_transitions, leadership.fencing_token());
        let lost = faults.failures(operation);
        assert_eq!(lost, 1, "{operation} ({kind}): {:?}", faults.calls());
        drop(leadership);
        a.stop().await;
    }
}

/// Elects a leader of `store`'s election on a faulty lock, sets its faults with `fault`, and
/// stops it: what it said of its terms, its faults, and how long the stop took.
async fn stop_a_leader_with(
    store: &MemoryStore,
    fault: impl FnOnce(&Faults),
) -> (Vec<StepDown>, Faults, Duration) {
    let (lock, faults) = faulty(store, "a");
    let mut a = Candidate::build(builder(lock));
    drop(a.leadership().await);
    fault(&faults);
    let asked = Instant::now();
    let stopped = a.stop().await;
    (stopped, faults, asked.elapsed())
}

/// S10 from the leader's own work: `Leadership::hand_over` ends the term, waits for the work,
/// releases with the named candidate recorded; the named one leads next while the third stands
/// back, with a larger token, and the old leader's step-down says why.
#[tokio::test(start_paused = true)]
async fn the_leader_hands_over_to_the_named_candidate() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")));
    let first = a.leadership().await;
    let b = Candidate::build(builder(store.lock("election", "b")));
    let mut c = Candidate::build(builder(store.lock("election", "c")));
    sleep(RETRY * 2).await;
    first.hand_over("c").expect("leading");
    drop(first);
    let next = c.leadership().await;
    assert!(next.fencing_token() > 1, "token {}", next.fencing_token());
    assert!(!b.is_leading() && !a.is_leading());
    // The request is fulfilled: cleared by the acquisition.
    let record = stored_record(&store, "election").await;
    assert_eq!(record.holder_identity, "c");
    assert_eq!(record.handover_to(), None);
    drop(next);
    let _ = b.stop().await;
    let _ = c.stop().await;
    let stopped = a.stop().await;
    assert_eq!(stopped[0].reason, StepDownReason::HandedOver);
    assert!(stopped[0].released, "{stopped:?}");
}

/// S10 from outside: a request written with `request_handover` is seen by the leader at its next
/// renewal (this memory lock notifies nobody), which releases to the named candidate. A request
/// for a candidate that never comes holds the others back for one lease, not longer.
#[tokio::test(start_paused = true)]
async fn a_handover_request_moves_the_lease_and_a_missing_candidate_does_not_stall_it() {
    let store = MemoryStore::new();
    let quiet = |id: &str| store.lock("election", id).with_watch(false);
    let mut a = Candidate::build(builder(quiet("a")));
    let first = a.leadership().await.fencing_token();
    let mut b = Candidate::build(builder(quiet("b")));
    let c = Candidate::build(builder(quiet("c")));
    sleep(RETRY * 2).await;
    let asked = Instant::now();
    leader_core::request_handover(&quiet("operator"), "b")
        .await
        .expect("request");
    let second = b.leadership().await.fencing_token();
    assert!(
        asked.elapsed() <= RETRY + Duration::from_millis(10),
        "the leader saw the request at its next renewal: {:?}",
        asked.elapsed()
    );
    assert!(second > first);
    assert!(!a.is_leading() && !c.is_leading());

    leader_core::request_handover(&quiet("operator"), "gone")
        .await
        .expect("request");
    let asked = Instant::now();
    let mut leading = None;
    while leading.is_none() {
        sleep(Duration::from_millis(100)).await;
        leading = [&a, &b, &c].iter().position(|e| {
            e.state
                .borrow()
                .leadership()
                .is_some_and(|l| l.fencing_token() > second)
        });
        assert!(asked.elapsed() < LEASE * 2 + RETRY * 2, "nobody took over");
    }
    let took = asked.elapsed();
    assert!(
        took >= LEASE,
        "the others stood back for a lease after seeing the request, yet one led after {took:?}"
    );
    for elector in [a, b, c] {
        let _ = elector.stop().await;
    }
}

/// S2 by the store alone: a holder that renews by extending its lease in the store leaves the
/// record's version unchanged, so a follower must not count the lease on its own clock; it
/// takes over only when the store says the lease ran out.
#[tokio::test(start_paused = true)]
async fn a_lease_renewed_in_the_store_is_never_taken_over_on_the_followers_clock() {
    let store = MemoryStore::new();
    let lock = |id: &str| store.lock("election", id).with_renewal_in_store(true);
    let (leader, leader_calls) = {
        let lock = FaultyLock::new(lock("a"));
        let calls = lock.faults();
        (lock, calls)
    };
    let mut a = Candidate::build(builder(leader));
    let token = a.leadership().await.fencing_token();
    let mut b = Candidate::build(builder(lock("b")));
    // Many leases long, with the record's version never changing.
    sleep(LEASE * 4).await;
    assert!(a.is_leading() && !b.is_leading());
    let renewals = leader_calls
        .calls()
        .into_iter()
        .filter(|c| c.operation == "renew")
        .count();
    assert!(renewals >= 20, "renewals: {renewals}");
    // The leader stops renewing (its requests hang): the store expires the lease after its
    // last renewal, and the follower takes over.
    leader_calls.hang(true);
    let next = b.leadership().await.fencing_token();
    assert!(next > token);
    assert!(!a.is_leading());
    leader_calls.hang(false);
    let _ = b.stop().await;
    let _ = a.stop().await;
}

/// Candidate `a`'s lock on `store`, whose acquisitions come as handed over by a release on a
/// lease the store confirmed alive `confirmed_ago` before the attempt; its writes (renewals and
/// updates) fail while the switch returned is on.
fn handed(store: &MemoryStore, confirmed_ago: Duration) -> (FaultyLock<TestLock>, Faults, Switch) {
    let failing_renewals = Switch::default();
    let lock = FaultyLock::new(
        TestLock::new(store.lock("election", "a").with_renewal_in_store(true))
            .handed(confirmed_ago)
            .failing_writes(&failing_renewals),
    );
    let faults = lock.faults();
    (lock, faults, failing_renewals)
}

/// S3 for a lease handed over: the candidate leads without a request, and its term counts from
/// when the store last confirmed its lease alive, not from the attempt.
#[tokio::test(start_paused = true)]
async fn a_handed_lease_counts_from_its_last_confirmation() {
    let store = MemoryStore::new();
    let ago = Duration::from_secs(3);
    let (lock, faults, failing_renewals) = handed(&store, ago);
    failing_renewals.set(true);
    let started = Instant::now();
    let mut a = Candidate::build(builder(lock));
    let leadership = a.leadership().await;
    let operations: Vec<_> = faults.calls().iter().map(|c| c.operation).collect();
    assert_eq!(
        operations,
        ["try_acquire"],
        "no request besides the acquisition"
    );
    // No renewal succeeds: the term ends a renew deadline after the confirmation.
    leadership.lost().await;
    let lasted = started.elapsed();
    assert!(
        lasted <= RENEW - ago,
        "the term outlived the handed lease's confirmation by more than the renew deadline: {lasted:?}"
    );
    assert!(
        lasted >= RENEW - ago - Duration::from_millis(1),
        "{lasted:?}"
    );
    let _ = a.stop().await;
}

/// A handed lease confirmed so long ago that the term would end before the first renewal is
/// renewed before the candidate leads; while that renewal fails, it does not lead.
#[tokio::test(start_paused = true)]
async fn a_handed_lease_with_too_little_left_is_renewed_before_leading() {
    let store = MemoryStore::new();
    let (lock, faults, failing_renewals) = handed(&store, RENEW - RETRY / 2);
    failing_renewals.set(true);
    let mut a = Candidate::build(builder(lock));
    sleep(RENEW * 2).await;
    assert!(!a.is_leading(), "led on a lease nobody confirmed");
    failing_renewals.set(false);
    let leadership = a.leadership().await;
    // The handed term is this process's own (S13): a renewal, or a compare-and-swap taking
    // the term again, confirms it before leading.
    let (operations, next) = after_last_acquisition(&faults);
    assert!(
        matches!(next, Some("renew" | "update")),
        "a write confirms the handed lease before leading: {operations:?}"
    );
    assert!(!leadership.is_lost());
    let _ = a.stop().await;
}

/// A candidate of a store that assigns the lease never takes a free or expired lease on its
/// own, and leads once the store names it, with the next fencing token.
#[tokio::test(start_paused = true)]
async fn a_candidate_of_an_assigning_store_leads_only_once_assigned() {
    let store = MemoryStore::new();
    let (lock, calls) = {
        let lock =
            FaultyLock::new(TestLock::new(store.lock("election", "b")).assigned(&Arc::default()));
        let calls = lock.faults();
        (lock, calls)
    };
    let mut b = Candidate::build(builder(lock));
    // No record at all, then a long-expired one held by someone else.
    sleep(LEASE * 2).await;
    write_holder(&store, "gone", Duration::from_secs(1), 4).await;
    sleep(LEASE * 2).await;
    assert!(!b.is_leading());
    let writes = calls
        .calls()
        .into_iter()
        .filter(|c| c.operation == "create" || c.operation == "update")
        .count();
    assert_eq!(writes, 0, "an unassigned candidate never writes");
    // The store assigns it.
    write_holder(&store, "b", LEASE, 4).await;
    let leadership = b.leadership().await;
    assert_eq!(leadership.fencing_token(), 5);
    let _ = b.stop().await;
}

/// A candidate that shuts down while leading withdraws its candidacy before it releases, so
/// that a store assigning the lease does not give the released lease back to it.
#[tokio::test(start_paused = true)]
async fn a_leader_shutting_down_withdraws_before_it_releases() {
    let store = MemoryStore::new();
    let order = Arc::new(Mutex::new(Vec::new()));
    let lock = TestLock::new(store.lock("election", "b")).assigned(&order);
    let b = Candidate::build(builder(lock));
    write_holder(&store, "b", LEASE, 1).await;
    let mut b = b;
    let _ = b.leadership().await;
    let _ = b.stop().await;
    let order = order.lock().unwrap().clone();
    let withdrew = order.iter().position(|o| o == "withdraw");
    let released = order.iter().rposition(|o| o == r#"update holder="""#);
    assert!(
        matches!((withdrew, released), (Some(w), Some(r)) if w < r),
        "{order:?}"
    );
}

/// Every elector checks its lease against the store before running (not only the `leader`
/// command): a lease the store would not keep is one error (on_error, the status) and the
/// elector stops without writing; a lease it keeps runs as usual.
#[tokio::test(start_paused = true)]
async fn a_lease_the_store_would_not_keep_is_refused_before_running() {
    for (lease, runs) in [
        (Duration::from_secs(15), false),
        (Duration::from_secs(5), true),
    ] {
        let store = MemoryStore::new();
        let errors = Arc::new(Mutex::new(Vec::new()));
        let seen = errors.clone();
        let lock =
            TestLock::new(store.lock("election", "a")).longest_lease(Duration::from_secs(10));
        let elector = LeaderElector::builder(lock)
            .lease_duration(lease)
            .renew_deadline(Duration::from_secs(3))
            .retry_period(Duration::from_secs(1))
            .on_error(move |err| seen.lock().unwrap().push(err.to_string()))
            .build()
            .expect("valid timings");
        let status = elector.status();
        let mut state = elector.subscribe();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(elector.run(shutdown.clone()));
        let led = tokio::time::timeout(
            Duration::from_secs(5),
            state.wait_for(LeaderState::is_leading),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        assert_eq!(led, runs, "lease {lease:?}");
        if !runs {
            let refused = task.await.expect("the elector stops by itself");
            let err = refused.expect_err("run says why it stopped");
            assert!(err.to_string().contains("at most"), "{err}");
            let errors = errors.lock().unwrap().clone();
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(errors[0].contains("at most"), "{errors:?}");
            assert!(status.last_error().is_some());
            assert!(
                store
                    .lock("election", "r")
                    .get()
                    .await
                    .expect("get")
                    .is_none(),
                "it wrote"
            );
        } else {
            shutdown.cancel();
            task.await.expect("stops").expect("the elector ran");
        }
    }
}
