//! Handover after a release: the leader shuts down (releasing the lease), the time until the
//! follower leads, p50/p99 over many handovers, per backend. The elector's timings are the
//! conformance suite's (lease 3 s, renew deadline 2 s, retry period 500 ms): without change
//! notifications a handover would wait for the follower's next attempt.
//!
//! ```text
//! cargo bench -p leader-tests --bench handover            # 200 handovers per backend
//! HANDOVERS=1000 cargo bench -p leader-tests --bench handover
//! ```

mod common;

use std::time::{Duration, Instant};

use common::{Backend, ms, percentile};
use leader_test_support::Candidate;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let handovers: usize = common::knob("HANDOVERS", 200);
    println!("| backend | handovers | p50 | p99 | max |");
    println!("|---|---|---|---|---|");
    for backend in Backend::available().await {
        let name = format!("handover-{:08x}", fastrand::u32(..));
        let mut leader = Candidate::start(backend.lock(&name, "c0"));
        leader.wait_leading(Duration::from_secs(10)).await;
        let mut follower = Candidate::start(backend.lock(&name, "c1"));
        let mut samples = Vec::with_capacity(handovers);
        for i in 2..handovers + 2 {
            // The follower has read the record and subscribed to its changes.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let released = Instant::now();
            leader.shutdown.cancel();
            follower.wait_leading(Duration::from_secs(10)).await;
            samples.push(released.elapsed());
            leader
                .task
                .await
                .expect("elector")
                .expect("the elector ran");
            leader = follower;
            follower = Candidate::start(backend.lock(&name, &format!("c{i}")));
        }
        leader.stop().await;
        follower.stop().await;
        samples.sort();
        println!(
            "| {} | {} | {} | {} | {} |",
            backend.name(),
            samples.len(),
            ms(percentile(&samples, 50)),
            ms(percentile(&samples, 99)),
            ms(*samples.last().expect("samples"))
        );
    }
}
