//! Clocks that disagree, on tokio's paused clock with electors on the in-memory lock: a
//! trigger asked from a machine whose clock is behind the last trigger handled still runs; a
//! leader whose clock read year 9999 does not hold the schedule until then; a leader whose
//! clock steps back an hour and forward again goes on within a second of the step forward.

mod common;

use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::LockError;
use leader_cron::{Clock, CronState, extension_key};
use tokio::time::sleep;

use common::{
    SteppedClock, every_seconds, instants, on_stepped_clock, operator, origin, replica, stored,
    trigger, world,
};

/// The last trigger handled was asked from a machine whose clock ran far ahead (it reads
/// 2100 in the record); a trigger asked now, by a clock behind it, is dated after it and
/// runs, instead of being taken for one handled already.
#[tokio::test(start_paused = true)]
async fn a_trigger_from_a_clock_behind_the_last_one_handled_runs() {
    let (store, clock, log) = world();
    let hourly = every_seconds(3600);
    let works = Duration::from_secs(1);
    let mut a = replica(&store, &clock, "a", &hourly, &log, works, |b| b);
    sleep(Duration::from_secs(10)).await;
    a.crash();
    // While nobody leads, the record says a trigger dated 2100 was handled.
    let ahead = DateTime::parse_from_rfc3339("2100-01-01T00:00:00.5Z")
        .expect("time")
        .with_timezone(&Utc);
    leader_core::edit_record::<LockError>(&operator(&store), 10, |current| {
        let mut record = current.expect("a record").record.clone();
        let key = extension_key("report");
        let mut state = CronState::from_json(&record.extensions[&key]).expect("a state");
        state.last_trigger = Some(ahead);
        record.extensions.insert(key, state.to_json());
        Ok(Some(record))
    })
    .await
    .expect("written");
    let mut b = replica(&store, &clock, "b", &hourly, &log, works, |b| b);
    sleep(Duration::from_secs(30)).await;
    assert!(b.leading());
    let asked = trigger(&store, "alice").await;
    assert!(
        asked.at > ahead,
        "dated after the last one handled: {asked:?}"
    );
    sleep(Duration::from_secs(20)).await;
    assert_eq!(
        instants(&log).last().map(|(at, _)| *at),
        Some(asked.at),
        "it ran"
    );
    assert_eq!(stored(&store).await.last_trigger, Some(asked.at));
    b.crash();
}

/// A leader whose clock reads year 9999 fires by it (its cursor moves there); once a leader
/// with a right clock takes over, it says so and goes on from its own clock: the schedule
/// fires again within its period, not in year 9999.
#[tokio::test(start_paused = true)]
async fn a_cursor_moved_to_year_9999_does_not_hold_the_schedule() {
    let (store, clock, log) = world();
    let minute = every_seconds(60);
    let works = Duration::from_secs(1);
    let mut right = replica(&store, &clock, "right", &minute, &log, works, |b| b);
    sleep(Duration::from_secs(130)).await;
    right.crash();
    let to_9999 = (DateTime::parse_from_rfc3339("9999-01-01T00:00:00Z").expect("time")
        - origin().fixed_offset())
    .num_seconds();
    let (wrong, _) = SteppedClock::over(&clock, to_9999);
    let mut ahead = replica(&store, &clock, "ahead", &minute, &log, works, |b| {
        b.clock(wrong)
    });
    sleep(Duration::from_secs(90)).await;
    assert!(ahead.leading());
    let cursor = stored(&store).await.cursor.expect("a cursor");
    assert!(cursor.format("%Y").to_string() == "9999", "{cursor}");
    ahead.crash();
    let mut again = replica(&store, &clock, "again", &minute, &log, works, |b| b);
    sleep(Duration::from_secs(120)).await;
    assert!(again.leading());
    let last = instants(&log).last().map(|(at, _)| *at).expect("firings");
    assert!(
        last > origin() && last <= clock.now(),
        "fires again by the right clock: {last}"
    );
    let state = stored(&store).await;
    assert!(state.handled_until() <= clock.now(), "{state:?}");
    again.crash();
}

/// Every 10 s, the leader's clock steps back an hour at 25 s and forward again at 45 s. While
/// it reads an hour behind, nothing runs (the firing of 30 s waits for the clock to pass it
/// again, nothing repeated); once it steps forward, the leader, which was waiting an hour by
/// its timer, finds 30 and 40 late within a second: the missed policy runs 40 late and counts
/// 30 missed, and 50 and 60 run on time.
#[tokio::test(start_paused = true)]
async fn a_clock_stepped_back_and_forward_goes_on_at_once() {
    let (store, clock, log) = world();
    let (mut a, offset) = on_stepped_clock(&store, &clock, &every_seconds(10), &log);
    sleep(Duration::from_secs(25)).await;
    offset.store(-3600, std::sync::atomic::Ordering::Release);
    sleep(Duration::from_secs(20)).await;
    offset.store(0, std::sync::atomic::Ordering::Release);
    sleep(Duration::from_secs(20)).await;
    let seconds: Vec<(i64, u32)> = instants(&log)
        .iter()
        .map(|(at, attempt)| ((*at - origin()).num_seconds(), *attempt))
        .collect();
    assert_eq!(seconds, [(10, 1), (20, 1), (40, 1), (50, 1), (60, 1)]);
    assert_eq!(stored(&store).await.missed, 1);
    a.crash();
}
