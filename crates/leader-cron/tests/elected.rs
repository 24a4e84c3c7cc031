//! A job with its own election (`run_elected`), on tokio's paused clock and the in-memory lock:
//! two replicas start each firing once under the job's name; a replica with another schedule
//! under that name gets the refusal back when it leads; shutdown returns.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::{CancellationToken, MemoryStore, ResourceLock};
use leader_cron::{CronError, CronJob, Firing, Schedule, TokioClock};
use tokio::time::sleep;

fn origin() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-01-10T00:00:00Z")
        .expect("time")
        .with_timezone(&Utc)
}

fn job(every: u64, clock: &TokioClock, log: &Arc<Mutex<Vec<DateTime<Utc>>>>) -> CronJob {
    let log = log.clone();
    CronJob::builder(
        "report",
        Schedule::every(Duration::from_secs(every)).expect("schedule"),
    )
    .clock(clock.clone())
    .build(move |firing: Firing, _| {
        let log = log.clone();
        async move {
            log.lock().expect("log").push(firing.scheduled);
            Ok(())
        }
    })
    .expect("a job")
}

#[tokio::test(start_paused = true)]
async fn replicas_run_each_firing_once_and_a_mismatch_comes_back() {
    let store = MemoryStore::new();
    let clock = TokioClock::starting_at(origin());
    let log = Arc::default();
    let shutdown = CancellationToken::new();
    let replicas: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|id| {
            let (job, lock, stop) = (
                job(60, &clock, &log),
                store.lock("report", id),
                shutdown.clone(),
            );
            tokio::spawn(async move { job.run_elected(lock, stop).await })
        })
        .collect();
    sleep(Duration::from_secs(3 * 60 + 30)).await;
    let seen = log.lock().expect("log").clone();
    let minutes: Vec<i64> = seen
        .iter()
        .map(|at| (*at - origin()).num_minutes())
        .collect();
    assert_eq!(minutes, vec![1, 2, 3]);
    // The election is named after the job: the record lives under the job's name.
    let record = store.lock("report", "reader").get().await.expect("get");
    assert!(record.is_some_and(|r| r.record.extensions.contains_key("cron/report")));
    shutdown.cancel();
    for replica in replicas {
        let ended = tokio::time::timeout(Duration::from_secs(30), replica)
            .await
            .expect("returns on shutdown")
            .expect("no panic");
        assert!(ended.is_ok(), "{ended:?}");
    }
    // Another schedule under the same name: the refusal comes back, and nothing ran.
    let other = job(3600, &clock, &log);
    let refused = tokio::time::timeout(
        Duration::from_secs(60),
        other.run_elected(store.lock("report", "c"), CancellationToken::new()),
    )
    .await
    .expect("returns");
    assert!(
        matches!(refused, Err(CronError::ScheduleMismatch { .. })),
        "{refused:?}"
    );
    assert_eq!(log.lock().expect("log").len(), 3);
}
