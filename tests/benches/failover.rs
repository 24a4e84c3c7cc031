//! Failover after SIGKILL: the fault harness's replicas (`leader run -- fenced-writer`, three per
//! backend, lease 2 s, renew deadline 1.5 s, retry period 250 ms), the leader SIGKILLed again and
//! again; the time from the kill to the next leader's COMMAND starting, against the lease. Needs
//! the Postgres of `DATABASE_URL` (the fenced sink) and the server binaries (`scripts/setup`).
//!
//! ```text
//! cargo bench -p leader-tests --bench failover            # 20 kills per backend
//! KILLS=100 cargo bench -p leader-tests --bench failover
//! BENCH_BACKENDS=redis,object cargo bench -p leader-tests --bench failover   # only these
//! ```

mod common;

use std::time::Duration;

use common::{database_url, ms, percentile};
use leader_tests::harness::campaign::{self, Fault, Settings};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let kills: usize = common::knob("KILLS", 20);
    let programs = leader_tests::programs!();
    let settings = Settings::default();
    println!("| backend | kills | lease | p50 | p99 | max | max - lease | overlaps | violations |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let (faults, sink) = (vec![Fault::Kill; kills], database_url());
    for backend in common::harness_backends() {
        let Ok(report) = campaign::run(backend, &faults, settings, &programs, &sink)
            .await
            .inspect_err(|err| eprintln!("{}: {err}", backend.name()))
        else {
            continue;
        };
        let mut samples: Vec<Duration> = report.recoveries.iter().filter_map(|(_, d)| *d).collect();
        samples.sort();
        let max = samples.last().copied().unwrap_or_default();
        println!(
            "| {} | {} | {} | {} | {} | {} | {:+.0} ms | {} | {} |",
            backend.name(),
            samples.len(),
            ms(settings.lease),
            ms(percentile(&samples, 50)),
            ms(percentile(&samples, 99)),
            ms(max),
            (max.as_secs_f64() - settings.lease.as_secs_f64()) * 1e3,
            report.overlaps,
            report.violations.len()
        );
        for violation in &report.violations {
            eprintln!("{}: {violation}", backend.name());
        }
    }
}
