//! S9 on tokio's paused clock: a candidate whose store fails, for any reason, never retries faster
//! than its retry period, backs off to the cap during a long outage, and leads again soon after
//! the store is back. Checked for every kind of failure, with and without change notifications,
//! including notifications that flood or end at once.

use std::time::Duration;

use chrono::Utc;
use leader_core::faults::{ChangeFault, Fault, Faults, FaultyLock};
use leader_core::{
    CancellationToken, LeaderElectionRecord, LeaderElector, LeaderState, MemoryStore, ResourceLock,
};
use tokio::time::{Instant, sleep};

const LEASE: Duration = Duration::from_secs(15);
const RETRY: Duration = Duration::from_secs(2);
const OUTAGE: Duration = Duration::from_secs(3600);

#[derive(Clone, Copy, Debug)]
enum Failure {
    Injected(Fault),
    /// Requests hang until they time out.
    Hang,
    /// The stored value cannot be decoded.
    Unreadable,
}

const FAILURES: [Failure; 5] = [
    Failure::Injected(Fault::Unavailable),
    Failure::Injected(Fault::Forbidden),
    Failure::Injected(Fault::InvalidRecord),
    Failure::Hang,
    Failure::Unreadable,
];

const NOTIFICATIONS: [Option<ChangeFault>; 4] = [
    None, // a lock without notifications
    Some(ChangeFault::None),
    Some(ChangeFault::Flood(Duration::from_millis(100))),
    Some(ChangeFault::EndAtOnce),
];

/// Another process's record, whose lease runs out long before the outage ends.
async fn write_other_holder(store: &MemoryStore) {
    let now = Utc::now();
    let record = LeaderElectionRecord::new("gone", LEASE, now, 7);
    store
        .lock("election", "gone")
        .create(&record)
        .await
        .expect("create");
}

fn start(
    store: &MemoryStore,
    notifications: Option<ChangeFault>,
    store_clock: bool,
) -> (Faults, Candidate) {
    let lock = FaultyLock::new(
        store
            .lock("election", "b")
            .with_watch(notifications.is_some())
            .with_store_clock(store_clock),
    );
    let faults = lock.faults();
    if let Some(change) = notifications {
        faults.changes(change);
    }
    let elector = LeaderElector::builder(lock)
        .lease_duration(LEASE)
        .retry_period(RETRY)
        .build()
        .expect("valid timings");
    let state = elector.subscribe();
    let shutdown = CancellationToken::new();
    tokio::spawn(elector.run(shutdown.clone()));
    (faults, Candidate { state, shutdown })
}

struct Candidate {
    state: tokio::sync::watch::Receiver<LeaderState>,
    shutdown: CancellationToken,
}

fn attempts_between(faults: &Faults, from: Instant, to: Instant) -> Vec<Instant> {
    faults
        .calls()
        .iter()
        .map(|c| c.sent)
        .filter(|sent| *sent >= from && *sent < to)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn failed_attempts_never_come_faster_than_the_retry_period_and_back_off_to_the_cap() {
    for (failure, notifications, store_clock) in FAILURES.into_iter().flat_map(|f| {
        NOTIFICATIONS
            .into_iter()
            .flat_map(move |n| [(f, n, false), (f, n, true)])
    }) {
        {
            let case = format!(
                "{failure:?} with notifications {notifications:?}, store clock {store_clock}"
            );
            let store = MemoryStore::new();
            write_other_holder(&store).await;
            let (faults, mut candidate) = start(&store, notifications, store_clock);
            // The candidate reads the holder's record, then the store fails.
            sleep(Duration::from_millis(100)).await;
            let began = Instant::now();
            match failure {
                Failure::Injected(fault) => faults.fail_all(Some(fault)),
                Failure::Hang => faults.hang(true),
                Failure::Unreadable => store.corrupt("election", "{\"holderIdentity\": 42"),
            }
            sleep(OUTAGE).await;
            let ended = Instant::now();
            let attempts = attempts_between(&faults, began, ended);
            // Each attempt is one request, two for a read that is followed by a write.
            let gaps: Vec<Duration> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
            let shortest = gaps.iter().min().copied().unwrap_or(OUTAGE);
            assert!(shortest >= RETRY, "{case}: two attempts {shortest:?} apart");
            // Backing off to the cap: at most one attempt per half a lease after the first few.
            let bound = 6 + (OUTAGE.as_secs() / (LEASE.as_secs() / 2)) as usize;
            assert!(
                attempts.len() <= bound,
                "{case}: {} attempts in an hour, more than {bound}",
                attempts.len()
            );
            assert!(
                attempts.len() >= 100,
                "{case}: only {} attempts in an hour: it gave up?",
                attempts.len()
            );
            assert!(
                faults.watches() <= bound + 2,
                "{case}: {} subscriptions to notifications",
                faults.watches()
            );

            // Recovery: leading within the back-off cap and one jittered retry period.
            faults.clear();
            if notifications.is_some() {
                faults.changes(notifications.unwrap_or_default());
            }
            if let Failure::Unreadable = failure {
                store.delete("election");
            }
            // A record found gone (the unreadable one, deleted) under a holder that may have
            // renewed while it could not be read is waited out for a lease from that read (S2
            // for a record that is gone).
            let within = match failure {
                Failure::Unreadable => LEASE * 2 + RETRY.mul_f64(2.2),
                _ => LEASE + RETRY.mul_f64(2.2),
            };
            let back = Instant::now();
            tokio::time::timeout(within, candidate.state.wait_for(LeaderState::is_leading))
                .await
                .unwrap_or_else(|_| panic!("{case}: no leader within the cap after recovery"))
                .expect("elector alive");
            assert!(back.elapsed() <= within, "{case}");
            candidate.shutdown.cancel();
        }
    }
}

/// With the store up, a lease that runs out wakes a candidate early once; a record the candidate
/// cannot take (here, a conflict every time) does not make it try again and again at once.
#[tokio::test(start_paused = true)]
async fn an_expired_lease_wakes_a_candidate_early_only_once() {
    let store = MemoryStore::new();
    write_other_holder(&store).await;
    let (faults, _candidate) = start(&store, None, false);
    sleep(LEASE - Duration::from_secs(1)).await;
    // From now on every write loses its compare-and-swap, as if someone always wrote first.
    let began = Instant::now();
    for _ in 0..1000 {
        faults.fail_next(Fault::Conflict);
    }
    sleep(Duration::from_secs(60)).await;
    let attempts = attempts_between(&faults, began, Instant::now());
    assert!(
        attempts.len() <= 2 * (60 / RETRY.as_secs() as usize + 2),
        "{} requests in 60 s",
        attempts.len()
    );
}
