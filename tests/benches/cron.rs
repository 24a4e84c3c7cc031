//! Scheduled jobs: how late a firing starts, and what it costs in requests.
//!
//! 1. **Steady leader**, per backend, in this process: an elector (lease 3 s, renew deadline
//!    2 s, retry period 500 ms) running a `leader_cron` job every second; lateness is from the
//!    scheduled instant to the job's first line, by the system clock. The lock's requests are
//!    counted at the lock: for a while with the elector alone, then with the job, and the writes
//!    that carry a firing (its start, its outcome) are told apart by the record they write.
//! 2. **A cursor a year old**, per backend, in this process: the record holds the state of a
//!    job every second whose cursor is 365 days behind (31.5 million instants); from the
//!    elector's start to the first firing's start (the default policy: the latest late one
//!    runs, the rest count as missed), and to the next on-time one.
//! 3. **After a failover**, per backend, with real processes: the fault harness's schedule
//!    workload (three `leader cron --every 1s` replicas, lease 2 s, retry period 250 ms), the
//!    leader SIGKILLed again and again; for each kill, the latest start of the instants due from
//!    a second before the kill until the lease and a second after it, against lease + retry
//!    period. Needs the Postgres of `DATABASE_URL` (the fenced sink) and the server binaries
//!    (`scripts/setup`).
//!
//! ```text
//! cargo bench -p leader-tests --bench cron                  # 30 firings, 10 kills per backend
//! FIRINGS=120 KILLS=50 cargo bench -p leader-tests --bench cron
//! BENCH_BACKENDS=redis,etcd cargo bench -p leader-tests --bench cron   # only these
//! ```

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use common::{Backend, database_url, knob, ms, percentile};
use leader::cron::{CronJob, Firing, Missed, Overlap, Schedule};
use leader_core::{
    Acquisition, CancellationToken, ChangeStream, LeaderElectionRecord, LeaderElector, LeaderEvent,
    LockError, Observed, ResourceLock, Version, async_trait,
};
use leader_test_support::{LEASE, RENEW, RETRY};
use leader_tests::harness::campaign::{self, Fault, Settings};
use leader_tests::harness::firings;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let firings = knob("FIRINGS", 30);
    let kills = knob("KILLS", 10);
    println!("Steady leader, a firing every second:\n");
    println!(
        "| backend | firings | lateness p50 | p99 | max | requests/s alone | with the job | extra per firing | writes carrying a firing, per firing |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for backend in Backend::available().await {
        steady(&backend, firings).await;
    }
    println!("\nA cursor a year old (every second, 31.5 million instants behind):\n");
    println!(
        "| backend | leading after | first firing after | next on-time firing late by | missed counted |"
    );
    println!("|---|---|---|---|---|");
    for backend in Backend::available().await {
        year_old(&backend).await;
    }
    println!("\nAfter the leader is SIGKILLed (real processes, lease 2 s, retry period 250 ms):\n");
    println!("| backend | kills | latest start per kill p50 | p99 | max | lease + retry period |");
    println!("|---|---|---|---|---|---|");
    failovers(kills).await;
}

/// Lateness and requests of a job every second on a steady leader of `backend`.
async fn steady(backend: &Backend, firings: usize) {
    let name = format!("cron-bench-{:08x}", fastrand::u32(..));
    let counted = Arc::new(Counted::new(backend.lock(&name, "c0")));
    let elector = LeaderElector::builder(counted.clone())
        .lease_duration(LEASE)
        .renew_deadline(RENEW)
        .retry_period(RETRY)
        .build()
        .expect("valid timings");
    let mut state = elector.subscribe();
    let shutdown = CancellationToken::new();
    let (latenesses, started) = (
        Arc::new(Mutex::new(Vec::new())),
        Arc::new(AtomicUsize::new(0)),
    );
    let job = {
        let (latenesses, started) = (latenesses.clone(), started.clone());
        CronJob::builder(
            "bench",
            Schedule::every(Duration::from_secs(1)).expect("every second"),
        )
        .missed(Missed::All { max: 1000 })
        .overlap(Overlap::Allow)
        .build(move |firing: Firing, _cancel| {
            let late = (Utc::now() - firing.scheduled).to_std().unwrap_or_default();
            latenesses.lock().expect("samples").push(late);
            started.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        })
        .expect("a valid job")
    };
    let (go, gate) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(
        elector.run_while_leading(shutdown.clone(), move |leadership| {
            let (job, mut gate) = (job.clone(), gate.clone());
            async move {
                // The elector alone first, then the job.
                if gate.wait_for(|go| *go).await.is_ok() {
                    let _ = job.run(leadership).await;
                }
            }
        }),
    );
    let leading = tokio::time::timeout(
        Duration::from_secs(10),
        state.wait_for(leader_core::LeaderState::is_leading),
    )
    .await;
    if !matches!(leading, Ok(Ok(_))) {
        eprintln!("{}: no leader within 10 s", backend.name());
        shutdown.cancel();
        return;
    }
    drop(leading);
    // The elector alone.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let alone = measure(&counted, Duration::from_secs(10)).await;
    // With the job: the first firing (the record's first write of the schedule) left out.
    let _ = go.send(true);
    while started.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (before, carrying_before) = (counted.requests(), counted.carrying());
    let from = started.load(Ordering::SeqCst);
    let at = Instant::now();
    while started.load(Ordering::SeqCst) < from + firings {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Each firing's outcome is written just after it starts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let with_job = (counted.requests() - before) as f64 / at.elapsed().as_secs_f64();
    let done = started.load(Ordering::SeqCst) - from;
    let carrying = (counted.carrying() - carrying_before) as f64 / done as f64;
    shutdown.cancel();
    let _ = task.await;
    let mut samples = latenesses.lock().expect("samples").split_off(1);
    samples.sort();
    println!(
        "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:+.2} | {:.2} |",
        backend.name(),
        samples.len(),
        ms(percentile(&samples, 50)),
        ms(percentile(&samples, 99)),
        ms(*samples.last().unwrap_or(&Duration::ZERO)),
        alone,
        with_job,
        with_job - alone,
        carrying,
    );
}

/// A job every second whose stored cursor is a year old: how long until it leads, until the
/// first firing starts, how late the next on-time one is, and the backlog counted as missed.
async fn year_old(backend: &Backend) {
    let name = format!("cron-year-{:08x}", fastrand::u32(..));
    let lock = backend.lock(&name, "c0");
    let year_ago = Utc::now() - chrono::Duration::days(365);
    let mut state = leader::cron::CronState::new("every 1s", year_ago);
    state.cursor = Some(year_ago);
    let mut record = LeaderElectionRecord::new("", LEASE, Utc::now(), 1);
    record
        .extensions
        .insert(leader::cron::extension_key("bench"), state.to_json());
    if let Err(err) = lock.create(&record).await {
        eprintln!("{}: {err}", backend.name());
        return;
    }
    let elector = LeaderElector::builder(lock)
        .lease_duration(LEASE)
        .renew_deadline(RENEW)
        .retry_period(RETRY)
        .build()
        .expect("valid timings");
    let mut leading = elector.subscribe();
    let starts = Arc::new(Mutex::new(Vec::new()));
    let job = {
        let starts = starts.clone();
        CronJob::builder(
            "bench",
            Schedule::every(Duration::from_secs(1)).expect("every second"),
        )
        .build(move |firing: Firing, _cancel| {
            starts
                .lock()
                .expect("starts")
                .push((Instant::now(), firing.scheduled, Utc::now()));
            async { Ok(()) }
        })
        .expect("a valid job")
    };
    let shutdown = CancellationToken::new();
    let began = Instant::now();
    let task = tokio::spawn(
        elector.run_while_leading(shutdown.clone(), move |leadership| {
            let job = job.clone();
            async move {
                let _ = job.run(leadership).await;
            }
        }),
    );
    let led = tokio::time::timeout(
        Duration::from_secs(30),
        leading.wait_for(leader_core::LeaderState::is_leading),
    )
    .await
    .is_ok_and(|r| r.is_ok())
    .then(|| began.elapsed());
    let deadline = Instant::now() + Duration::from_secs(30);
    while starts.lock().expect("starts").len() < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let _ = task.await;
    let starts = starts.lock().expect("starts").clone();
    let first = starts.first().map(|s| s.0 - began);
    let on_time = starts.get(1).and_then(|s| (s.2 - s.1).to_std().ok());
    let missed = leader::cron::ScheduleStatus::all_in(&backend_record(backend, &name).await)
        .first()
        .map_or(0, |s| s.state.missed);
    println!(
        "| {} | {} | {} | {} | {missed} |",
        backend.name(),
        led.map_or_else(|| "-".to_owned(), ms),
        first.map_or_else(|| "-".to_owned(), ms),
        on_time.map_or_else(|| "-".to_owned(), ms),
    );
}

/// The extensions of election `name`'s record on `backend`, as stored.
async fn backend_record(backend: &Backend, name: &str) -> BTreeMap<String, String> {
    match backend.lock(name, "reader").get().await {
        Ok(Some(observed)) => observed.record.extensions,
        _ => BTreeMap::new(),
    }
}

/// Requests per second the lock makes over `window`.
async fn measure(counted: &Counted, window: Duration) -> f64 {
    let before = counted.requests();
    tokio::time::sleep(window).await;
    (counted.requests() - before) as f64 / window.as_secs_f64()
}

/// The latest start per kill, over the fault harness's schedule workload.
async fn failovers(kills: usize) {
    let programs = leader_tests::programs!();
    let settings = Settings::default();
    let (faults, sink) = (vec![Fault::Kill; kills], database_url());
    for backend in common::harness_backends() {
        if backend == campaign::Backend::EtcdCluster {
            continue;
        }
        let Ok(report) = firings::run(
            backend,
            &faults,
            firings::Variations::none(),
            settings,
            &programs,
            &sink,
        )
        .await
        .inspect_err(|err| eprintln!("{}: {err}", backend.name())) else {
            continue;
        };
        if !report.violations.is_empty() {
            eprintln!("{}: {:#?}", backend.name(), report.violations);
        }
        let window =
            chrono::Duration::from_std(settings.lease + Duration::from_secs(1)).unwrap_or_default();
        let mut samples: Vec<Duration> = report
            .faulted_at
            .iter()
            .filter_map(|at| {
                report
                    .lateness
                    .range(*at - chrono::Duration::seconds(1)..*at + window)
                    .map(|(_, late)| *late)
                    .max()
            })
            .collect();
        samples.sort();
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            backend.name(),
            samples.len(),
            ms(percentile(&samples, 50)),
            ms(percentile(&samples, 99)),
            ms(*samples.last().unwrap_or(&Duration::ZERO)),
            ms(settings.lease + settings.retry),
        );
    }
}

/// A lock that counts the requests made through it, and the writes whose record carries
/// extensions other than the ones last written (a firing's start or outcome).
#[derive(Debug)]
struct Counted {
    inner: Arc<dyn ResourceLock>,
    requests: AtomicUsize,
    carrying: AtomicUsize,
    written: Mutex<BTreeMap<String, String>>,
}

impl Counted {
    fn new(inner: Arc<dyn ResourceLock>) -> Self {
        Self {
            inner,
            requests: AtomicUsize::new(0),
            carrying: AtomicUsize::new(0),
            written: Mutex::default(),
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    fn carrying(&self) -> usize {
        self.carrying.load(Ordering::SeqCst)
    }

    fn count(&self) {
        self.requests.fetch_add(1, Ordering::SeqCst);
    }

    fn write(&self, record: &LeaderElectionRecord) {
        self.count();
        let mut written = self.written.lock().expect("written");
        if *written != record.extensions {
            record.extensions.clone_into(&mut written);
            self.carrying.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl ResourceLock for Counted {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        self.count();
        self.inner.get().await
    }
    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        self.write(record);
        self.inner.create(record).await
    }
    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        self.write(record);
        self.inner.update(version, record).await
    }
    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        self.write(record);
        self.inner.renew(version, record).await
    }
    async fn record_event(&self, event: &LeaderEvent) {
        self.inner.record_event(event).await;
    }
    fn identity(&self) -> &str {
        self.inner.identity()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn election_name(&self) -> Option<&str> {
        self.inner.election_name()
    }
    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        self.inner.watch().await
    }
    async fn time_left(&self) -> Result<Option<Duration>, LockError> {
        self.inner.time_left().await
    }
    async fn close(&self) {
        self.inner.close().await;
    }
    async fn withdraw(&self) {
        self.inner.withdraw().await;
    }
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        self.count();
        self.inner.try_acquire(desired).await
    }

    fn holder_check(&self) -> leader_core::backend::HolderCheck {
        self.inner.holder_check()
    }
}
