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
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use leader_core::faults::FaultyLock;
use leader_core::{
    Acquisition, CancellationToken, LeaderElectionRecord, LeaderElector, ResourceLock,
};
use leader_etcd::EtcdStore;

// Short interleaved rounds, so that drift in the machine's speed hits both rows alike.
const ROUNDS: usize = 100;
const PER_ROUND: usize = 25;

/// Requests the server has received so far, from its `/metrics` on the client port.
fn received(endpoint: &str) -> Result<u64, Box<dyn Error>> {
    let authority = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = std::net::TcpStream::connect(authority)?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {authority}\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    Ok(body
        .lines()
        .filter(|line| line.starts_with("grpc_server_msg_received_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let endpoint = std::env::var("ETCD_ENDPOINTS")
        .unwrap_or_else(|_| "http://127.0.0.1:2379".into())
        .split(',')
        .next()
        .unwrap_or_default()
        .to_owned();
    let store = EtcdStore::connect([endpoint.as_str()]).await?;
    let name = format!("bench-{:08x}", fastrand::u32(..));

    // 1. Lock requests per renewal as the elector makes them: a real elector on a counting wrapper.
    let counted = FaultyLock::new(store.lock(&name, "bench"));
    let calls = counted.faults();
    let elector = LeaderElector::builder(counted)
        .lease_duration(Duration::from_millis(2600))
        .renew_deadline(Duration::from_millis(1000))
        .retry_period(Duration::from_millis(50))
        .build()?;
    let mut state = elector.subscribe();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(elector.run(shutdown.clone()));
    state.wait_for(|s| s.is_leading()).await?;
    let before = calls.calls().len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let window: Vec<_> = calls.calls()[before..].to_vec();
    shutdown.cancel();
    running.await?;
    let renewals = window
        .iter()
        .filter(|c| c.operation == "update" && c.ok == Some(true))
        .count();
    let lock_calls_per_renewal = window.len() as f64 / renewals.max(1) as f64;

    // The elector released the lease on shutdown: take it again, so that what follows are
    // renewals by the holder.
    let lock = store.lock(&name, "bench");
    let desired = renewed(&leader_core::conformance::record("bench", 0));
    let mut observed = match lock.try_acquire(&desired).await? {
        Some(Acquisition::Acquired(observed)) => observed,
        other => return Err(format!("could not take the lease again: {other:?}").into()),
    };

    // 2. Requests per renewal on the server.
    const N: u64 = 500;
    let start = received(&endpoint)?;
    for _ in 0..N {
        observed = lock
            .update(&observed.version, &renewed(&observed.record))
            .await?;
    }
    let server_requests_per_renewal = (received(&endpoint)? - start) as f64 / N as f64;

    // 3. Latency against a raw linearizable get of the same key, on the same client.
    let mut client = store.client();
    let (mut t_get, mut t_renew) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            client.get(lock.key(), None).await?;
            t_get.push(at.elapsed());
        }
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            observed = lock
                .update(&observed.version, &renewed(&observed.record))
                .await?;
            t_renew.push(at.elapsed());
        }
    }
    client.delete(lock.key(), None).await?;

    println!("etcd lock renewal on {endpoint}");
    println!(
        "lock requests per renewal (elector, {renewals} renewals in 3 s): {lock_calls_per_renewal:.2}"
    );
    println!("server requests per renewal ({N} renewals): {server_requests_per_renewal:.2}");
    println!();
    println!("| operation (same client) | mean | p50 | p99 | mean vs get | p50 vs get |");
    println!("|---|---|---|---|---|---|");
    let get_mean = mean(&t_get);
    let get_p50 = {
        let mut sorted = t_get.clone();
        sorted.sort();
        sorted[sorted.len() / 2]
    };
    for (label, samples) in [
        ("linearizable `get`", &mut t_get),
        (
            "renewal (`EtcdLock::update`: keep-alive + txn, concurrently)",
            &mut t_renew,
        ),
    ] {
        let m = mean(samples);
        samples.sort();
        let p50 = samples[samples.len() / 2];
        println!(
            "| {label} | {} | {} | {} | {:.2}x | {:.2}x |",
            us(m),
            us(p50),
            us(samples[samples.len() * 99 / 100]),
            m.as_secs_f64() / get_mean.as_secs_f64(),
            p50.as_secs_f64() / get_p50.as_secs_f64()
        );
    }
    Ok(())
}

fn renewed(record: &LeaderElectionRecord) -> LeaderElectionRecord {
    LeaderElectionRecord {
        renew_time: chrono::Utc::now(),
        ..record.clone()
    }
}

fn mean(samples: &[Duration]) -> Duration {
    samples.iter().sum::<Duration>() / samples.len() as u32
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}
