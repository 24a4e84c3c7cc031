//! The policy matrix on tokio's paused clock, with electors on the in-memory lock: each firing
//! started once; a leader change just before, during and after a firing; missed firings (latest,
//! all, skip, a starting deadline); overlapping firings (forbid, allow, replace); interrupted
//! firings (retried, given up); a replica with another schedule refused; a clock stepped back
//! repeats nothing; the events a subscriber sees.

use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::MemoryStore;
use leader_cron::{CronEvent, Interrupted, Missed, Outcome, Overlap, Schedule, TokioClock};
use tokio::time::sleep;

mod common;

use common::{
    Log, Replica, by_leadership, every_seconds, instants, minutes, on_stepped_clock, origin,
    replica, scheduled, stored, world,
};

#[tokio::test(start_paused = true)]
async fn a_steady_leader_starts_each_firing_once_on_time() {
    let (store, clock, log) = world();
    let every = every_seconds(60);
    let works = Duration::from_secs(5);
    let mut replicas: Vec<Replica> = ["a", "b", "c"]
        .iter()
        .map(|id| replica(&store, &clock, id, &every, &log, works, |b| b))
        .collect();
    sleep(Duration::from_secs(10 * 60 + 30)).await;
    let started = instants(&log);
    assert_eq!(
        started,
        (1..=10).map(|m| (minutes(m), 1)).collect::<Vec<_>>(),
        "one start per minute, each once"
    );
    let state = stored(&store).await;
    assert_eq!(state.cursor, Some(minutes(10)));
    assert_eq!(
        state.last.as_ref().map(|l| l.outcome.clone()),
        Some(Outcome::Succeeded)
    );
    assert!(state.running.is_empty() && state.missed == 0, "{state:?}");
    for r in &mut replicas {
        r.crash();
    }
}

/// The leader dies just before a firing, during one, and just after one ended: the next leader
/// starts each instant once, retries the one that was running (attempt 2), and loses none.
#[tokio::test(start_paused = true)]
async fn a_leader_change_before_during_and_after_a_firing() {
    for (case, offset) in [("before", -5), ("during", 10), ("after", 40)] {
        let (store, clock, log) = world();
        let every = every_seconds(60);
        let works = Duration::from_secs(20);
        let mut a = replica(&store, &clock, "a", &every, &log, works, |b| b);
        sleep(Duration::from_secs(1)).await;
        let mut b = replica(&store, &clock, "b", &every, &log, works, |b| b);
        // Minute 2, plus the offset: crash the leader.
        sleep(Duration::from_secs(
            u64::try_from(2 * 60 + offset - 1).expect("later"),
        ))
        .await;
        let (leader, follower) = by_leadership(&mut a, &mut b);
        leader.crash();
        sleep(Duration::from_secs(6 * 60)).await;
        assert!(follower.leading(), "{case}: the follower took over");
        let started = instants(&log);
        let last = (2 * 60 + offset - 1 + 6 * 60) / 60;
        // Firings missed during the failover run late (the latest one), so none is lost.
        let mut firings: Vec<DateTime<Utc>> = started.iter().map(|s| s.0).collect();
        firings.dedup();
        assert_eq!(
            firings,
            (1..=last).map(minutes).collect::<Vec<_>>(),
            "{case}: every instant started, in order: {started:?}"
        );
        let attempts = |m| started.iter().filter(|s| s.0 == minutes(m)).count();
        for m in 1..=last {
            let want = if case == "during" && m == 2 { 2 } else { 1 };
            assert_eq!(attempts(m), want, "{case}: minute {m}: {started:?}");
        }
        follower.crash();
    }
}

#[tokio::test(start_paused = true)]
async fn missed_firings_follow_the_policy() {
    for (missed, late_runs) in [
        (Missed::Latest, vec![5]),
        (Missed::All { max: 3 }, vec![3, 4, 5]),
        (Missed::Skip, vec![]),
    ] {
        let (store, clock, log) = world();
        let every = every_seconds(60);
        let short = Duration::from_secs(5);
        // A leads through minute 1, and dies; nobody leads until minute 5:30.
        let mut a = replica(&store, &clock, "a", &every, &log, short, |b| {
            b.missed(missed)
        });
        sleep(Duration::from_secs(90)).await;
        a.crash();
        sleep(Duration::from_secs(4 * 60)).await;
        let mut b = replica(&store, &clock, "b", &every, &log, short, |b| {
            b.missed(missed).overlap(Overlap::Allow)
        });
        sleep(Duration::from_secs(60 + 45)).await;
        assert!(
            b.leading(),
            "{missed:?}: b leads; {:?}",
            b.errors.lock().expect("errors")
        );
        let started: Vec<DateTime<Utc>> = scheduled(&log);
        let mut expected = vec![minutes(1)];
        expected.extend(late_runs.iter().map(|m| minutes(*m)));
        expected.extend([minutes(6), minutes(7)]);
        assert_eq!(started, expected, "{missed:?}");
        let state = stored(&store).await;
        assert_eq!(
            state.missed,
            4 - late_runs.len() as u64,
            "{missed:?}: {state:?}"
        );
        b.crash();
    }
}

#[tokio::test(start_paused = true)]
async fn a_starting_deadline_misses_what_is_too_late() {
    let (store, clock, log) = world();
    let every = every_seconds(60);
    let works = Duration::from_secs(1);
    let configure = |b: leader_cron::CronJobBuilder| {
        b.missed(Missed::All { max: 10 })
            .overlap(Overlap::Allow)
            .starting_deadline(Duration::from_secs(150))
    };
    let mut a = replica(&store, &clock, "a", &every, &log, works, configure);
    sleep(Duration::from_secs(90)).await;
    a.crash();
    sleep(Duration::from_secs(5 * 60)).await;
    // Now 6:30: minutes 2, 3 and 4 are older than 150 s; 5 and 6 are within it.
    let mut b = replica(&store, &clock, "b", &every, &log, works, configure);
    // It takes over a lease after it saw the record (S2), and starts what is due then.
    sleep(Duration::from_secs(25)).await;
    let started: Vec<DateTime<Utc>> = scheduled(&log);
    assert_eq!(started, vec![minutes(1), minutes(5), minutes(6)]);
    assert_eq!(stored(&store).await.missed, 3);
    b.crash();
}

#[tokio::test(start_paused = true)]
async fn overlapping_firings_follow_the_policy() {
    for (overlap, missed) in [
        (Overlap::Forbid, Missed::Latest),
        (Overlap::Forbid, Missed::Skip),
        (Overlap::Allow, Missed::Latest),
        (Overlap::Replace, Missed::Latest),
    ] {
        let (store, clock, log) = world();
        let every = every_seconds(10);
        let works = Duration::from_secs(25);
        // Each run takes 25 s: it overruns two later firings.
        let mut a = replica(&store, &clock, "a", &every, &log, works, |b| {
            b.overlap(overlap).missed(missed)
        });
        sleep(Duration::from_secs(66)).await;
        let started: Vec<i64> = instants(&log)
            .iter()
            .map(|s| (s.0 - origin()).num_seconds())
            .collect();
        let state = stored(&store).await;
        match (overlap, missed) {
            // 20 and 30 wait for 10 (ended at 35): the latest of them runs late. 40 and 50
            // wait for 30 (ended at 60), when 60 is due on time: it is the latest.
            (Overlap::Forbid, Missed::Latest) => {
                assert_eq!(started, vec![10, 30, 60], "forbid");
                assert_eq!(state.missed, 3, "20, 40 and 50 missed: {state:?}");
            }
            (Overlap::Forbid, _) => {
                assert_eq!(started, vec![10, 40], "forbid, skip");
                assert_eq!(state.missed, 4, "20, 30, 50 and 60 skipped: {state:?}");
            }
            (Overlap::Allow, _) => {
                assert_eq!(started, vec![10, 20, 30, 40, 50, 60], "allow");
            }
            _ => {
                assert_eq!(started, vec![10, 20, 30, 40, 50, 60], "replace");
                assert_eq!(
                    state.last.as_ref().map(|l| l.outcome.clone()),
                    Some(Outcome::Replaced),
                    "the one running was replaced: {state:?}"
                );
                assert_eq!(state.running.len(), 1, "one runs at a time: {state:?}");
            }
        }
        a.crash();
    }
}

#[tokio::test(start_paused = true)]
async fn an_interrupted_firing_is_retried_or_given_up_never_silently() {
    for policy in [Interrupted::Retry { max_attempts: 2 }, Interrupted::GiveUp] {
        let (store, clock, log) = world();
        let every = every_seconds(600);
        let works = Duration::from_secs(120);
        let mut a = replica(&store, &clock, "a", &every, &log, works, |b| {
            b.interrupted(policy)
        });
        sleep(Duration::from_secs(1)).await;
        let mut b = replica(&store, &clock, "b", &every, &log, works, |b| {
            b.interrupted(policy)
        });
        // The firing of 10:00 runs; its leader dies at 10:30.
        sleep(Duration::from_secs(600 + 29)).await;
        let (leader, follower) = by_leadership(&mut a, &mut b);
        leader.crash();
        sleep(Duration::from_secs(3 * 60)).await;
        let started = instants(&log);
        let state = stored(&store).await;
        match policy {
            Interrupted::GiveUp => {
                assert_eq!(started, vec![(minutes(10), 1)]);
                assert!(
                    matches!(
                        state.last.as_ref().map(|l| &l.outcome),
                        Some(Outcome::GaveUp { .. })
                    ),
                    "{state:?}"
                );
            }
            _ => {
                assert_eq!(started, vec![(minutes(10), 1), (minutes(10), 2)]);
                assert_eq!(
                    state.last.as_ref().map(|l| (l.attempt, l.outcome.clone())),
                    Some((2, Outcome::Succeeded)),
                    "{state:?}"
                );
            }
        }
        assert!(state.running.is_empty(), "{state:?}");
        follower.crash();
    }
}

/// A leader under `Allow` dies with two firings running (10:00 and 10:20, each working 1000
/// s); the next leader's configuration says `Forbid` or `Replace` (a changed configuration
/// rolled out, or replicas of two releases). The interrupted firings run again by the new
/// leader's policy, as any firing does: under `Forbid` one at a time, in the order of their
/// instants; under `Replace` the latest only, the earlier recorded as replaced. Never the two
/// side by side.
#[tokio::test(start_paused = true)]
async fn interrupted_firings_run_again_by_the_new_leaders_overlap_policy() {
    for overlap in [Overlap::Forbid, Overlap::Replace] {
        let (store, clock, log) = world();
        let every = every_seconds(600);
        let works = Duration::from_secs(1000);
        let retry = Interrupted::Retry { max_attempts: 3 };
        let mut a = replica(&store, &clock, "a", &every, &log, works, |b| {
            b.overlap(Overlap::Allow).interrupted(retry)
        });
        sleep(Duration::from_secs(20 * 60 + 30)).await;
        assert!(a.leading());
        assert_eq!(stored(&store).await.running.len(), 2, "two run at 10:20");
        a.crash();
        let mut b = replica(&store, &clock, "b", &every, &log, works, |b| {
            b.overlap(overlap).interrupted(retry)
        });
        // Every 30 s for an hour: never two firings running.
        for _ in 0..120 {
            sleep(Duration::from_secs(30)).await;
            let state = stored(&store).await;
            assert!(state.running.len() <= 1, "{overlap:?}: {state:?}");
        }
        let started = instants(&log);
        let state = stored(&store).await;
        assert_eq!(started[..2], [(minutes(10), 1), (minutes(20), 1)]);
        match overlap {
            Overlap::Forbid => assert_eq!(
                started[2..4],
                [(minutes(10), 2), (minutes(20), 2)],
                "in the order of their instants, one after the other: {state:?}"
            ),
            _ => {
                assert_eq!(started[2], (minutes(20), 2), "the latest: {state:?}");
                assert!(!started.contains(&(minutes(10), 2)), "{started:?}");
                assert!(
                    state.history.iter().chain(&state.last).any(|ended| {
                        ended.scheduled == minutes(10)
                            && ended.attempt == 2
                            && ended.outcome == Outcome::Replaced
                    }),
                    "the earlier recorded as replaced: {state:?}"
                );
            }
        }
        b.crash();
    }
}

#[tokio::test(start_paused = true)]
async fn a_replica_with_another_schedule_is_refused_and_changes_nothing() {
    let (store, clock, log) = world();
    let every = every_seconds(60);
    let works = Duration::from_secs(1);
    let mut a = replica(&store, &clock, "a", &every, &log, works, |b| b);
    sleep(Duration::from_secs(90)).await;
    a.crash();
    let before = stored(&store).await;
    let other = Schedule::cron("*/2 * * * *", "UTC").expect("schedule");
    let mut b = replica(&store, &clock, "b", &other, &log, works, |b| b);
    sleep(Duration::from_secs(60)).await;
    let errors = b.errors.lock().expect("errors").clone();
    assert!(
        errors
            .first()
            .is_some_and(|e| e.contains("every 1m") && e.contains("*/2 * * * *")),
        "one line naming both schedules: {errors:?}"
    );
    assert_eq!(stored(&store).await, before, "nothing changed");
    assert_eq!(instants(&log).len(), 1, "nothing run by the other schedule");
    b.crash();
}

#[tokio::test(start_paused = true)]
async fn a_clock_stepped_back_repeats_no_firing() {
    let (store, clock, log) = world();
    let (mut a, offset) = on_stepped_clock(&store, &clock, &every_seconds(60), &log);
    sleep(Duration::from_secs(5 * 60 + 30)).await;
    offset.store(-3 * 60, Ordering::Release);
    sleep(Duration::from_secs(5 * 60)).await;
    let started: Vec<DateTime<Utc>> = scheduled(&log);
    // 1 to 5, then (the clock reading 2:30 at 5:30) nothing until it reads past 5 again.
    assert_eq!(started, (1..=7).map(minutes).collect::<Vec<_>>());
    a.crash();
}

/// A subscriber sees each firing's start and end and the firings missed, in order.
#[tokio::test(start_paused = true)]
async fn events_tell_each_start_end_and_miss() {
    let (store, clock, log) = world();
    let every = every_seconds(60);
    // Each firing works 90 s: the one of minute 2 is due while minute 1's still runs, waits,
    // and is late when it ends.
    let works = Duration::from_secs(90);
    let mut a = replica(&store, &clock, "a", &every, &log, works, |b| {
        b.overlap(Overlap::Forbid).missed(Missed::Skip)
    });
    sleep(Duration::from_secs(3 * 60 + 10)).await;
    let mut seen = Vec::new();
    while let Ok(event) = a.events.try_recv() {
        seen.push(event);
    }
    let started = |event: &CronEvent| match event {
        CronEvent::Started(firing) => Some((firing.scheduled, firing.attempt)),
        _ => None,
    };
    assert_eq!(seen.len(), 4, "{seen:#?}");
    assert_eq!(started(&seen[0]), Some((minutes(1), 1)), "{seen:#?}");
    assert_eq!(
        seen[1],
        CronEvent::Ended {
            scheduled: minutes(1),
            attempt: 1,
            outcome: Outcome::Succeeded
        }
    );
    assert_eq!(
        seen[2],
        CronEvent::Missed {
            count: 1,
            latest: Some(minutes(2))
        }
    );
    assert_eq!(started(&seen[3]), Some((minutes(3), 1)), "{seen:#?}");
    a.crash();
}

/// A cursor a year old on a schedule of every second (31 million instants behind): the new
/// leader passes over the backlog at once instead of walking it (a walk kept the renewals
/// waiting past the term's deadline, and the next leader started over from the same cursor),
/// runs the latest late instant, and counts the rest as missed.
#[tokio::test(start_paused = true)]
async fn a_cursor_a_year_old_is_passed_over_at_once() {
    let store = MemoryStore::new();
    let log = Log::default();
    let every = every_seconds(1);
    let works = Duration::from_millis(100);
    let year = chrono::Duration::days(365);
    let old_clock = TokioClock::starting_at(origin() - year);
    let mut old = replica(&store, &old_clock, "old", &every, &log, works, |b| b);
    sleep(Duration::from_secs(5)).await;
    old.crash();
    let cursor = stored(&store).await.cursor.expect("a cursor");
    assert!(cursor < origin() - year + chrono::Duration::minutes(1));
    // A year later, by the next leader's clock.
    let clock = TokioClock::starting_at(origin());
    let started = std::time::Instant::now();
    let mut new = replica(&store, &clock, "new", &every, &log, works, |b| b);
    let state = loop {
        sleep(Duration::from_millis(500)).await;
        let state = stored(&store).await;
        if state.cursor.is_some_and(|c| c >= origin()) {
            break state;
        }
    };
    eprintln!("a year of backlog settled in {:?}", started.elapsed());
    let now = state.cursor.expect("a cursor");
    let behind = u64::try_from((now - cursor).num_seconds()).expect("seconds");
    assert!(
        state.missed >= behind - 100 && state.missed <= behind,
        "{} missed of {behind}",
        state.missed
    );
    let by_new: Vec<_> = log
        .lock()
        .expect("log")
        .iter()
        .filter(|(_, _, id)| id == "new")
        .map(|(at, _, _)| *at)
        .collect();
    assert!(
        by_new
            .first()
            .is_some_and(|first| *first >= origin() - chrono::Duration::seconds(60)),
        "the new leader's first firing: {:?}",
        by_new.first()
    );
    new.crash();
}
