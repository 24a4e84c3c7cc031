//! What operators do to a running schedule, through the record, on tokio's paused clock with
//! electors on the in-memory lock: suspend and resume it, run it now (beside a suspension, behind
//! a running firing), and the errors of a request that has nothing to act on.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::{MemoryStore, ResourceLock};
use leader_cron::{ControlError, CronEvent, CronJob, Overlap, Schedule, TokioClock};
use tokio::time::sleep;

use common::{Log, Replica, origin, stored};

/// A replica alone on a schedule of every 10 s whose firings work for `works`, and a subscriber.
fn leader(
    store: &MemoryStore,
    works: Duration,
    configure: impl FnOnce(leader_cron::CronJobBuilder) -> leader_cron::CronJobBuilder,
) -> (Log, Replica, tokio::sync::broadcast::Receiver<CronEvent>) {
    let log = Log::default();
    let clock = TokioClock::starting_at(origin());
    let every = Schedule::every(Duration::from_secs(10)).expect("schedule");
    let builder = configure(CronJob::builder("report", every).clock(clock));
    let dead = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let job = common::work(builder, "a", &log, works, &dead);
    let events = job.subscribe();
    let mut replica = Replica::start(store, "a", job);
    replica.dead = dead;
    (log, replica, events)
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

fn operator(store: &MemoryStore) -> impl ResourceLock {
    store.lock("election", "ops")
}

/// Suspended at 0:25 and resumed at 0:55: the firings of 30, 40 and 50 are not started and
/// count as missed; 60 and 70 run.
#[tokio::test(start_paused = true)]
async fn a_suspended_schedule_starts_nothing_until_resumed() {
    let store = MemoryStore::new();
    let (log, mut a, _) = leader(&store, Duration::from_secs(1), |b| b);
    sleep(Duration::from_secs(25)).await;
    let control = leader_cron::suspend(&operator(&store), "report", "ops")
        .await
        .expect("suspend");
    assert_eq!(
        control.suspended.as_ref().map(|s| s.by.as_str()),
        Some("ops")
    );
    // Suspending again changes nothing.
    let again = leader_cron::suspend(&operator(&store), "report", "someone else")
        .await
        .expect("suspend");
    assert_eq!(again, control);
    sleep(Duration::from_secs(30)).await;
    leader_cron::resume(&operator(&store), "report")
        .await
        .expect("resume");
    sleep(Duration::from_secs(20)).await;
    assert!(a.leading());
    let runs = common::instants(&log).into_iter().map(|(at, _)| at);
    assert_eq!(seconds(runs), vec![10, 20, 60, 70]);
    let state = stored(&store).await;
    assert_eq!(state.missed, 3, "{state:?}");
    a.crash();
}

/// A firing asked for now runs once, with who asked; a second request runs once more; a
/// request beside a suspension still runs.
#[tokio::test(start_paused = true)]
async fn a_trigger_runs_once_even_while_suspended() {
    let store = MemoryStore::new();
    let (_, mut a, mut events) = leader(&store, Duration::from_secs(1), |b| b);
    sleep(Duration::from_secs(12)).await;
    leader_cron::suspend(&operator(&store), "report", "ops")
        .await
        .expect("suspend");
    sleep(Duration::from_secs(3)).await;
    let asked = leader_cron::trigger(&operator(&store), "report", "alice")
        .await
        .expect("trigger")
        .trigger
        .expect("a trigger");
    sleep(Duration::from_secs(20)).await;
    leader_cron::trigger(&operator(&store), "report", "bob")
        .await
        .expect("trigger");
    sleep(Duration::from_secs(5)).await;
    let seen = started(&mut events);
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
    let (_, mut a, mut events) = leader(&store, Duration::from_secs(8), |b| {
        b.overlap(Overlap::Forbid)
    });
    sleep(Duration::from_secs(12)).await;
    leader_cron::trigger(&operator(&store), "report", "alice")
        .await
        .expect("trigger");
    sleep(Duration::from_secs(3)).await;
    assert_eq!(started(&mut events), vec![(10, None)], "it waits");
    sleep(Duration::from_secs(4)).await;
    let seen = started(&mut events);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].1.as_deref(), Some("alice"));
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
    let (_, mut a, _) = leader(&store, Duration::from_secs(1), |b| b);
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
    let store = MemoryStore::new();
    let clock = TokioClock::starting_at(origin());
    let log = Log::default();
    let works = Duration::from_secs(5);
    let minute = Schedule::every(Duration::from_secs(60)).expect("schedule");
    let two = Schedule::every(Duration::from_secs(120)).expect("schedule");
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
    let hourly = Schedule::every(Duration::from_secs(3600)).expect("schedule");
    let third = common::replica(&store, &clock, "third", &hourly, &log, works, |b| b);
    sleep(Duration::from_secs(30)).await;
    let errors = third.errors.lock().expect("errors").clone();
    assert!(
        errors.iter().any(|e| e.contains("every 2m")),
        "refused: {errors:?}"
    );
}
