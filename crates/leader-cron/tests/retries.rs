//! Retries beside the overlap policies, on tokio's paused clock with electors on the
//! in-memory lock: a due retry takes forbid's single slot in its turn and waits for it
//! without polling; under replace a retry replaces nothing and no pending retry is dropped;
//! the retries waiting and the messages kept are bounded.
//!
//! A loop that polls without waiting never lets the paused clock move on, so each scenario
//! runs on a thread of its own and must end within a minute of real time.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::MemoryStore;
use leader_cron::{
    Clock, CronJob, Firing, MAX_MESSAGE, MAX_RETRYING, Outcome, Overlap, TokioClock,
};
use tokio::time::sleep;

use common::{Replica, every_seconds, origin, resume, stored, suspend};

/// The attempts started: (seconds after the origin when it started, scheduled second, attempt).
type Starts = Arc<Mutex<Vec<(i64, i64, u32)>>>;

/// How firing (scheduled second, attempt) works: for how long, and whether it succeeds.
type Behaviour = fn(i64, u32) -> (Duration, bool);

/// A new store, a replica on it every `period` seconds whose work behaves as `behaves` says,
/// and ignores its cancellation (as library work may), and the attempts it starts.
fn replica(
    period: u64,
    behaves: Behaviour,
    configure: impl FnOnce(leader_cron::CronJobBuilder) -> leader_cron::CronJobBuilder,
) -> (MemoryStore, Replica, Starts) {
    let (store, started) = (MemoryStore::new(), Starts::default());
    let clock = TokioClock::starting_at(origin());
    let every = every_seconds(period);
    let (starts, now) = (started.clone(), clock.clone());
    let job = configure(CronJob::builder("report", every).clock(clock))
        .build(move |firing: Firing, _cancel| {
            let starts = starts.clone();
            let at = (now.now() - origin()).num_seconds();
            let scheduled = (firing.scheduled - origin()).num_seconds();
            async move {
                starts
                    .lock()
                    .expect("starts")
                    .push((at, scheduled, firing.attempt));
                let (works, succeeds) = behaves(scheduled, firing.attempt);
                sleep(works).await;
                if succeeds {
                    Ok(())
                } else {
                    Err(format!("attempt {} of {scheduled} failed", firing.attempt).into())
                }
            }
        })
        .expect("a job");
    let replica = Replica::start(&store, "a", job);
    (store, replica, started)
}

/// Runs `scenario` on a paused clock on a thread of its own; fails when it has not ended
/// within a minute of real time (a loop that never waits holds the paused clock still).
fn within_a_minute<T: Send + 'static>(
    scenario: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        let _ = done.send(runtime.block_on(scenario));
    });
    ended
        .recv_timeout(Duration::from_secs(60))
        .expect("the scenario ends: the schedule loop waits instead of polling")
}

fn outcomes(history: &[leader_cron::Ended]) -> Vec<(i64, u32, &'static str)> {
    history
        .iter()
        .map(|e| {
            (
                (e.scheduled - origin()).num_seconds(),
                e.attempt,
                e.outcome.name(),
            )
        })
        .collect()
}

/// Forbid, every 10 s: the firing of 10 fails at once and is due again at 21, while the
/// firing of 20 runs until 35. The retry waits for the slot (without polling), then takes it
/// before the firing of 30, which was due after it.
#[test]
fn a_due_retry_waits_for_forbids_slot_in_its_turn() {
    let starts = within_a_minute(async {
        let behaves: Behaviour = |scheduled, attempt| match (scheduled, attempt) {
            (10, 1) => (Duration::from_secs(1), false),
            (_, 2) => (Duration::from_secs(1), true),
            _ => (Duration::from_secs(15), true),
        };
        let (_store, mut a, starts) = replica(10, behaves, |b| {
            b.overlap(Overlap::Forbid)
                .retries(1)
                .retry_backoff(Duration::from_secs(10))
        });
        sleep(Duration::from_secs(45)).await;
        a.crash();
        starts.lock().expect("starts").clone()
    });
    assert_eq!(
        starts,
        [(10, 10, 1), (20, 20, 1), (35, 10, 2), (36, 30, 1)],
        "(started, scheduled, attempt)"
    );
}

/// Replace, every 60 s, with work that ignores its cancellation: the firings of 60 and 120
/// fail at once (retried after 75 s: at 136 and 196); the firing of 180 runs 30 s. Its start
/// drops no retry waiting, and the retry due at 196 replaces nothing: it waits for the
/// firing of 180 to end (without polling), then runs.
#[test]
fn under_replace_a_retry_replaces_nothing_and_none_is_dropped() {
    let (starts, history) = within_a_minute(async {
        let behaves: Behaviour = |scheduled, attempt| match (scheduled, attempt) {
            (60 | 120, 1) => (Duration::from_secs(1), false),
            (_, 2) => (Duration::from_secs(1), true),
            _ => (Duration::from_secs(30), true),
        };
        let (store, mut a, starts) = replica(60, behaves, |b| {
            b.overlap(Overlap::Replace)
                .retries(1)
                .retry_backoff(Duration::from_secs(75))
        });
        sleep(Duration::from_secs(230)).await;
        let history = stored(&store).await.history;
        a.crash();
        let starts = starts.lock().expect("starts").clone();
        (starts, history)
    });
    assert_eq!(
        starts,
        [
            (60, 60, 1),
            (120, 120, 1),
            (136, 60, 2),
            (180, 180, 1),
            (210, 120, 2)
        ],
        "(started, scheduled, attempt)"
    );
    let ended = outcomes(&history);
    assert!(
        !ended.iter().any(|e| e.2 == "replaced"),
        "nothing replaced: {ended:?}"
    );
    assert!(ended.contains(&(180, 1, "succeeded")), "{ended:?}");
    assert!(ended.contains(&(120, 2, "succeeded")), "{ended:?}");
}

/// A job that always fails, every 10 s, with 100 retries an hour apart: the record keeps at
/// most `MAX_RETRYING` retries waiting (the oldest are given up, saying why), and a long
/// error message is cut to `MAX_MESSAGE` bytes.
#[tokio::test(start_paused = true)]
async fn the_retries_waiting_and_the_messages_kept_are_bounded() {
    let store = MemoryStore::new();
    let clock = TokioClock::starting_at(origin());
    let job = CronJob::builder("report", every_seconds(10))
        .clock(clock)
        .retries(100)
        .retry_backoff(Duration::from_secs(3600))
        .build(|_firing: Firing, _cancel| async move { Err("x".repeat(10_000).into()) })
        .expect("a job");
    let mut a = Replica::start(&store, "a", job);
    sleep(Duration::from_secs(10 * (MAX_RETRYING as u64 + 8) + 5)).await;
    let state = stored(&store).await;
    a.crash();
    assert_eq!(state.retrying.len(), MAX_RETRYING);
    let gave_up: Vec<&leader_cron::Ended> = state
        .history
        .iter()
        .filter(|e| matches!(e.outcome, Outcome::GaveUp { .. }))
        .collect();
    assert!(!gave_up.is_empty(), "{:?}", state.history);
    let Outcome::GaveUp { reason } = &gave_up[0].outcome else {
        unreachable!()
    };
    assert!(reason.contains(&MAX_RETRYING.to_string()), "{reason}");
    // The oldest were given up: the ones waiting are the latest.
    let oldest_waiting = state.retrying.iter().map(|r| r.scheduled).min();
    assert!(oldest_waiting > Some(gave_up[0].scheduled), "{state:?}");
    for ended in &state.history {
        if let Outcome::Failed { message } = &ended.outcome {
            assert!(message.len() <= MAX_MESSAGE, "{}", message.len());
        }
    }
    assert!(
        state.to_json().len() < 64 * 1024,
        "{}",
        state.to_json().len()
    );
}

/// Forbid, every 60 s, with a timeout of 5 s and a grace of 2 s: the firing of 60 works for
/// an hour and ignores its cancellation. It is dropped at 67, recorded as timed out, and the
/// firing of 120 runs on time instead of waiting behind it.
#[test]
fn work_that_ignores_its_timeout_frees_the_slot() {
    let (starts, history) = within_a_minute(async {
        let behaves: Behaviour = |scheduled, _| match scheduled {
            60 => (Duration::from_secs(3600), true),
            _ => (Duration::from_secs(1), true),
        };
        let (store, mut a, starts) = replica(60, behaves, |b| {
            b.timeout(Duration::from_secs(5))
                .timeout_grace(Duration::from_secs(2))
        });
        sleep(Duration::from_secs(130)).await;
        let history = stored(&store).await.history;
        a.crash();
        (starts.lock().expect("starts").clone(), history)
    });
    assert_eq!(starts, [(60, 60, 1), (120, 120, 1)]);
    let ended = outcomes(&history);
    assert_eq!(ended, [(60, 1, "timed out"), (120, 1, "succeeded")]);
}

/// A retry waiting while the schedule is suspended does not start until it is resumed: the
/// firing of 60 fails, its retry is due at 71, the schedule is suspended from 65 to 100.
#[test]
fn a_suspended_schedule_starts_no_retry() {
    let starts = within_a_minute(async {
        let behaves: Behaviour = |scheduled, attempt| match (scheduled, attempt) {
            (60, 1) => (Duration::from_secs(1), false),
            _ => (Duration::from_secs(1), true),
        };
        let (store, mut a, starts) = replica(60, behaves, |b| {
            b.retries(1).retry_backoff(Duration::from_secs(10))
        });
        sleep(Duration::from_secs(65)).await;
        suspend(&store, "ops").await;
        sleep(Duration::from_secs(35)).await;
        resume(&store).await;
        sleep(Duration::from_secs(15)).await;
        a.crash();
        starts.lock().expect("starts").clone()
    });
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert_eq!((starts[1].1, starts[1].2), (60, 2), "{starts:?}");
    assert!(
        (100..=106).contains(&starts[1].0),
        "the retry waits for the resume: {starts:?}"
    );
}
