//! Changing a schedule in place, on tokio's paused clock with electors on the in-memory lock:
//! the new schedule's first firing is its first instant after the change (never one between
//! the last firing and the change), and the change is a versioned decision: the newer
//! configuration wins, an older one follows it and never writes its own back.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_cron::{Clock, Schedule, TokioClock};
use tokio::time::sleep;

use common::{Log, every_minute_and_every_two, origin, replica, stored, world};

fn at(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text)
        .expect("time")
        .with_timezone(&Utc)
}

/// Sleeps until `clock` reads `until`.
async fn sleep_until(clock: &TokioClock, until: DateTime<Utc>) {
    sleep((until - clock.now()).to_std().expect("later")).await;
}

fn runs(log: &Log) -> Vec<(DateTime<Utc>, String)> {
    log.lock()
        .expect("log")
        .iter()
        .map(|(at, _, id)| (*at, id.clone()))
        .collect()
}

/// A nightly job at 03:00 changed to 04:00 at 10:00: nothing runs before 04:00 the next day
/// (the 04:00 of the day of the change, between the last firing and the change, is not
/// run), then 04:00 runs each night.
#[tokio::test(start_paused = true)]
async fn a_changed_schedule_first_fires_after_the_change() {
    let (store, clock, log) = world();
    let works = Duration::from_secs(5);
    let three = Schedule::cron("0 3 * * *", "UTC").expect("schedule");
    let four = Schedule::cron("0 4 * * *", "UTC").expect("schedule");
    let mut old = replica(&store, &clock, "old", &three, &log, works, |b| b);
    sleep_until(&clock, at("2026-01-10T10:00:00Z")).await;
    old.crash();
    let mut new = replica(&store, &clock, "new", &four, &log, works, |b| {
        b.adopt_schedule(true)
    });
    sleep_until(&clock, at("2026-01-11T03:59:00Z")).await;
    assert!(new.leading());
    assert_eq!(
        runs(&log),
        [(at("2026-01-10T03:00:00Z"), "old".to_owned())],
        "nothing before tomorrow 04:00"
    );
    let state = stored(&store).await;
    let changed = state.changed.clone().expect("the change is recorded");
    assert!(
        changed.at >= at("2026-01-10T10:00:00Z") && changed.at < at("2026-01-10T10:01:00Z"),
        "{changed:?}"
    );
    assert_eq!(state.schedule, "cron 0 4 * * * in UTC");
    assert_eq!(
        state.missed, 0,
        "no instant of the old schedule was left: {state:?}"
    );
    sleep_until(&clock, at("2026-01-12T04:00:30Z")).await;
    assert_eq!(
        runs(&log),
        [
            (at("2026-01-10T03:00:00Z"), "old".to_owned()),
            (at("2026-01-11T04:00:00Z"), "new".to_owned()),
            (at("2026-01-12T04:00:00Z"), "new".to_owned()),
        ]
    );
    new.crash();
}

/// Revisions decide: revision 2 changes the schedule of revision 1 without any flag; a
/// replica of revision 1 restarted after the change (a crash, a rollback), with
/// `adopt_schedule` on, follows the stored schedule when it leads and never writes its own
/// back; a replica of the same revision with a third schedule is refused in one line that
/// names the flags.
#[tokio::test(start_paused = true)]
async fn the_newer_revision_wins_whichever_replica_leads() {
    let (store, clock, log) = world();
    let works = Duration::from_secs(5);
    let (minute, two) = every_minute_and_every_two();
    let old_config = |b: leader_cron::CronJobBuilder| b.schedule_revision(1).adopt_schedule(true);
    let mut v1 = replica(&store, &clock, "v1", &minute, &log, works, old_config);
    sleep(Duration::from_secs(150)).await;
    assert_eq!(stored(&store).await.revision_number(), 1);
    let mut v2 = replica(&store, &clock, "v2", &two, &log, works, |b| {
        b.schedule_revision(2)
    });
    sleep(Duration::from_secs(5)).await;
    v1.crash();
    sleep(Duration::from_secs(40)).await;
    assert!(v2.leading());
    let state = stored(&store).await;
    assert_eq!(
        (state.schedule.as_str(), state.revision_number()),
        ("every 2m", 2)
    );
    // The old configuration comes back, started after the change, and leads.
    let mut again = replica(&store, &clock, "v1-again", &minute, &log, works, old_config);
    sleep(Duration::from_secs(60)).await;
    v2.crash();
    sleep(Duration::from_secs(240)).await;
    assert!(again.leading());
    assert!(again.errors.lock().expect("errors").is_empty());
    let state = stored(&store).await;
    assert_eq!(
        (state.schedule.as_str(), state.revision_number()),
        ("every 2m", 2),
        "never written back: {state:?}"
    );
    let at: Vec<(i64, String)> = runs(&log)
        .into_iter()
        .map(|(at, id)| ((at - origin()).num_seconds(), id))
        .collect();
    let expected: Vec<(i64, String)> = [
        (60, "v1"),
        (120, "v1"),
        (240, "v2"),
        (360, "v1-again"),
        (480, "v1-again"),
    ]
    .iter()
    .map(|(s, id)| (*s, (*id).to_owned()))
    .collect();
    assert_eq!(at, expected);
    // Same revision, a third schedule, no flag: refused, naming what to do.
    again.crash();
    let hourly = Schedule::every(Duration::from_secs(3600)).expect("schedule");
    let third = replica(&store, &clock, "third", &hourly, &log, works, |b| {
        b.schedule_revision(2)
    });
    sleep(Duration::from_secs(30)).await;
    let errors = third.errors.lock().expect("errors").clone();
    assert!(
        errors.iter().any(|e| e.contains("every 2m")
            && e.contains("--schedule-revision")
            && e.contains("--adopt-schedule")),
        "refused: {errors:?}"
    );
}

/// Without revisions, a replica of the old schedule that was running before the change, with
/// `adopt_schedule` on (as a rollout leaves it), follows the new schedule when it leads
/// rather than writing the old one back.
#[tokio::test(start_paused = true)]
async fn an_old_replica_running_before_the_change_follows_it() {
    let (store, clock, log) = world();
    let works = Duration::from_secs(5);
    let (minute, two) = every_minute_and_every_two();
    let adopt = |b: leader_cron::CronJobBuilder| b.adopt_schedule(true);
    let mut first = replica(&store, &clock, "old-1", &minute, &log, works, adopt);
    sleep(Duration::from_secs(100)).await;
    let mut new = replica(&store, &clock, "new", &two, &log, works, adopt);
    sleep(Duration::from_secs(50)).await;
    first.crash();
    // Started after the leader died and before the new replica took over: it waits out
    // the lease from its own first read, so the new replica leads first.
    sleep(Duration::from_secs(10)).await;
    let mut second = replica(&store, &clock, "old-2", &minute, &log, works, adopt);
    sleep(Duration::from_secs(20)).await;
    assert!(new.leading());
    assert_eq!(stored(&store).await.schedule, "every 2m");
    new.crash();
    sleep(Duration::from_secs(200)).await;
    assert!(second.leading());
    let state = stored(&store).await;
    assert_eq!(state.schedule, "every 2m", "never written back: {state:?}");
    let last = runs(&log).last().cloned().expect("runs");
    assert_eq!(
        ((last.0 - origin()).num_seconds(), last.1.as_str()),
        (360, "old-2")
    );
    second.crash();
}

/// Two names of one zone are one schedule: a replica configured with `US/Eastern` runs the
/// schedule stored as `America/New_York` without being refused or changing it.
#[tokio::test(start_paused = true)]
async fn a_zone_link_is_the_same_schedule() {
    let (store, clock, log) = world();
    let works = Duration::from_secs(5);
    let zone = Schedule::cron("0 * * * *", "America/New_York").expect("schedule");
    let link = Schedule::cron("0 * * * *", "US/Eastern").expect("schedule");
    let mut a = replica(&store, &clock, "a", &zone, &log, works, |b| b);
    sleep(Duration::from_secs(3600 + 30)).await;
    a.crash();
    let mut b = replica(&store, &clock, "b", &link, &log, works, |b| b);
    sleep(Duration::from_secs(3600)).await;
    assert!(b.errors.lock().expect("errors").is_empty());
    assert!(b.leading());
    let state = stored(&store).await;
    assert_eq!(state.schedule, "cron 0 * * * * in America/New_York");
    assert_eq!(runs(&log).last().map(|r| r.1.as_str()), Some("b"));
    b.crash();
}
