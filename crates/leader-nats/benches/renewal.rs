//! Requests and stream writes per renewal of the key-value lock, and its latency against two
//! raw references on the same connection: a request the server answers itself (JetStream's
//! `$JS.API.INFO`, its reply left unparsed) and a plain key-value `put` (a JetStream publish
//! and its acknowledgement).
//!
//! ```text
//! NATS_URL=nats://127.0.0.1:4222 cargo bench -p leader-nats --bench renewal
//! ```

use std::error::Error;

use leader_core::ResourceLock;
use leader_nats::NatsStore;
use leader_test_support::bench::{self, Rewrite};

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
    let name = leader_test_support::unique("bench");

    // 1. Requests per renewal as the elector makes them: a real elector on a counting wrapper.
    let elector = bench::elected(store.lock(&name, "bench"), bench::SHORT).await?;

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
    const N: usize = 1000;
    bench::rewrites(&lock, &mut observed, N, Rewrite::Update).await?;
    let writes = (sequence().await? - before) as f64 / N as f64;

    // 3. Latency against the raw references on the same connection.
    let plain = format!("{name}-plain");
    let (mut t_ping, mut t_put, mut t_renew) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        bench::time_each(PER_ROUND, &mut t_ping, async || {
            store.client().request("$JS.API.INFO", "".into()).await
        })
        .await?;
        bench::time_each(PER_ROUND, &mut t_put, async || {
            kv.put(plain.as_str(), "x".into()).await
        })
        .await?;
        t_renew.extend(bench::rewrites(&lock, &mut observed, PER_ROUND, Rewrite::Update).await?);
    }
    kv.purge(lock.key()).await?;
    kv.purge(plain.as_str()).await?;

    println!(
        "key-value lock renewal on {} (server {})",
        leader_nats::redact_url(&url),
        store.client().server_info().version
    );
    elector.print();
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
