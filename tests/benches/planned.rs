//! Planned handover against the alternative users have without it: three candidates per backend
//! (lease 3 s, renew deadline 2 s, retry period 500 ms).
//!
//! - Planned: a handover request (`request_handover`, as `leader handover` writes it) names a
//!   follower chosen at random; measured from the request to the named follower leading.
//! - Stop and hope: the leader shuts down (releasing its lease), hoping that the chosen follower
//!   takes over; measured from the shutdown to whoever leads next, and how often it was the one
//!   wanted.
//!
//! ```text
//! cargo bench -p leader-tests --bench planned            # 100 of each per backend
//! HANDOVERS=500 cargo bench -p leader-tests --bench planned
//! ```

mod common;

use std::time::{Duration, Instant};

use common::{Backend, ms, percentile};
use leader_core::request_handover;
use leader_test_support::Candidate;

/// Waits until one of `candidates` leads with a token above `after`; its index and token.
async fn next_leader(candidates: &[Candidate], after: u64) -> (usize, u64) {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            for (i, candidate) in candidates.iter().enumerate() {
                if let Some(token) = candidate.leading_token()
                    && token > after
                {
                    return (i, token);
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("a leader within 20 s")
}

fn summary(samples: &mut [Duration]) -> (String, String) {
    samples.sort();
    (ms(percentile(samples, 50)), ms(percentile(samples, 99)))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds: usize = common::knob("HANDOVERS", 100);
    println!(
        "| backend | planned: p50 | p99 | the named one led | stop and hope: p50 | p99 | the wanted one led |"
    );
    println!("|---|---|---|---|---|---|---|");
    for backend in Backend::available().await {
        let name = format!("planned-{:08x}", fastrand::u32(..));
        let operator = backend.lock(&name, "operator");
        let mut candidates: Vec<Candidate> = (0..3)
            .map(|i| Candidate::start(backend.lock(&name, &format!("c{i}"))))
            .collect();
        let (mut leader, mut token) = next_leader(&candidates, 0).await;

        let mut planned = Vec::with_capacity(rounds);
        let mut named_won = 0;
        for _ in 0..rounds {
            // The followers have read the record and subscribed to its changes.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let target = (leader + 1 + fastrand::usize(..2)) % candidates.len();
            let asked = Instant::now();
            request_handover(&*operator, &format!("c{target}"))
                .await
                .expect("request");
            (leader, token) = next_leader(&candidates, token).await;
            planned.push(asked.elapsed());
            named_won += usize::from(leader == target);
        }

        let mut hoped = Vec::with_capacity(rounds);
        let mut wanted_won = 0;
        for round in 0..rounds {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let wanted = (leader + 1 + fastrand::usize(..2)) % candidates.len();
            let stopped = Instant::now();
            candidates[leader].shutdown.cancel();
            let (next, next_token) = next_leader(&candidates, token).await;
            hoped.push(stopped.elapsed());
            wanted_won += usize::from(next == wanted);
            // The stopped candidate comes back under a new identity, as a restarted replica.
            let restarted = Candidate::start(backend.lock(&name, &format!("r{round}")));
            std::mem::replace(&mut candidates[leader], restarted)
                .stop()
                .await;
            (leader, token) = (next, next_token);
        }
        for candidate in candidates {
            candidate.stop().await;
        }
        let (planned_p50, planned_p99) = summary(&mut planned);
        let (hoped_p50, hoped_p99) = summary(&mut hoped);
        println!(
            "| {} | {planned_p50} | {planned_p99} | {named_won} of {rounds} | {hoped_p50} | {hoped_p99} | {wanted_won} of {rounds} |",
            backend.name()
        );
    }
}
