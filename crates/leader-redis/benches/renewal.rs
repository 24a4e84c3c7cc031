//! Commands per renewal and renewal latency of the Redis lock, against the raw `PING` and
//! `SET key value PX ttl` round trips on the same connection.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo bench -p leader-redis --bench renewal
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use leader_core::faults::FaultyLock;
use leader_core::{
    Acquisition, CancellationToken, LeaderElectionRecord, LeaderElector, ResourceLock,
};
use leader_redis::RedisStore;

// Short interleaved rounds, so that drift in the machine's speed hits all rows alike.
const ROUNDS: usize = 200;
const PER_ROUND: usize = 25;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let store = RedisStore::connect(&url).await?;
    let name = format!("bench-{:08x}", fastrand::u32(..));

    // 1. Requests per renewal as the elector makes them: a real elector on a counting wrapper.
    let counted = FaultyLock::new(store.lock(&name, "bench"));
    let calls = counted.faults();
    let elector = LeaderElector::builder(counted)
        .lease_duration(Duration::from_millis(600))
        .renew_deadline(Duration::from_millis(400))
        .retry_period(Duration::from_millis(20))
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
    let requests_per_renewal = window.len() as f64 / renewals.max(1) as f64;

    // The elector released the lease on shutdown: take it again, so that what follows are
    // renewals by the holder.
    let lock = store.lock(&name, "bench");
    let mut observed = match lock
        .try_acquire(&renewed(&leader_core::conformance::record("bench", 0)))
        .await?
    {
        Some(Acquisition::Acquired(observed)) => observed,
        other => return Err(format!("could not take the lease again: {other:?}").into()),
    };

    // 2. Commands per renewal on the server, from INFO commandstats before and after. Redis
    //    counts the commands a script runs inside it too: report those apart from what the
    //    client sent (the script invocations).
    let mut connection = store.connection();
    let stats = async |connection: &mut redis::aio::ConnectionManager| -> Result<(u64, u64), Box<dyn Error>> {
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(connection).await?;
        let (mut scripts, mut all) = (0, 0);
        for line in info.lines() {
            let Some((name, rest)) = line.split_once(":calls=") else { continue };
            let calls: u64 = rest.split(',').next().unwrap_or("0").parse()?;
            all += calls;
            if name == "cmdstat_evalsha" || name == "cmdstat_eval" {
                scripts += calls;
            }
        }
        Ok((scripts, all))
    };
    let (scripts_before, all_before) = stats(&mut connection).await?;
    const N: u64 = 1000;
    for _ in 0..N {
        observed = lock
            .update(&observed.version, &renewed(&observed.record))
            .await?;
    }
    let (scripts_after, all_after) = stats(&mut connection).await?;
    let sent_per_renewal = (scripts_after - scripts_before) as f64 / N as f64;
    // The first INFO itself counts once among all commands.
    let inside_per_renewal =
        (all_after - all_before - 1 - (scripts_after - scripts_before)) as f64 / N as f64;

    // 3. Latency against the raw references on the same connection.
    let ttl = observed.record.lease_duration.as_millis() as u64;
    let plain_key = format!("leader-bench-plain-{name}");
    let (mut t_ping, mut t_set, mut t_renew) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            let _: String = redis::cmd("PING").query_async(&mut connection).await?;
            t_ping.push(at.elapsed());
        }
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            let _: () = redis::cmd("SET")
                .arg(&plain_key)
                .arg("x")
                .arg("PX")
                .arg(ttl)
                .query_async(&mut connection)
                .await?;
            t_set.push(at.elapsed());
        }
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            observed = lock
                .update(&observed.version, &renewed(&observed.record))
                .await?;
            t_renew.push(at.elapsed());
        }
    }
    let _: () = redis::cmd("DEL")
        .arg(&plain_key)
        .arg(lock.key())
        .query_async(&mut connection)
        .await?;

    println!("redis lock renewal on {}", store.redacted_url());
    println!(
        "requests per renewal (elector, {renewals} renewals in 3 s): {requests_per_renewal:.2}"
    );
    println!("commands sent per renewal (server, {N} renewals): {sent_per_renewal:.2}");
    println!("commands run inside the script per renewal: {inside_per_renewal:.2}");
    println!();
    println!("| operation (same connection) | mean | p50 | p99 | mean vs PING | p50 vs PING |");
    println!("|---|---|---|---|---|---|");
    let ping_mean = mean(&t_ping);
    let ping_p50 = {
        let mut sorted = t_ping.clone();
        sorted.sort();
        sorted[sorted.len() / 2]
    };
    for (label, samples) in [
        ("`PING`", &mut t_ping),
        ("`SET key value PX ttl`", &mut t_set),
        ("renewal (`RedisLock::update`, one `EVALSHA`)", &mut t_renew),
    ] {
        let m = mean(samples);
        samples.sort();
        let p50 = samples[samples.len() / 2];
        println!(
            "| {label} | {} | {} | {} | {:.2}x | {:.2}x |",
            us(m),
            us(p50),
            us(samples[samples.len() * 99 / 100]),
            m.as_secs_f64() / ping_mean.as_secs_f64(),
            p50.as_secs_f64() / ping_p50.as_secs_f64()
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
