//! Failed firings and time limits on tokio's paused clock, with electors on the in-memory lock:
//! a failure run again after a growing back-off up to the job's retries, each attempt recorded;
//! a firing stopped past its timeout; a retry waiting in the record run by the next leader.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::MemoryStore;
use leader_cron::{CronJob, Firing, Outcome, Schedule, TokioClock};
use tokio::time::sleep;

use common::{Replica, by_leadership, origin, stored};

/// The attempts the jobs started: (seconds after the origin when it started, attempt, replica).
type Starts = Arc<Mutex<Vec<(i64, u32, String)>>>;

/// A replica on a schedule of every 600 s whose work, for 1 s, fails until attempt
/// `succeeds_at`, or runs until cancelled when `hangs`.
fn replica(
    store: &MemoryStore,
    clock: &TokioClock,
    id: &str,
    starts: &Starts,
    succeeds_at: u32,
    hangs: bool,
    configure: impl FnOnce(leader_cron::CronJobBuilder) -> leader_cron::CronJobBuilder,
) -> Replica {
    let every = Schedule::every(Duration::from_secs(600)).expect("schedule");
    let (starts, id_owned, now) = (starts.clone(), id.to_owned(), clock.clone());
    let job = configure(CronJob::builder("report", every).clock(clock.clone()))
        .build(move |firing: Firing, cancel| {
            let (starts, id) = (starts.clone(), id_owned.clone());
            let at = (leader_cron::Clock::now(&now) - origin()).num_seconds();
            async move {
                starts
                    .lock()
                    .expect("starts")
                    .push((at, firing.attempt, id));
                if hangs {
                    cancel.cancelled().await;
                    return Err("stopped".into());
                }
                sleep(Duration::from_secs(1)).await;
                if firing.attempt < succeeds_at {
                    return Err(format!("attempt {} failed", firing.attempt).into());
                }
                Ok(())
            }
        })
        .expect("a job");
    Replica::start(store, id, job)
}

/// As [`common::world`], with the attempts started in place of a log.
fn world() -> (MemoryStore, TokioClock, Starts) {
    let clock = TokioClock::starting_at(origin());
    (MemoryStore::new(), clock, Starts::default())
}

/// The attempts started, in order: (seconds after the origin when it started, attempt).
fn when(starts: &Starts) -> Vec<(i64, u32)> {
    let starts = starts.lock().expect("starts");
    starts.iter().map(|s| (s.0, s.1)).collect()
}

fn outcomes(history: &[leader_cron::Ended]) -> Vec<(u32, &'static str)> {
    history
        .iter()
        .map(|e| (e.attempt, e.outcome.name()))
        .collect()
}

fn at(seconds: i64) -> DateTime<Utc> {
    origin() + chrono::Duration::seconds(seconds)
}

/// Attempts 1 and 2 fail; the third succeeds: each runs after a back-off of 10 s, then 20 s.
#[tokio::test(start_paused = true)]
async fn a_failed_firing_runs_again_after_a_growing_back_off() {
    let (store, clock, starts) = world();
    let mut a = replica(&store, &clock, "a", &starts, 3, false, |b| b.retries(3));
    sleep(Duration::from_secs(700)).await;
    assert_eq!(when(&starts), vec![(600, 1), (611, 2), (632, 3)]);
    let state = stored(&store).await;
    assert_eq!(
        outcomes(&state.history),
        vec![(1, "failed"), (2, "failed"), (3, "succeeded")]
    );
    assert!(state.retrying.is_empty(), "{state:?}");
    assert!(state.history.iter().all(|e| e.scheduled == at(600)));
    a.crash();
}

/// The back-off stops growing at six minutes: 200 s, then 360 s where doubling would give 400 s
/// (past the next firing at 1200 s).
#[tokio::test(start_paused = true)]
async fn the_back_off_stops_growing_at_six_minutes() {
    let (store, clock, starts) = world();
    let mut a = replica(&store, &clock, "a", &starts, 3, false, |b| {
        b.retries(3).retry_backoff(Duration::from_secs(200))
    });
    sleep(Duration::from_secs(1190)).await;
    assert_eq!(when(&starts), vec![(600, 1), (801, 2), (1162, 3)]);
    a.crash();
}

/// With one retry, two failures end the firing: its last outcome is the failure.
#[tokio::test(start_paused = true)]
async fn retries_run_out() {
    let (store, clock, starts) = world();
    let mut a = replica(&store, &clock, "a", &starts, 10, false, |b| b.retries(1));
    sleep(Duration::from_secs(700)).await;
    assert_eq!(starts.lock().expect("starts").len(), 2);
    let state = stored(&store).await;
    assert_eq!(outcomes(&state.history), vec![(1, "failed"), (2, "failed")]);
    assert!(state.retrying.is_empty());
    a.crash();
}

/// Work past its timeout is stopped and recorded as timed out, and its retry too.
#[tokio::test(start_paused = true)]
async fn a_firing_past_its_timeout_is_stopped() {
    let (store, clock, starts) = world();
    let mut a = replica(&store, &clock, "a", &starts, 1, true, |b| {
        b.timeout(Duration::from_secs(5)).retries(1)
    });
    sleep(Duration::from_secs(640)).await;
    assert_eq!(when(&starts), vec![(600, 1), (615, 2)]);
    let state = stored(&store).await;
    assert_eq!(
        outcomes(&state.history),
        vec![(1, "timed out"), (2, "timed out")]
    );
    assert_eq!(state.last.map(|l| l.ended_at), Some(at(620)));
    a.crash();
}

/// The leader dies while a retry waits for its back-off: the next leader finds it in the
/// record and runs it.
#[tokio::test(start_paused = true)]
async fn the_next_leader_runs_a_waiting_retry() {
    let (store, clock, starts) = world();
    let configure = |b: leader_cron::CronJobBuilder| b.retries(2);
    let mut a = replica(&store, &clock, "a", &starts, 2, false, configure);
    sleep(Duration::from_secs(1)).await;
    let mut b = replica(&store, &clock, "b", &starts, 2, false, configure);
    sleep(Duration::from_secs(604)).await;
    let (leader, follower) = by_leadership(&mut a, &mut b);
    leader.crash();
    sleep(Duration::from_secs(60)).await;
    assert!(follower.leading());
    let seen = starts.lock().expect("starts").clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!((seen[0].1, seen[1].1), (1, 2));
    assert_ne!(seen[0].2, seen[1].2, "the retry ran on the next leader");
    let state = stored(&store).await;
    assert_eq!(
        outcomes(&state.history),
        vec![(1, "failed"), (2, "succeeded")]
    );
    assert!(matches!(
        state.history[0].outcome,
        Outcome::Failed { ref message } if message == "attempt 1 failed"
    ));
    follower.crash();
}

/// The lateness histogram measures the schedule's own first attempts: not a retry, which
/// waits for its back-off, nor a trigger, which has no schedule to be late for.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_lateness_metric_leaves_out_retries_and_triggers() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let (store, clock, starts) = world();
    let mut a = replica(&store, &clock, "a", &starts, 2, false, |b| {
        b.retries(1).retry_backoff(Duration::from_secs(10))
    });
    sleep(Duration::from_secs(700)).await;
    common::trigger(&store, "ops").await;
    sleep(Duration::from_secs(600)).await;
    a.crash();
    // 600 and 1200, each retried once, and a trigger, retried once.
    assert_eq!(starts.lock().expect("starts").len(), 6, "{starts:?}");
    let recorded = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(key, ..)| key.key().name() == "leader_cron_firing_lateness_seconds")
        .map(|(.., value)| value);
    let Some(metrics_util::debugging::DebugValue::Histogram(values)) = recorded else {
        panic!("no lateness recorded: {recorded:?}");
    };
    assert_eq!(
        values.len(),
        2,
        "the two scheduled first attempts: {values:?}"
    );
}

/// Bad limits are refused when the job is built.
#[test]
fn bad_limits_are_refused() {
    let every = Schedule::every(Duration::from_secs(60)).expect("schedule");
    for configure in [
        (|b: leader_cron::CronJobBuilder| b.retries(101)) as fn(_) -> _,
        |b| b.timeout(Duration::ZERO),
        |b| b.retry_backoff(Duration::ZERO),
        // A threshold or deadline of zero would miss every firing (none starts at its
        // very instant).
        |b| b.misfire_threshold(Duration::ZERO),
        |b| b.starting_deadline(Duration::ZERO),
    ] {
        let built = configure(CronJob::builder("report", every.clone()))
            .build(|_: Firing, _| async { Ok(()) });
        assert!(matches!(built, Err(leader_cron::CronError::BadPolicy(_))));
    }
}
