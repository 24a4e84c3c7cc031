//! Requests per renewal and renewal latency of the etcd lock, against a raw linearizable `get`
//! on the same client.
//!
//! ```text
//! ETCD_ENDPOINTS=http://127.0.0.1:2379 cargo bench -p leader-etcd --bench renewal
//! ```
//!
//! Requests are counted on the server: the sum of etcd's `grpc_server_msg_received_total` over
//! every method (a unary call or a message on a stream, such as a lease keep-alive, is one).

use std::error::Error;
use std::time::Duration;

use leader_etcd::EtcdStore;
use leader_test_support::bench::{self, Rewrite};

// Short interleaved rounds, so that drift in the machine's speed hits both rows alike.
const ROUNDS: usize = 100;
const PER_ROUND: usize = 25;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let endpoint = bench::etcd_endpoint();
    let store = EtcdStore::connect([endpoint.as_str()]).await?;
    let name = leader_test_support::unique("bench");

    // 1. Lock requests per renewal as the elector makes them: a real elector on a counting wrapper.
    let timings = bench::Timings {
        lease_duration: Duration::from_millis(2600),
        renew_deadline: Duration::from_millis(1000),
        retry_period: Duration::from_millis(50),
    };
    // It released the lease on shutdown: taken again, what follows are renewals by the holder.
    let lock = store.lock(&name, "bench");
    let (elector, mut observed) =
        bench::elected_then_held(store.lock(&name, "bench"), timings, &lock).await?;

    // 2. Requests per renewal on the server.
    const N: usize = 500;
    let start = bench::etcd_messages_received(&endpoint)?;
    bench::rewrites(&lock, &mut observed, N, Rewrite::Renew).await?;
    let server_requests_per_renewal =
        (bench::etcd_messages_received(&endpoint)? - start) as f64 / N as f64;

    // 3. Latency against a raw linearizable get of the same key, on the same client.
    let mut client = store.client().await.expect("etcd client");
    let (mut t_get, mut t_renew) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        bench::time_each(PER_ROUND, &mut t_get, async || {
            client.get(lock.key(), None).await
        })
        .await?;
        t_renew.extend(bench::rewrites(&lock, &mut observed, PER_ROUND, Rewrite::Renew).await?);
    }
    client.delete(lock.key(), None).await?;

    println!("etcd lock renewal on {endpoint}");
    elector.print();
    println!("server requests per renewal ({N} renewals): {server_requests_per_renewal:.2}");
    println!();
    bench::print_latencies(
        "operation (same client)",
        0,
        &mut [
            ("linearizable `get`", t_get),
            ("renewal (`EtcdLock::renew`: the keep-alive)", t_renew),
        ],
    );
    Ok(())
}
