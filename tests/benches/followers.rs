//! The load followers put on the backend: one leader and 1, 10 or 100 followers on one election
//! for a window, counting the lock requests every elector made (client side) and the requests
//! the server handled (its own counter; other clients of the server count too, so run it on a
//! quiet server). Timings: lease 4 s, renew deadline 3 s, retry period 1 s.
//!
//! ```text
//! cargo bench -p leader-tests --bench followers
//! WINDOW_SECS=30 cargo bench -p leader-tests --bench followers
//! ```

mod common;

use std::time::{Duration, Instant};

use common::Backend;
use leader_core::faults::FaultyLock;
use leader_core::{CancellationToken, LeaderElector};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let window = Duration::from_secs(common::knob("WINDOW_SECS", 10));
    println!(
        "| backend | followers | lock requests/s | per follower/s | server requests/s | leader renewals/s |"
    );
    println!("|---|---|---|---|---|---|");
    for backend in Backend::available().await {
        for followers in [1_usize, 10, 100] {
            let name = format!("followers-{:08x}", fastrand::u32(..));
            let shutdown = CancellationToken::new();
            let mut calls = Vec::new();
            let mut tasks = Vec::new();
            for i in 0..=followers {
                let counted = FaultyLock::new(backend.lock(&name, &format!("e{i}")));
                calls.push(counted.faults());
                let elector = LeaderElector::builder(counted)
                    .lease_duration(Duration::from_secs(4))
                    .renew_deadline(Duration::from_secs(3))
                    .retry_period(Duration::from_secs(1))
                    .build()
                    .expect("timings");
                let mut state = elector.subscribe();
                tasks.push(tokio::spawn(elector.run(shutdown.clone())));
                if i == 0 {
                    // The first one leads; the others follow it.
                    state
                        .wait_for(leader_core::LeaderState::is_leading)
                        .await
                        .expect("leads");
                }
            }
            // Let the followers settle into their rhythm.
            tokio::time::sleep(Duration::from_secs(2)).await;
            // The server's count first: reading it takes a second on Postgres.
            let server_before = backend.server_requests().await;
            let before: Vec<usize> = calls.iter().map(|c| c.calls().len()).collect();
            let started = Instant::now();
            tokio::time::sleep(window).await;
            let elapsed = started.elapsed().as_secs_f64();
            let counts: Vec<usize> = calls.iter().map(|c| c.calls().len()).collect();
            let leader_calls = calls[0].calls()[before[0]..counts[0]]
                .iter()
                .filter(|c| c.operation == "renew")
                .count();
            let server_after = backend.server_requests().await;
            let follower_calls: usize = counts[1..]
                .iter()
                .zip(&before[1..])
                .map(|(after, before)| after - before)
                .sum();
            let total = (counts[0] - before[0] + follower_calls) as f64;
            // The server's count spans the stats reads too (about a second more for Postgres).
            let server = match (server_before, server_after) {
                (Some(b), Some(a)) => format!(
                    "{:.1}",
                    a.saturating_sub(b) as f64 / (started.elapsed().as_secs_f64())
                ),
                _ => "n/a".to_owned(),
            };
            println!(
                "| {} | {followers} | {:.1} | {:.2} | {server} | {:.2} |",
                backend.name(),
                total / elapsed,
                follower_calls as f64 / elapsed / followers as f64,
                leader_calls as f64 / elapsed
            );
            shutdown.cancel();
            for task in tasks {
                let _ = task.await;
            }
        }
    }
}
