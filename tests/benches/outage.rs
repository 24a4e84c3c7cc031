//! Outages: a follower `leader run` waits on each backend while its store is down for 30 s (a
//! proxy closes every connection; on the file lock, the record is unreadable), after the holder
//! was killed. Prints its failed attempts a second over the outage (from its own metrics) and the
//! time to a leader once the store is back. Needs the server binaries (`scripts/setup`).
//!
//! ```text
//! cargo bench -p leader-tests --bench outage              # 30 s per backend
//! OUTAGE_SECS=60 cargo bench -p leader-tests --bench outage
//! ```

mod common;

use std::time::Duration;

use leader_tests::harness::campaign::Backend;
use leader_tests::harness::outage::{self, Timings};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let seconds: u64 = common::knob("OUTAGE_SECS", 30);
    let timings = Timings::default();
    let programs = leader_tests::programs!();
    let mut reports = Vec::new();
    for backend in Backend::ALL {
        match outage::measure(
            backend,
            &programs,
            timings,
            Duration::from_secs(seconds),
            Duration::from_secs(1),
        )
        .await
        {
            Ok(report) => reports.push(report),
            Err(err) => eprintln!("{}: {err}", backend.name()),
        }
    }
    println!("{}", outage::table(&reports, timings));
}
