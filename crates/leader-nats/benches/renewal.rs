//! Requests and stream writes per renewal of the key-value lock, and its latency against two
//! raw references on the same connection: a request the server answers itself (JetStream's
//! `$JS.API.INFO`, its reply left unparsed) and a plain key-value `put` (a JetStream publish
//! and its acknowledgement).
//!
//! ```text
//! NATS_URL=nats://127.0.0.1:4222 cargo bench -p leader-nats --bench renewal
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use leader_core::ResourceLock;
use leader_nats::NatsStore;
use leader_test_support::bench;

// Short interleaved rounds, so that drift in the machine's speed hits all rows alike.
const ROUNDS: usize = 200;
const PER_ROUND: usize = 25;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = leader_test_support::nats_url();
    let store = NatsStore::builder(&url)
        .bucket(leader_test_support::nats_bucket())
        .create_bucket(true)
        .build()
        .await?;
    let name = format!("bench-{:08x}", fastrand::u32(..));

    // 1. Requests per renewal as the elector makes them: a real elector on a counting wrapper.
    let (renewals, requests_per_renewal) = bench::elector_requests_per_renewal(
        store.lock(&name, "bench"),
        Duration::from_millis(600),
        Duration::from_millis(400),
        Duration::from_millis(20),
        Duration::from_secs(3),
    )
    .await?;

    // 2. Writes per renewal on the server: the bucket's stream sequence over N renewals.
    let lock = store.lock(&name, "bench");
    // The elector released it; take it as a candidate would (this lock has no store-clock
    // acquisition: candidates decide expiry on their own clock).
    let released = lock.get().await?.ok_or("the elector left no record")?;
    let mut observed = lock
        .update(
            &released.version,
            &bench::renewed(&leader_core::conformance::record(
                "bench",
                released.record.leader_transitions + 1,
            )),
        )
        .await?;
    assert!(observed.record.is_held_by("bench"));
    let kv = store.kv().await?;
    let sequence = || async { kv.stream.get_info().await.map(|i| i.state.last_sequence) };
    let before = sequence().await?;
    const N: u32 = 1000;
    for _ in 0..N {
        observed = lock
            .update(&observed.version, &bench::renewed(&observed.record))
            .await?;
    }
    let writes = (sequence().await? - before) as f64 / f64::from(N);

    // 3. Latency against the raw references on the same connection.
    let plain = format!("{name}-plain");
    let (mut t_ping, mut t_put, mut t_renew) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            store.client().request("$JS.API.INFO", "".into()).await?;
            t_ping.push(at.elapsed());
        }
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            kv.put(plain.as_str(), "x".into()).await?;
            t_put.push(at.elapsed());
        }
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            observed = lock
                .update(&observed.version, &bench::renewed(&observed.record))
                .await?;
            t_renew.push(at.elapsed());
        }
    }
    kv.purge(lock.key()).await?;
    kv.purge(plain.as_str()).await?;

    println!(
        "key-value lock renewal on {} (server {})",
        leader_nats::redact_url(&url),
        store.client().server_info().version
    );
    println!(
        "requests per renewal (elector, {renewals} renewals in 3 s): {requests_per_renewal:.2}"
    );
    println!("stream writes per renewal (server, {N} renewals): {writes:.2}");
    println!();
    bench::print_latencies(
        "operation (same connection)",
        1,
        &mut [
            ("server round trip (`$JS.API.INFO`)", t_ping),
            ("key-value `put`", t_put),
            ("renewal (`NatsLock::update`)", t_renew),
        ],
    );
    Ok(())
}
