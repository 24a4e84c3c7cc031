//! Commands per renewal and renewal latency of the Redis lock, against the raw `PING` and
//! `SET key value PX ttl` round trips on the same connection.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo bench -p leader-redis --bench renewal
//! ```

use std::error::Error;

use leader_redis::RedisStore;
use leader_test_support::bench::{self, Rewrite};

// Short interleaved rounds, so that drift in the machine's speed hits all rows alike.
const ROUNDS: usize = 200;
const PER_ROUND: usize = 25;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = leader_test_support::redis_url();
    let store = RedisStore::connect(&url).await?;
    let name = leader_test_support::unique("bench");

    // 1. Requests per renewal as the elector makes them: a real elector on a counting wrapper.
    // It released the lease on shutdown: taken again, what follows are renewals by the holder.
    let lock = store.lock(&name, "bench");
    let (elector, mut observed) =
        bench::elected_then_held(store.lock(&name, "bench"), bench::SHORT, &lock).await?;

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
    const N: usize = 1000;
    bench::rewrites(&lock, &mut observed, N, Rewrite::Renew).await?;
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
        bench::time_each(PER_ROUND, &mut t_ping, async || {
            redis::cmd("PING")
                .query_async::<String>(&mut connection)
                .await
        })
        .await?;
        bench::time_each(PER_ROUND, &mut t_set, async || {
            redis::cmd("SET")
                .arg(&plain_key)
                .arg("x")
                .arg("PX")
                .arg(ttl)
                .query_async::<()>(&mut connection)
                .await
        })
        .await?;
        t_renew.extend(bench::rewrites(&lock, &mut observed, PER_ROUND, Rewrite::Renew).await?);
    }
    let _: () = redis::cmd("DEL")
        .arg(&plain_key)
        .arg(lock.key())
        .query_async(&mut connection)
        .await?;

    println!("redis lock renewal on {}", store.redacted_url());
    elector.print();
    println!("commands sent per renewal (server, {N} renewals): {sent_per_renewal:.2}");
    println!("commands run inside the script per renewal: {inside_per_renewal:.2}");
    println!();
    bench::print_latencies(
        "operation (same connection)",
        0,
        &mut [
            ("`PING`", t_ping),
            ("`SET key value PX ttl`", t_set),
            ("renewal (`RedisLock::renew`, one `EVALSHA`)", t_renew),
        ],
    );
    Ok(())
}
