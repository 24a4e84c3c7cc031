//! What operators do to a running schedule, through the record, on tokio's paused clock with
//! electors on the in-memory lock: suspend and resume it, run it now (beside a suspension, behind
//! a running firing), cancel a running firing or a pending retry, and the errors of a request
//! that has nothing to act on.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::MemoryStore;
use leader_cron::{
    ControlError, CronEvent, CronJob, Firing, Outcome, Overlap, Schedule, TokioClock,
};
use tokio::time::sleep;

use common::{
    Log, Replica, cancel, every_minute_and_every_two, every_seconds, operator, origin, resume,
    scheduled, stored, suspend, trigger, world,
};

/// A replica alone on a schedule of every 10 s whose firings work for `works`.
fn leader(
    store: &MemoryStore,
    works: Duration,
    configure: impl FnOnce(leader_cron::CronJobBuilder) -> leader_cron::CronJobBuilder,
) -> (Log, Replica) {
    let (log, clock) = (Log::default(), TokioClock::starting_at(origin()));
    let every = every_seconds(10);
    let replica = common::replica(store, &clock, "a", &every, &log, works, configure);
    (log, replica)
}

fn seconds(instants: impl IntoIterator<Item = DateTime<Utc>>) -> Vec<i64> {
    instants
        .into_iter()
        .map(|at| (at - origin()).num_seconds())
        .collect()
}

/// The firings started, with who asked for the ones outside the schedule.
fn started(events: &mut tokio::sync::broadcast::Receiver<CronEvent>) -> Vec<(i64, Option<String>)> {
    std::iter::from_fn(|| events.try_recv().ok())
        .filter_map(|event| match event {
            CronEvent::Started(firing) => Some((
                (firing.scheduled - origin()).num_seconds(),
                firing.triggered_by,
            )),
            _ => None,
        })
        .collect()
}

/// Suspended at 0:25 and resumed at 0:55: the firings of 30, 40 and 50 are not started and
/// count as missed; 60 and 70 run.
#[tokio::test(start_paused = true)]
async fn a_suspended_schedule_starts_nothing_until_resumed() {
    let store = MemoryStore::new();
    let (log, mut a) = leader(&store, Duration::from_secs(1), |b| b);
    sleep(Duration::from_secs(25)).await;
    let control = suspend(&store, "ops").await;
    assert_eq!(
        control.suspended.as_ref().map(|s| s.by.as_str()),
        Some("ops")
    );
    // Suspending again changes nothing.
    let again = suspend(&store, "someone else").await;
    assert_eq!(again, control);
    sleep(Duration::from_secs(30)).await;
    resume(&store).await;
    sleep(Duration::from_secs(20)).await;
    assert!(a.leading());
    assert_eq!(seconds(scheduled(&log)), vec![10, 20, 60, 70]);
    let state = stored(&store).await;
    assert_eq!(state.missed, 3, "{state:?}");
    a.crash();
}

/// Under `Forbid` with every missed firing run, firings that work 25 s on a schedule of 10 s
/// fall behind: at 0:58 the firing of 20 runs and those of 30, 40 and 50 wait their turn. A
/// suspension then counts missed what has not started, the backlog too, and starts nothing
/// more: after the resume at 1:25 the schedule goes on from its next instant (90), and each
/// instant from 10 to 90 ran once or is counted missed.
#[tokio::test(start_paused = true)]
async fn a_suspension_counts_the_backlog_missed_and_runs_none_of_it() {
    let store = MemoryStore::new();
    let (log, mut a) = leader(&store, Duration::from_secs(25), |b| {
        b.overlap(Overlap::Forbid)
            .missed(leader_cron::Missed::All { max: 100 })
    });
    sleep(Duration::from_secs(58)).await;
    let before: Vec<i64> = seconds(scheduled(&log));
    let waiting = stored(&store).await.handled_until();
    assert!(
        (waiting - origin()).num_seconds() < 50,
        "a backlog waits behind the running firing: {before:?}"
    );
    suspend(&store, "ops").await;
    sleep(Duration::from_secs(27)).await;
    resume(&store).await;
    sleep(Duration::from_secs(10)).await;
    let runs = seconds(scheduled(&log));
    let state = stored(&store).await;
    assert_eq!(
        runs[before.len()..],
        [90],
        "none of the backlog ran, and the schedule went on after the resume: {runs:?}"
    );
    // Each instant from 10 to 90 ran once or counts as missed.
    assert_eq!(runs.len() as u64 + state.missed, 9, "{runs:?}: {state:?}");
    a.crash();
}

/// A firing asked for now runs once, with who asked; a second request runs once more; a
/// request beside a suspension still runs.
#[tokio::test(start_paused = true)]
async fn a_trigger_runs_once_even_while_suspended() {
    let store = MemoryStore::new();
    let (_, mut a) = leader(&store, Duration::from_secs(1), |b| b);
    sleep(Duration::from_secs(12)).await;
    suspend(&store, "ops").await;
    sleep(Duration::from_secs(3)).await;
    let asked = trigger(&store, "alice").await;
    sleep(Duration::from_secs(20)).await;
    trigger(&store, "bob").await;
    sleep(Duration::from_secs(5)).await;
    let seen = started(&mut a.events);
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(seen[0], (10, None));
    assert_eq!(seen[1].1.as_deref(), Some("alice"));
    assert_eq!(seen[2].1.as_deref(), Some("bob"));
    let state = stored(&store).await;
    assert!(state.last_trigger > Some(asked.at), "{state:?}");
    assert!(
        state
            .history
            .iter()
            .any(|e| e.triggered_by.as_deref() == Some("alice") && e.scheduled == asked.at),
        "{state:?}"
    );
    a.crash();
}

/// Under `Forbid` a firing asked for while one runs waits for it, then runs.
#[tokio::test(start_paused = true)]
async fn a_trigger_waits_behind_a_running_firing_under_forbid() {
    let store = MemoryStore::new();
    let (_, mut a) = leader(&store, Duration::from_secs(8), |b| {
        b.overlap(Overlap::Forbid)
    });
    sleep(Duration::from_secs(12)).await;
    trigger(&store, "alice").await;
    sleep(Duration::from_secs(3)).await;
    assert_eq!(started(&mut a.events), vec![(10, None)], "it waits");
    sleep(Duration::from_secs(4)).await;
    let seen = started(&mut a.events);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].1.as_deref(), Some("alice"));
    a.crash();
}

/// The attempts started: (scheduled second, attempt).
type Starts = std::sync::Arc<std::sync::Mutex<Vec<(i64, u32)>>>;

/// The attempts started, and a replica every 10 s whose first attempts work for `works` and
/// fail, and whose later attempts succeed at once; its work heeds its cancellation, or ignores
/// it.
fn failing(
    store: &MemoryStore,
    works: Duration,
    heeds: bool,
    configure: impl FnOnce(leader_cron::CronJobBuilder) -> leader_cron::CronJobBuilder,
) -> (Starts, Replica) {
    let starts = Starts::default();
    let clock = TokioClock::starting_at(origin());
    let every = every_seconds(10);
    let seen = starts.clone();
    let job = configure(CronJob::builder("report", every).clock(clock))
        .build(
            move |firing: Firing, cancel: leader_core::CancellationToken| {
                let seen = seen.clone();
                async move {
                    let scheduled = (firing.scheduled - origin()).num_seconds();
                    seen.lock()
                        .expect("starts")
                        .push((scheduled, firing.attempt));
                    if firing.attempt > 1 {
                        return Ok(());
                    }
                    if heeds {
                        tokio::select! {
                            () = sleep(works) => {}
                            () = cancel.cancelled() => return Err("cancelled".into()),
                        }
                    } else {
                        sleep(works).await;
                    }
                    Err("failed".into())
                }
            },
        )
        .expect("a job");
    (starts, Replica::start(store, "a", job))
}

/// The firings that ended, as the events tell: (scheduled second, attempt, outcome).
fn ended(events: &mut tokio::sync::broadcast::Receiver<CronEvent>) -> Vec<(i64, u32, Outcome)> {
    std::iter::from_fn(|| events.try_recv().ok())
        .filter_map(|event| match event {
            CronEvent::Ended {
                scheduled,
                attempt,
                outcome,
            } => Some(((scheduled - origin()).num_seconds(), attempt, outcome)),
            _ => None,
        })
        .collect()
}

/// A running firing cancelled by an operator is stopped through its cancellation within the
/// request's way to the leader (a renewal and a look), recorded as cancelled with who asked,
/// and not retried although it ended with an error and retries are on; the schedule goes on.
#[tokio::test(start_paused = true)]
async fn a_cancelled_firing_stops_and_is_not_retried() {
    let store = MemoryStore::new();
    let (starts, mut a) = failing(&store, Duration::from_secs(8), true, |b| {
        b.retries(2).retry_backoff(Duration::from_secs(1))
    });
    sleep(Duration::from_secs(11)).await;
    let asked = cancel(&store, None).await;
    assert_eq!(seconds(asked.firings.clone()), vec![10]);
    sleep(Duration::from_secs(20)).await;
    let ends = ended(&mut a.events);
    assert_eq!(
        ends[0],
        (10, 1, Outcome::Cancelled { by: "ops".into() }),
        "{ends:?}"
    );
    // The next firing ran, failed, and was retried as usual.
    assert_eq!(ends[1].0, 20, "{ends:?}");
    assert!(matches!(ends[1].2, Outcome::Failed { .. }), "{ends:?}");
    let runs = starts.lock().expect("starts").clone();
    assert!(
        !runs.contains(&(10, 2)),
        "the cancelled firing was retried: {runs:?}"
    );
    assert!(runs.contains(&(20, 2)), "{runs:?}");
    let state = stored(&store).await;
    assert_eq!(state.last_cancel, Some(asked.at), "{state:?}");
    let cancelled = state
        .history
        .iter()
        .find(|e| e.outcome == Outcome::Cancelled { by: "ops".into() })
        .expect("the cancel is in the history");
    assert_eq!(
        cancelled.scheduled,
        origin() + chrono::Duration::seconds(10)
    );
    // Asked at 11 s, and the work would have ended at 18 s.
    let at = (cancelled.ended_at - origin()).num_seconds();
    assert!(at <= 14, "recorded at {at} s");
    a.crash();
}

/// Work that ignores its cancellation gets the timeout's grace, then is dropped and its slot
/// freed: under `Forbid` the next firing starts then, not when the work would have ended.
#[tokio::test(start_paused = true)]
async fn a_cancelled_firing_that_goes_on_is_dropped_after_the_grace() {
    let store = MemoryStore::new();
    let (starts, mut a) = failing(&store, Duration::from_secs(60), false, |b| {
        b.timeout_grace(Duration::from_secs(3))
            .overlap(Overlap::Forbid)
    });
    sleep(Duration::from_secs(11)).await;
    cancel(&store, Some(origin() + chrono::Duration::seconds(10))).await;
    sleep(Duration::from_secs(10)).await;
    let ends = ended(&mut a.events);
    assert_eq!(
        ends,
        vec![(10, 1, Outcome::Cancelled { by: "ops".into() })],
        "{ends:?}"
    );
    // The cancel reached the leader within 3 s, and the grace is 3 s: the slot is free by
    // 17 s, and the firing of 20 s is on time.
    let runs = starts.lock().expect("starts").clone();
    assert_eq!(runs, vec![(10, 1), (20, 1)], "{runs:?}");
    let state = stored(&store).await;
    assert_eq!(
        state.running.len(),
        1,
        "only the firing of 20 s runs: {state:?}"
    );
    assert_eq!(state.missed, 0, "{state:?}");
    a.crash();
}

/// A failed firing waiting for its retry is dropped by a cancel, recorded as cancelled (the
/// attempt that would have run), and its retry never starts.
#[tokio::test(start_paused = true)]
async fn a_cancelled_retry_is_dropped() {
    let store = MemoryStore::new();
    let (starts, mut a) = failing(&store, Duration::from_secs(1), true, |b| {
        b.retries(2).retry_backoff(Duration::from_secs(30))
    });
    sleep(Duration::from_secs(13)).await;
    let state = stored(&store).await;
    assert_eq!(state.retrying.len(), 1, "{state:?}");
    cancel(&store, Some(state.retrying[0].scheduled)).await;
    sleep(Duration::from_secs(40)).await;
    let runs = starts.lock().expect("starts").clone();
    assert!(
        !runs.contains(&(10, 2)),
        "the cancelled retry ran: {runs:?}"
    );
    let ends = ended(&mut a.events);
    assert!(
        ends.iter()
            .any(|(at, attempt, outcome)| (*at, *attempt) == (10, 2)
                && *outcome == Outcome::Cancelled { by: "ops".into() }),
        "{ends:?}"
    );
    let state = stored(&store).await;
    assert!(
        state
            .retrying
            .iter()
            .all(|r| r.scheduled != origin() + chrono::Duration::seconds(10)),
        "{state:?}"
    );
    a.crash();
}

/// A cancel of a firing whose leader died while it ran, asked while nobody leads: the next
/// leader, which would run it again (attempt 2), drops it instead, recorded as cancelled.
#[tokio::test(start_paused = true)]
async fn a_cancel_reaches_a_firing_whose_leader_died() {
    let (store, clock, log) = world();
    let every = Schedule::every(Duration::from_secs(60)).expect("schedule");
    let works = Duration::from_secs(30);
    let mut a = common::replica(&store, &clock, "a", &every, &log, works, |b| b);
    sleep(Duration::from_secs(65)).await;
    a.crash();
    let asked = cancel(&store, None).await;
    assert_eq!(seconds(asked.firings.clone()), vec![60]);
    let mut b = common::replica(&store, &clock, "b", &every, &log, works, |b| b);
    sleep(Duration::from_secs(40)).await;
    assert!(b.leading());
    assert_eq!(
        common::instants(&log),
        vec![(origin() + chrono::Duration::seconds(60), 1)],
        "the cancelled firing ran again"
    );
    let state = stored(&store).await;
    let last = state.last.clone().expect("an outcome");
    assert_eq!(
        (last.attempt, last.outcome),
        (2, Outcome::Cancelled { by: "ops".into() }),
        "{state:?}"
    );
    assert!(
        state.running.is_empty() && state.retrying.is_empty(),
        "{state:?}"
    );
    b.crash();
}

/// A cancel with nothing to cancel, or naming a firing that is not running or waiting, says
/// so and writes nothing.
#[tokio::test(start_paused = true)]
async fn a_cancel_with_nothing_to_cancel_says_why() {
    let store = MemoryStore::new();
    let (_, mut a) = leader(&store, Duration::from_secs(1), |b| b);
    sleep(Duration::from_secs(15)).await;
    let err = leader_cron::cancel(&operator(&store), "report", "ops", None)
        .await
        .expect_err("nothing runs");
    assert!(
        matches!(err, ControlError::NothingToCancel { firing: None, .. }),
        "{err}"
    );
    // The firing of 10 s ended at 11 s.
    let named = origin() + chrono::Duration::seconds(10);
    let err = leader_cron::cancel(&operator(&store), "report", "ops", Some(named))
        .await
        .expect_err("no such firing");
    assert!(err.to_string().contains("scheduled at"), "{err}");
    assert!(stored(&store).await.last_cancel.is_none());
    a.crash();
}

/// Under `Forbid`, firings that each outlast the period keep coming due; a trigger asked
/// meanwhile takes the single slot in its turn (it was asked at 12 s, before the firing of
/// 20 s was due) instead of waiting for ever behind them.
#[tokio::test(start_paused = true)]
async fn a_trigger_takes_its_turn_among_firings_that_keep_coming_due() {
    let store = MemoryStore::new();
    let (_, mut a) = leader(&store, Duration::from_secs(15), |b| {
        b.overlap(Overlap::Forbid)
    });
    sleep(Duration::from_secs(12)).await;
    trigger(&store, "alice").await;
    sleep(Duration::from_secs(60)).await;
    let seen = started(&mut a.events);
    assert!(seen.len() >= 3, "{seen:?}");
    assert_eq!(seen[0], (10, None), "{seen:?}");
    // The firing of 10 s ends at 25 s: the trigger, due since 12 s, runs next.
    assert_eq!(seen[1].1.as_deref(), Some("alice"), "{seen:?}");
    // Then the schedule goes on: the firing due when the trigger ended runs.
    assert_eq!(seen[2].1, None, "{seen:?}");
    a.crash();
}

/// A request with nothing to act on says why.
#[tokio::test(start_paused = true)]
async fn requests_without_a_schedule_say_why() {
    let store = MemoryStore::new();
    let err = leader_cron::trigger(&operator(&store), "report", "ops")
        .await
        .expect_err("no election");
    assert!(matches!(err, ControlError::NoElection { .. }), "{err}");
    let (_, mut a) = leader(&store, Duration::from_secs(1), |b| b);
    sleep(Duration::from_secs(12)).await;
    let err = leader_cron::suspend(&operator(&store), "nightly", "ops")
        .await
        .expect_err("no such schedule");
    assert!(
        matches!(&err, ControlError::NoSchedule { found, .. } if found == "report"),
        "{err}"
    );
    a.crash();
}

/// A rollout from every minute to every two minutes: the new replica adopts its schedule when
/// it leads (recorded with who and when), the cursor is kept so that nothing is lost or doubled
/// across the switch, and an old replica started before the change follows the stored schedule
/// when it leads later instead of being refused. A replica of a third schedule started after
/// the change, without adopting, is refused as before.
#[tokio::test(start_paused = true)]
async fn a_schedule_changes_in_place() {
    let (store, clock, log) = world();
    let works = Duration::from_secs(5);
    let (minute, two) = every_minute_and_every_two();
    let mut old = common::replica(&store, &clock, "old", &minute, &log, works, |b| b);
    sleep(Duration::from_secs(150)).await;
    // The rollout: one new replica, and the old configuration still running elsewhere.
    let mut new = common::replica(&store, &clock, "new", &two, &log, works, |b| {
        b.adopt_schedule(true)
    });
    let mut older = common::replica(&store, &clock, "older", &minute, &log, works, |b| b);
    sleep(Duration::from_secs(5)).await;
    old.crash();
    // older or new takes over near 2:50; make it new by crashing older if it leads.
    sleep(Duration::from_secs(25)).await;
    if older.leading() {
        older.crash();
        sleep(Duration::from_secs(20)).await;
        older = common::replica(&store, &clock, "older", &minute, &log, works, |b| b);
    }
    assert!(new.leading());
    sleep(Duration::from_secs(100)).await;
    let state = stored(&store).await;
    let changed = state.changed.clone().expect("the change is recorded");
    assert_eq!(
        (changed.from.as_str(), changed.by.as_str()),
        ("every 1m", "new")
    );
    assert_eq!(state.schedule, "every 2m");
    // The new leader dies; the old configuration's replica follows the stored schedule.
    new.crash();
    sleep(Duration::from_secs(215)).await;
    assert!(
        older.leading(),
        "{:?}",
        older.errors.lock().expect("errors")
    );
    assert!(older.errors.lock().expect("errors").is_empty());
    let runs: Vec<(i64, String)> = log
        .lock()
        .expect("log")
        .iter()
        .map(|(at, _, id)| ((*at - origin()).num_seconds(), id.clone()))
        .collect();
    let at: Vec<i64> = runs.iter().map(|r| r.0).collect();
    assert_eq!(at, vec![60, 120, 240, 360, 480], "{runs:?}");
    assert_eq!(runs[2].1, "new");
    assert_eq!(runs[4].1, "older");
    // A replica of a third schedule, started after the change, without adopting.
    older.crash();
    let hourly = every_seconds(3600);
    let third = common::replica(&store, &clock, "third", &hourly, &log, works, |b| b);
    sleep(Duration::from_secs(30)).await;
    let errors = third.errors.lock().expect("errors").clone();
    assert!(
        errors.iter().any(|e| e.contains("every 2m")),
        "refused: {errors:?}"
    );
}
