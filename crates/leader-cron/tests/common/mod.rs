//! What the schedule tests share: replicas running a job on electors of one in-memory store,
//! on tokio's paused clock, and a log of the firings their jobs started.

#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::background::Candidate;
use leader_core::{LeaderElector, MemoryStore, ResourceLock};
use leader_cron::{
    Control, CronEvent, CronJob, CronState, Firing, Request, Schedule, TokioClock, extension_key,
};
use tokio::sync::broadcast;
use tokio::time::sleep;

pub const LEASE: Duration = Duration::from_secs(15);

pub fn origin() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-01-10T00:00:00Z")
        .expect("time")
        .with_timezone(&Utc)
}

/// The firings the jobs started, in order: (scheduled, attempt, replica).
pub type Log = Arc<Mutex<Vec<(DateTime<Utc>, u32, String)>>>;

/// One replica: an elector running the job, a flag that makes its job act as if its process
/// died (it records nothing more) once the replica is crashed, and its job's events from its
/// start.
pub struct Replica {
    pub candidate: Option<Candidate>,
    pub dead: Arc<AtomicBool>,
    pub errors: Arc<Mutex<Vec<String>>>,
    pub events: broadcast::Receiver<CronEvent>,
}

impl Replica {
    pub fn start(store: &MemoryStore, id: &str, job: CronJob) -> Self {
        let errors = Arc::new(Mutex::new(Vec::new()));
        let seen = errors.clone();
        let events = job.subscribe();
        let elector = LeaderElector::builder(store.lock("election", id))
            .jitter(0.0)
            .lease_duration(LEASE)
            .renew_deadline(Duration::from_secs(10))
            .retry_period(Duration::from_secs(2))
            .on_started_leading(move |leadership| {
                let (job, seen) = (job.clone(), seen.clone());
                async move {
                    if let Err(err) = job.run(leadership).await {
                        seen.lock().expect("errors").push(err.to_string());
                    }
                }
            });
        Self {
            candidate: Some(Candidate::build(elector)),
            dead: Arc::new(AtomicBool::new(false)),
            errors,
            events,
        }
    }

    pub fn leading(&self) -> bool {
        self.candidate.as_ref().is_some_and(Candidate::is_leading)
    }

    /// The process dies: no release, no more writes; its lease runs out.
    pub fn crash(&mut self) {
        self.dead.store(true, Ordering::Release);
        if let Some(candidate) = self.candidate.take() {
            candidate.task.abort();
        }
    }
}

/// The job: logs each firing it starts, then works for `works` (or until cancelled); once its
/// replica is dead it does nothing.
pub fn work(
    builder: leader_cron::CronJobBuilder,
    id: &str,
    log: &Log,
    works: Duration,
    dead: &Arc<AtomicBool>,
) -> CronJob {
    let (log, id, dead) = (log.clone(), id.to_owned(), dead.clone());
    builder
        .build(move |firing: Firing, cancel| {
            let (log, id, dead) = (log.clone(), id.clone(), dead.clone());
            async move {
                if dead.load(Ordering::Acquire) {
                    return Ok(());
                }
                log.lock()
                    .expect("log")
                    .push((firing.scheduled, firing.attempt, id));
                tokio::select! {
                    () = sleep(works) => Ok(()),
                    () = cancel.cancelled() => Err("cancelled".into()),
                }
            }
        })
        .expect("valid job")
}

/// A replica running schedule `schedule` under name `name` with `configure` applied.
pub fn replica(
    store: &MemoryStore,
    clock: &TokioClock,
    id: &str,
    schedule: &Schedule,
    log: &Log,
    works: Duration,
    configure: impl FnOnce(leader_cron::CronJobBuilder) -> leader_cron::CronJobBuilder,
) -> Replica {
    let dead = Arc::new(AtomicBool::new(false));
    let builder = configure(CronJob::builder("report", schedule.clone()).clock(clock.clone()));
    let job = work(builder, id, log, works, &dead);
    let mut replica = Replica::start(store, id, job);
    replica.dead = dead;
    replica
}

/// The schedule's state as the store holds it.
pub async fn stored(store: &MemoryStore) -> CronState {
    let value = store
        .lock("election", "reader")
        .get()
        .await
        .expect("get")
        .expect("a record")
        .record
        .extensions
        .get(&extension_key("report"))
        .cloned()
        .expect("the schedule's state");
    CronState::from_json(&value).expect("a state")
}

pub fn instants(log: &Log) -> Vec<(DateTime<Utc>, u32)> {
    log.lock()
        .expect("log")
        .iter()
        .map(|(at, attempt, _)| (*at, *attempt))
        .collect()
}

pub fn minutes(n: i64) -> DateTime<Utc> {
    origin() + chrono::Duration::minutes(n)
}

/// What each schedule test starts from: a new in-memory store, a clock at [`origin`] that
/// follows tokio's (paused) clock, and an empty log of firings.
pub fn world() -> (MemoryStore, TokioClock, Log) {
    (
        MemoryStore::new(),
        TokioClock::starting_at(origin()),
        Log::default(),
    )
}

/// The instants the jobs started, in order, without their attempts.
pub fn scheduled(log: &Log) -> Vec<DateTime<Utc>> {
    instants(log).iter().map(|s| s.0).collect()
}

/// `a` and `b` as (the one that leads, the other).
pub fn by_leadership<'r>(
    a: &'r mut Replica,
    b: &'r mut Replica,
) -> (&'r mut Replica, &'r mut Replica) {
    if a.leading() { (a, b) } else { (b, a) }
}

/// A clock that can be stepped, over tokio's.
#[derive(Debug)]
pub struct SteppedClock {
    /// The clock it steps away from.
    pub base: TokioClock,
    /// How far ahead of `base` it reads (behind when negative).
    pub offset_seconds: Arc<std::sync::atomic::AtomicI64>,
}

impl leader_cron::Clock for SteppedClock {
    fn now(&self) -> DateTime<Utc> {
        self.base.now() + chrono::Duration::seconds(self.offset_seconds.load(Ordering::Acquire))
    }
}

/// A schedule firing every `seconds`.
pub fn every_seconds(seconds: u64) -> Schedule {
    Schedule::every(Duration::from_secs(seconds)).expect("schedule")
}

/// Replica `a`, running `schedule` with work of a second, on a clock that can be stepped away
/// from `clock` (at 0 at first), and the offset that steps it.
pub fn on_stepped_clock(
    store: &MemoryStore,
    clock: &TokioClock,
    schedule: &Schedule,
    log: &Log,
) -> (Replica, Arc<std::sync::atomic::AtomicI64>) {
    let (stepped, offset) = SteppedClock::over(clock, 0);
    let works = Duration::from_secs(1);
    let a = replica(store, clock, "a", schedule, log, works, |b| {
        b.clock(stepped)
    });
    (a, offset)
}

/// The schedules of a rollout: every minute, then every two minutes.
pub fn every_minute_and_every_two() -> (Schedule, Schedule) {
    (every_seconds(60), every_seconds(120))
}

impl SteppedClock {
    /// A clock over `base`, `offset_seconds` ahead of it, and the offset that steps it.
    pub fn over(
        base: &TokioClock,
        offset_seconds: i64,
    ) -> (Self, Arc<std::sync::atomic::AtomicI64>) {
        let offset = Arc::new(std::sync::atomic::AtomicI64::new(offset_seconds));
        let clock = Self {
            base: base.clone(),
            offset_seconds: offset.clone(),
        };
        (clock, offset)
    }
}

/// The lock an operator's requests go through.
pub fn operator(store: &MemoryStore) -> impl ResourceLock {
    store.lock("election", "ops")
}

/// Operator `by` suspends the schedule; the requests as stored.
pub async fn suspend(store: &MemoryStore, by: &str) -> Control {
    leader_cron::suspend(&operator(store), "report", by)
        .await
        .expect("suspend")
}

/// An operator resumes the schedule.
pub async fn resume(store: &MemoryStore) {
    leader_cron::resume(&operator(store), "report")
        .await
        .expect("resume");
}

/// Operator `by` asks for a firing now; the request as stored.
pub async fn trigger(store: &MemoryStore, by: &str) -> Request {
    leader_cron::trigger(&operator(store), "report", by)
        .await
        .expect("trigger")
        .trigger
        .expect("a trigger")
}

/// Operator `ops` cancels the firing scheduled at `firing` (every one running or waiting
/// when `None`); the request as stored.
pub async fn cancel(store: &MemoryStore, firing: Option<DateTime<Utc>>) -> Request {
    leader_cron::cancel(&operator(store), "report", "ops", firing)
        .await
        .expect("cancel")
        .cancel
        .expect("a cancel")
}
