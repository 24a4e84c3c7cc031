//! Requests per renewal and renewal latency of the Consul lock, against the test Consul server
//! of `leader-test-support` (no agent runs here; with `CONSUL_HTTP_ADDR` set, against that
//! agent instead, where the server's own count is not available), and against the lock's read
//! (one read-only transaction of the record and renewal keys) as the raw round trip.
//!
//! ```text
//! cargo bench -p leader-consul --bench renewal
//! CONSUL_HTTP_ADDR=http://127.0.0.1:8500 cargo bench -p leader-consul --bench renewal
//! ```

use std::error::Error;

use leader_consul::ConsulStore;
use leader_core::ResourceLock;
use leader_test_support::bench::{self, Rewrite};
use leader_test_support::consul_api::ConsulApiServer;

// Short interleaved rounds, so that drift in the machine's speed hits all rows alike.
const ROUNDS: usize = 100;
const PER_ROUND: usize = 20;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    let agent = std::env::var("CONSUL_HTTP_ADDR").ok();
    let server = match agent {
        Some(_) => None,
        None => Some(ConsulApiServer::start().await),
    };
    let address = agent.unwrap_or_else(|| {
        server
            .as_ref()
            .map(ConsulApiServer::url)
            .unwrap_or_default()
    });
    let store = ConsulStore::builder(&address)
        .token(std::env::var("CONSUL_HTTP_TOKEN").unwrap_or_default())
        .prefix(format!("leader-bench-{:08x}/", fastrand::u32(..)))
        .build()?;
    let name = "renewal";

    // 1. Requests per renewal as the elector makes them: a real elector on a counting wrapper.
    // It released the lease on shutdown: taken again, what follows are renewals by the holder.
    let lock = store.lock(name, "bench")?;
    let (elector, mut observed) =
        bench::elected_then_held(store.lock(name, "bench")?, bench::SHORT, &lock).await?;

    // 2. HTTP requests per renewal on the server, by its own count.
    const N: usize = 500;
    let before = server.as_ref().map(ConsulApiServer::requests);
    bench::rewrites(&lock, &mut observed, N, Rewrite::Renew).await?;
    let on_server = server.as_ref().zip(before).map(|(server, before)| {
        let after = server.requests();
        let mut by_kind: Vec<String> = after
            .iter()
            .filter_map(|(endpoint, count)| {
                let added = count - before.get(endpoint).copied().unwrap_or(0);
                (added > 0).then(|| format!("{endpoint} {:.2}", added as f64 / N as f64))
            })
            .collect();
        by_kind.sort();
        let total: usize = after.values().sum::<usize>() - before.values().sum::<usize>();
        (total as f64 / N as f64, by_kind.join(", "))
    });

    // 3. Latency against a plain read of the key through the same client.
    let (mut t_read, mut t_renew) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        bench::time_each(PER_ROUND, &mut t_read, async || lock.get().await).await?;
        t_renew.extend(bench::rewrites(&lock, &mut observed, PER_ROUND, Rewrite::Renew).await?);
    }
    lock.close().await;

    match &server {
        Some(_) => println!("consul lock renewal on the test Consul server ({address})"),
        None => println!("consul lock renewal on the agent at {address}"),
    }
    elector.print();
    if let Some((total, by_kind)) = on_server {
        println!("HTTP requests per renewal (server, {N} renewals): {total:.2} ({by_kind})");
    }
    println!();
    bench::print_latencies(
        "operation (same client)",
        0,
        &mut [
            (
                "read of both keys (`ConsulLock::get`: a read transaction)",
                t_read,
            ),
            (
                "renewal (`ConsulLock::renew`: a transaction writing the renewal key)",
                t_renew,
            ),
        ],
    );
    Ok(())
}
