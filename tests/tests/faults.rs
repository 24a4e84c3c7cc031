//! Faults across backends: three replicas of `leader run -- fenced-writer` on the file lock and,
//! through a TCP proxy each, on private Postgres, Redis and etcd servers; into whichever replica
//! leads: SIGKILL, SIGSTOP past the lease then SIGCONT, its network cut, a latency spike beyond
//! the renew deadline, and the server crashed and restarted. The checker asserts that no two
//! terms overlapped (`CLOCK_MONOTONIC` intervals), that fencing tokens grew, that the fenced sink
//! accepted no stale write (and refused the frozen leaders' ones), and that a leader was back
//! within the bound after every fault.
//!
//! By default one round (each fault once per backend). The long run: `FAULT_ROUNDS=20 cargo
//! test -p leader-tests --release --test faults -- --nocapture`; every run prints a summary
//! table. Needs the Postgres of `DATABASE_URL` for the sink, and Debian's PostgreSQL,
//! `redis-server` and `etcd` binaries for the private servers (`scripts/setup` installs them).

use std::path::PathBuf;
use std::sync::Mutex;

use leader_test_support::in_ci;
use leader_tests::database_url;
use leader_tests::harness::campaign::{self, Backend, Fault, Programs, Report, Settings};

fn rounds() -> usize {
    std::env::var("FAULT_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1)
}

/// One campaign at a time: they time failovers on a two-core machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Every report so far, for the summary table.
static REPORTS: Mutex<Vec<Report>> = Mutex::new(Vec::new());

fn campaign(backend: Backend) {
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let faults: Vec<Fault> = (0..rounds())
        .flat_map(|_| backend.faults().iter().copied())
        .collect();
    let programs = Programs {
        leader: PathBuf::from(env!("CARGO_BIN_EXE_leader-e2e")),
        writer: PathBuf::from(env!("CARGO_BIN_EXE_fenced-writer")),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let report = match runtime.block_on(campaign::run(
        backend,
        &faults,
        Settings::default(),
        &programs,
        &database_url(),
    )) {
        Ok(report) => report,
        Err(err) if !in_ci() => {
            eprintln!("skipping {}: {err}", backend.name());
            return;
        }
        Err(err) => panic!(
            "CI=true and the {} campaign cannot run: {err}",
            backend.name()
        ),
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
