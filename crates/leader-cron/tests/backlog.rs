//! A long backlog of an expression's instants, in real time: a leader finds a cursor a month old
//! on `* * * * * *` (2.6 million instants); it passes over them in steps while its renewals go on,
//! keeps its term (a renew deadline of 1.5 s, far shorter than finding them all), runs the
//! latest late instant and counts the rest as missed, exactly.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::{
    CancellationToken, LeaderElectionRecord, LeaderElector, LeaderState, MemoryStore, ResourceLock,
};
use leader_cron::{CronJob, CronState, Firing, Schedule, ScheduleStatus, extension_key};

#[tokio::test]
async fn a_month_of_an_expressions_instants_is_passed_over_without_losing_the_term() {
    let store = MemoryStore::new();
    let schedule = Schedule::cron("* * * * * *", "UTC").expect("schedule");
    let month_ago = Utc::now() - chrono::Duration::days(30);
    let mut state = CronState::new(schedule.spec(), month_ago);
    state.cursor = Some(month_ago.with_nanosecond_zero());
    let record = {
        let mut record = LeaderElectionRecord::new("", Duration::from_secs(2), Utc::now(), 1);
        record.extensions = BTreeMap::from([(extension_key("report"), state.to_json())]);
        record
    };
    store
        .lock("backlog", "setup")
        .create(&record)
        .await
        .expect("a record");
    let started: Arc<Mutex<Vec<DateTime<Utc>>>> = Arc::default();
    let job = {
        let started = started.clone();
        CronJob::builder("report", schedule)
            .build(move |firing: Firing, _| {
                started.lock().expect("starts").push(firing.scheduled);
                async { Ok(()) }
            })
            .expect("a job")
    };
    let elector = LeaderElector::builder(store.lock("backlog", "a"))
        .lease_duration(Duration::from_secs(2))
        .renew_deadline(Duration::from_millis(1500))
        .retry_period(Duration::from_millis(250))
        .build()
        .expect("an elector");
    let mut leading = elector.subscribe();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(
        elector.run_while_leading(shutdown.clone(), move |leadership| {
            let job = job.clone();
            async move {
                let _ = job.run(leadership).await;
            }
        }),
    );
    let token = tokio::time::timeout(
        Duration::from_secs(10),
        leading.wait_for(LeaderState::is_leading),
    )
    .await
    .expect("leads")
    .expect("the elector runs")
    .leadership()
    .map(|l| l.fencing_token());
    let first = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            let first = started.lock().expect("starts").first().copied();
            if let Some(at) = first {
                return at;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("a firing within 120 s");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = leading.borrow().leadership().map(|l| l.fencing_token());
    assert_eq!(
        still, token,
        "the term went on while the backlog was passed over"
    );
    let stored = store
        .lock("backlog", "reader")
        .get()
        .await
        .expect("get")
        .expect("a record");
    let status = ScheduleStatus::all_in(&stored.record.extensions);
    let state = &status.first().expect("the schedule").state;
    assert!(
        state
            .history
            .iter()
            .all(|e| e.attempt == 1 && e.fencing_token == token),
        "no firing interrupted, all in the first term: {state:?}"
    );
    let behind = (first - month_ago.with_nanosecond_zero()).num_seconds();
    let missed = i64::try_from(state.missed).expect("a count");
    // Every instant from the month-old cursor to the first firing, that firing excepted, is
    // counted as missed, and perhaps one or two due while the first one was recorded.
    assert!(
        (behind - 1..=behind + 2).contains(&missed),
        "{missed} missed, {behind} behind: {state:?}"
    );
    shutdown.cancel();
    let _ = task.await;
}

trait WholeSecond {
    fn with_nanosecond_zero(self) -> Self;
}

impl WholeSecond for DateTime<Utc> {
    fn with_nanosecond_zero(self) -> Self {
        use chrono::Timelike;
        self.with_nanosecond(0).expect("a whole second")
    }
}
