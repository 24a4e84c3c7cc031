//! Policies side by side, on tokio's paused clock with electors on the in-memory lock: an
//! on-time firing during a catch-up under `Forbid` with `Missed::All`; `Replace` beside a
//! backlog and beside a retry, every superseded firing told; `Replace` never running two at once
//! while the replaced work takes its time to stop; the misfire threshold; `Allow` bounded.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::MemoryStore;
use leader_cron::{
    CronEvent, CronJob, Firing, Interrupted, Missed, Outcome, Overlap, Schedule, TokioClock,
};
use tokio::time::sleep;

use common::{Log, Replica, instants, minutes, origin, replica, scheduled, stored, world};

fn every_minute() -> Schedule {
    Schedule::every(Duration::from_secs(60)).expect("schedule")
}

/// One replica alone on a schedule of every 10 s, its firings working for `works`.
fn every_ten_seconds(
    works: Duration,
    configure: impl FnOnce(leader_cron::CronJobBuilder) -> leader_cron::CronJobBuilder,
) -> (MemoryStore, Log, Replica) {
    let (store, log) = (MemoryStore::new(), Log::default());
    let clock = TokioClock::starting_at(origin());
    let every = Schedule::every(Duration::from_secs(10)).expect("schedule");
    let replica = replica(&store, &clock, "a", &every, &log, works, configure);
    (store, log, replica)
}

/// Replica `a` on a schedule of every minute, its firings working for `works`, leads until
/// 1:30 (it runs the firing of minute 1) and dies; nobody leads for `gap`; then replica `b`,
/// configured alike, starts.
async fn a_dies_then_b_starts(
    store: &MemoryStore,
    clock: &TokioClock,
    log: &Log,
    works: Duration,
    configure: impl Fn(leader_cron::CronJobBuilder) -> leader_cron::CronJobBuilder + Copy,
    gap: Duration,
) -> Replica {
    let mut a = replica(store, clock, "a", &every_minute(), log, works, configure);
    sleep(Duration::from_secs(90)).await;
    a.crash();
    sleep(gap).await;
    replica(store, clock, "b", &every_minute(), log, works, configure)
}

/// Instants as seconds after the origin.
fn seconds(instants: &[DateTime<Utc>]) -> Vec<i64> {
    instants
        .iter()
        .map(|at| (*at - origin()).num_seconds())
        .collect()
}

/// A new leader catches up a late firing (minute 2, working 20 s) under `Forbid` and
/// `Missed::All`; the firing of minute 3 comes due on time meanwhile. It waits its turn and
/// runs: every firing runs once, in order, none missed.
#[tokio::test(start_paused = true)]
async fn forbid_with_missed_all_runs_an_on_time_firing_due_during_a_catch_up() {
    let (store, clock, log) = world();
    let works = Duration::from_secs(20);
    let configure =
        |b: leader_cron::CronJobBuilder| b.missed(Missed::All { max: 10 }).overlap(Overlap::Forbid);
    // Nobody leads until b, started at 2:30, takes over a lease later.
    let gap = Duration::from_secs(60);
    let mut b = a_dies_then_b_starts(&store, &clock, &log, works, configure, gap).await;
    sleep(Duration::from_secs(2 * 60)).await;
    assert!(b.leading(), "{:?}", b.errors.lock().expect("errors"));
    assert_eq!(
        scheduled(&log),
        (1..=4).map(minutes).collect::<Vec<_>>(),
        "each firing once, in order"
    );
    let state = stored(&store).await;
    assert_eq!(state.missed, 0, "none missed: {state:?}");
    b.crash();
}

/// `Replace` beside `Missed::All`: of a backlog of four late firings the last replaces the
/// others before they start; each of those is counted as missed, none vanishes.
#[tokio::test(start_paused = true)]
async fn replace_beside_a_backlog_counts_every_firing_it_supersedes() {
    let (store, clock, log) = world();
    let works = Duration::from_secs(5);
    let configure =
        |b: leader_cron::CronJobBuilder| b.missed(Missed::All { max: 3 }).overlap(Overlap::Replace);
    let gap = Duration::from_secs(4 * 60);
    let mut b = a_dies_then_b_starts(&store, &clock, &log, works, configure, gap).await;
    sleep(Duration::from_secs(25)).await;
    assert!(b.leading());
    // 5:30 plus a lease: minutes 2 to 5 are late; 2 is beyond --missed-max, 3 and 4 are
    // superseded by 5, which runs.
    assert_eq!(scheduled(&log), vec![minutes(1), minutes(5)]);
    let state = stored(&store).await;
    assert_eq!(state.missed, 3, "2, 3 and 4: {state:?}");
    b.crash();
}

/// `Replace` beside a retry: the leader of minute 1's firing dies mid-run; its successor takes
/// over after minute 2 came due, so the retry of minute 1 and minute 2 are due at once. Minute 2
/// supersedes the retry, which ends as replaced (an outcome a subscriber sees), not silently.
#[tokio::test(start_paused = true)]
async fn replace_beside_a_retry_records_the_retry_as_replaced() {
    let (store, clock, log) = world();
    let works = Duration::from_secs(50);
    let configure = |b: leader_cron::CronJobBuilder| {
        b.overlap(Overlap::Replace)
            .interrupted(Interrupted::Retry { max_attempts: 3 })
    };
    // b starts at 1:55 and takes over a lease later, after minute 2.
    let gap = Duration::from_secs(25);
    let mut b = a_dies_then_b_starts(&store, &clock, &log, works, configure, gap).await;
    sleep(Duration::from_secs(30)).await;
    assert!(b.leading());
    let mut ended = Vec::new();
    while let Ok(event) = b.events.try_recv() {
        if let CronEvent::Ended {
            scheduled,
            attempt,
            outcome,
        } = event
        {
            ended.push((scheduled, attempt, outcome));
        }
    }
    assert_eq!(
        ended,
        vec![(minutes(1), 2, Outcome::Replaced)],
        "the retry superseded by minute 2"
    );
    assert_eq!(
        instants(&log),
        vec![(minutes(1), 1), (minutes(2), 1)],
        "minute 2 runs, the retry never started"
    );
    let state = stored(&store).await;
    assert!(
        state.running.iter().all(|r| r.scheduled == minutes(2)),
        "{state:?}"
    );
    b.crash();
}

/// `Replace` with work that takes 5 s to stop once cancelled (a COMMAND in its grace after
/// SIGTERM): the next firing starts only when the replaced work has returned, so two never
/// run at once; each replaced firing is recorded as replaced.
#[tokio::test(start_paused = true)]
async fn replace_waits_for_the_replaced_work_to_stop() {
    let store = MemoryStore::new();
    let clock = TokioClock::starting_at(origin());
    let every = Schedule::every(Duration::from_secs(10)).expect("schedule");
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let started = Arc::new(Mutex::new(Vec::new()));
    let job = {
        let (now, most, started) = (now.clone(), most.clone(), started.clone());
        CronJob::builder("report", every)
            .clock(clock.clone())
            .overlap(Overlap::Replace)
            .build(move |firing: Firing, cancel| {
                let (now, most, started) = (now.clone(), most.clone(), started.clone());
                async move {
                    let running = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(running, Ordering::SeqCst);
                    started.lock().expect("log").push(firing.scheduled);
                    tokio::select! {
                        () = sleep(Duration::from_secs(25)) => {}
                        () = cancel.cancelled() => sleep(Duration::from_secs(5)).await,
                    }
                    now.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            })
            .expect("a job")
    };
    let mut a = Replica::start(&store, "a", job);
    sleep(Duration::from_secs(62)).await;
    assert_eq!(most.load(Ordering::SeqCst), 1, "two firings ran at once");
    let started: Vec<i64> = started
        .lock()
        .expect("log")
        .iter()
        .map(|at| (*at - origin()).num_seconds())
        .collect();
    // 10 runs; 20 replaces it and starts at 25, when 10's work returned; 30 replaces 20 and
    // starts at 35, and so on: each firing starts, 5 s late, and none is missed.
    assert_eq!(started, vec![10, 20, 30, 40, 50]);
    let replaced = std::iter::from_fn(|| a.events.try_recv().ok())
        .filter(|e| {
            matches!(
                e,
                CronEvent::Ended {
                    outcome: Outcome::Replaced,
                    ..
                }
            )
        })
        .count();
    assert_eq!(replaced, 5, "10, 20, 30, 40 and 50 were replaced");
    assert_eq!(stored(&store).await.missed, 0);
    a.crash();
}

/// A leader that takes over 5 s after a firing's time: with the default misfire threshold
/// (1 s) the firing is late and `Missed::Skip` skips it; with a threshold of 30 s it is on
/// time and runs.
#[tokio::test(start_paused = true)]
async fn the_misfire_threshold_decides_on_time() {
    for (threshold, runs) in [(None, false), (Some(Duration::from_secs(30)), true)] {
        let (store, clock, log) = world();
        let works = Duration::from_secs(5);
        let configure = |b: leader_cron::CronJobBuilder| {
            let b = b.missed(Missed::Skip);
            match threshold {
                Some(threshold) => b.misfire_threshold(threshold),
                None => b,
            }
        };
        let mut a = replica(&store, &clock, "a", &every_minute(), &log, works, configure);
        sleep(Duration::from_secs(1)).await;
        let mut b = replica(&store, &clock, "b", &every_minute(), &log, works, configure);
        // a dies at 1:50, b takes over a lease after a's last renewal: a few seconds past 2:00.
        sleep(Duration::from_secs(109)).await;
        assert!(a.leading());
        a.crash();
        sleep(Duration::from_secs(40)).await;
        assert!(b.leading());
        let started = scheduled(&log);
        assert_eq!(
            started.contains(&minutes(2)),
            runs,
            "threshold {threshold:?}: {started:?}"
        );
        assert_eq!(stored(&store).await.missed, u64::from(!runs));
        b.crash();
    }
}

/// `Allow` with firings that never end: at most `max_running` run at once, the rest wait, and
/// the record's list of running firings stays bounded.
#[tokio::test(start_paused = true)]
async fn allow_is_bounded_by_max_running() {
    let (store, log, mut a) = every_ten_seconds(Duration::from_secs(10_000), |b| {
        b.overlap(Overlap::Allow).max_running(3)
    });
    sleep(Duration::from_secs(125)).await;
    assert_eq!(seconds(&scheduled(&log)), vec![10, 20, 30]);
    let state = stored(&store).await;
    assert_eq!(state.running.len(), 3, "{state:?}");
    a.crash();
}

/// A bad maximum is refused when the job is built.
#[test]
fn max_running_must_be_one_to_a_thousand() {
    for max in [0, 1001] {
        let built = CronJob::builder("report", every_minute())
            .max_running(max)
            .build(|_: Firing, _| async { Ok(()) });
        assert!(
            matches!(built, Err(leader_cron::CronError::BadPolicy(_))),
            "{max}"
        );
    }
}

/// The record keeps the latest outcomes, as many as the job says, each with its start, end,
/// attempt, token and leader.
#[tokio::test(start_paused = true)]
async fn the_history_keeps_the_latest_outcomes() {
    let (store, _, mut a) = every_ten_seconds(Duration::from_secs(1), |b| b.history(3));
    sleep(Duration::from_secs(65)).await;
    let state = stored(&store).await;
    let kept: Vec<DateTime<Utc>> = state.history.iter().map(|e| e.scheduled).collect();
    assert_eq!(seconds(&kept), vec![40, 50, 60], "{state:?}");
    for ended in &state.history {
        assert_eq!(ended.outcome, Outcome::Succeeded);
        assert_eq!(ended.identity.as_deref(), Some("a"));
        assert_eq!(ended.fencing_token, Some(1));
        assert_eq!(ended.started_at, Some(ended.scheduled));
        assert_eq!(
            ended.ended_at - ended.scheduled,
            chrono::Duration::seconds(1)
        );
    }
    assert_eq!(state.last.as_ref(), state.history.last());
    a.crash();
}
