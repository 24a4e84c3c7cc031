//! Faults across backends: three replicas of `leader run -- fenced-writer` on the file lock and,
//! through a TCP proxy each, on private Postgres, Redis and etcd servers; into whichever replica
//! leads: SIGKILL, SIGSTOP past the lease then SIGCONT, its network cut, a latency spike beyond
//! the renew deadline, and the server crashed and restarted. The checker asserts that no two
//! terms overlapped (`CLOCK_MONOTONIC` intervals), that fencing tokens grew, that the fenced sink
//! accepted no stale write (and refused the frozen leaders' ones), and that a leader was back
//! within the bound after every fault.
//!
//! By default one round (each fault once per backend), in order. Knobs for the long run:
//! - `FAULT_ROUNDS=N`: N rounds, or `FAULT_COUNT=N`: N faults per backend (the kinds in turn);
//! - `FAULT_SEED=S`: shuffle the schedule with seed S (a random seed when `FAULT_SHUFFLE=1`);
//!   the seed is printed, so a failing schedule can be replayed;
//! - `FAULT_LEASE_MS=L`: a shorter lease (renew deadline 3/4 of it, retry period 1/8);
//! - `FAULT_PARALLEL=1`: backends at the same time instead of one after the other.
//!
//! For example `FAULT_COUNT=1000 FAULT_SHUFFLE=1 FAULT_LEASE_MS=800 cargo test -p leader-tests
//! --release --test faults -- --nocapture`. Every run prints a summary table. Needs the Postgres
//! of `DATABASE_URL` for the sink, and Debian's PostgreSQL, `redis-server` and `etcd` binaries
//! for the private servers (`scripts/setup` installs them).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use leader_tests::database_url;
use leader_tests::harness::campaign::{self, Backend, Fault, Programs, Report, Settings};
use leader_tests::harness::run_or_skip;

fn knob<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The faults to inject into `backend`, in order: `FAULT_COUNT` faults (or `FAULT_ROUNDS`
/// rounds) of its kinds in turn, shuffled with `FAULT_SEED` (or a random seed with
/// `FAULT_SHUFFLE=1`).
fn schedule(backend: Backend) -> (Vec<Fault>, Option<u64>) {
    let kinds = backend.faults();
    let count = knob::<usize>("FAULT_COUNT")
        .unwrap_or_else(|| knob::<usize>("FAULT_ROUNDS").unwrap_or(1) * kinds.len());
    let mut faults: Vec<Fault> = kinds.iter().copied().cycle().take(count).collect();
    let seed = knob::<u64>("FAULT_SEED").or_else(|| {
        std::env::var("FAULT_SHUFFLE")
            .is_ok_and(|v| v == "1")
            .then(|| fastrand::u64(..))
    });
    if let Some(seed) = seed {
        fastrand::Rng::with_seed(seed).shuffle(&mut faults);
    }
    (faults, seed)
}

/// `Settings` with `FAULT_LEASE_MS` applied.
fn settings() -> Settings {
    let mut settings = Settings::default();
    if let Some(lease) = knob::<u64>("FAULT_LEASE_MS") {
        settings.lease = Duration::from_millis(lease);
        settings.renew = settings.lease * 3 / 4;
        settings.retry = settings.lease / 8;
    }
    settings
}

/// One campaign at a time: they time failovers on a two-core machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Every report so far, for the summary table.
static REPORTS: Mutex<Vec<Report>> = Mutex::new(Vec::new());

fn campaign(backend: Backend) {
    let parallel = std::env::var("FAULT_PARALLEL").is_ok_and(|v| v == "1");
    let _turn = (!parallel).then(|| {
        ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    });
    let (faults, seed) = schedule(backend);
    if let Some(seed) = seed {
        eprintln!(
            "{}: {} faults shuffled with FAULT_SEED={seed}",
            backend.name(),
            faults.len()
        );
    }
    let programs = Programs {
        leader: PathBuf::from(env!("CARGO_BIN_EXE_leader-e2e")),
        writer: PathBuf::from(env!("CARGO_BIN_EXE_fenced-writer")),
    };
    let Some(report) = run_or_skip(
        &format!("the {} campaign", backend.name()),
        campaign::run(backend, &faults, settings(), &programs, &database_url()),
    ) else {
        return;
    };
    let mut reports = REPORTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    reports.push(report.clone());
    reports.sort_by_key(|r| r.backend);
    eprintln!(
        "{}: recoveries {:?}; frozen leaders stopped their COMMAND {:?} after SIGCONT\n\n{}",
        backend.name(),
        report.recoveries,
        report.resumed_stops,
        Report::table(&reports)
    );
    assert!(
        report.violations.is_empty(),
        "{}: {:#?}",
        backend.name(),
        report.violations
    );
    assert_eq!(
        report.recoveries.len(),
        faults.len(),
        "every fault injected"
    );
    assert!(report.stale_refused > 0, "the fence was exercised");
}

#[test]
fn faults_on_the_file_lock() {
    campaign(Backend::File);
}

#[test]
fn faults_on_postgres() {
    campaign(Backend::Postgres);
}

#[test]
fn faults_on_redis() {
    campaign(Backend::Redis);
}

#[test]
fn faults_on_etcd() {
    campaign(Backend::Etcd);
}
