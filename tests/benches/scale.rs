//! One process holding many elections (distinct names, one elector each) on one Postgres pool
//! (16 connections) and on one Redis connection, with client-go's default timings (lease 15 s,
//! renew deadline 10 s, retry period 2 s). After every elector leads, a window in which we
//! measure the process's CPU and memory, the server's requests per second, the renewal latency
//! of one probe election among them, and whether any elector lost its term (a renewal that
//! missed its deadline).
//!
//! ```text
//! cargo bench -p leader-tests --bench scale                 # 1,000 and 10,000 elections
//! ELECTIONS=50000 WINDOW_SECS=60 cargo bench -p leader-tests --bench scale
//! ```

mod common;

use std::time::{Duration, Instant};

use common::{Backend, cpu_time, memory_kb, ms, percentile};
use leader_core::faults::FaultyLock;
use leader_core::{CancellationToken, LeaderElector, LeaderState};

const LEASE: Duration = Duration::from_secs(15);
const RENEW: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(2);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let sizes: Vec<usize> = std::env::var("ELECTIONS")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 10_000]);
    let window = Duration::from_secs(common::knob("WINDOW_SECS", 30));
    println!(
        "| backend | elections | all leading after | CPU (cores) | RSS | server requests/s | probe renewal p50 / p99 / max | terms lost |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for backend in Backend::available().await {
        if !matches!(backend, Backend::Postgres(_) | Backend::Redis(_)) {
            continue;
        }
        for &elections in &sizes {
            let run = format!("scale-{:08x}", fastrand::u32(..));
            let shutdown = CancellationToken::new();
            let mut states = Vec::with_capacity(elections);
            let mut tasks = Vec::with_capacity(elections);
            let mut probe = None;
            let started = Instant::now();
            for i in 0..elections {
                let lock = backend.lock(&format!("{run}-{i}"), "scale");
                let builder = if i == 0 {
                    let counted = FaultyLock::new(lock);
                    probe = Some(counted.faults());
                    LeaderElector::builder(counted)
                } else {
                    LeaderElector::builder(lock)
                };
                let elector = builder
                    .lease_duration(LEASE)
                    .renew_deadline(RENEW)
                    .retry_period(RETRY)
                    .build()
                    .expect("timings");
                states.push(elector.subscribe());
                tasks.push(tokio::spawn(elector.run(shutdown.clone())));
            }
            let mut terms = Vec::with_capacity(elections);
            for state in &mut states {
                let leading = tokio::time::timeout(
                    Duration::from_secs(120),
                    state.wait_for(LeaderState::is_leading),
                )
                .await;
                if let Ok(Ok(state)) = leading {
                    terms.push(state.leadership().map(|l| l.cancellation_token()));
                } else {
                    terms.push(None);
                }
            }
            let all_leading = started.elapsed();
            let probe = probe.expect("probe");
            let probe_before = probe.calls().len();
            let server_before = backend.server_requests().await;
            let cpu_before = cpu_time();
            let window_started = Instant::now();
            tokio::time::sleep(window).await;
            let cpu = cpu_time().saturating_sub(cpu_before);
            let elapsed = window_started.elapsed();
            let rss = memory_kb("VmRSS");
            let server_after = backend.server_requests().await;
            let lost = terms
                .iter()
                .filter(|t| t.as_ref().is_none_or(CancellationToken::is_cancelled))
                .count();
            let mut renewals: Vec<Duration> = probe.calls()[probe_before..]
                .iter()
                .filter(|c| c.operation == "renew")
                .filter_map(|c| Some(c.returned?.duration_since(c.sent)))
                .collect();
            renewals.sort();
            let server = match (server_before, server_after) {
                (Some(b), Some(a)) => format!(
                    "{:.0}",
                    a.saturating_sub(b) as f64 / window_started.elapsed().as_secs_f64()
                ),
                _ => "n/a".to_owned(),
            };
            println!(
                "| {} | {elections} | {:.1} s | {:.2} | {} MiB | {server} | {} / {} / {} | {lost} |",
                backend.name(),
                all_leading.as_secs_f64(),
                cpu.as_secs_f64() / elapsed.as_secs_f64(),
                rss / 1024,
                ms(percentile(&renewals, 50)),
                ms(percentile(&renewals, 99)),
                ms(renewals.last().copied().unwrap_or_default()),
            );
            shutdown.cancel();
            for task in tasks {
                let _ = task.await;
            }
        }
    }
}
