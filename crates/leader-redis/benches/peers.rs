//! The Redis lock's renewal against a Redis lock crate users pick (rslock, the Redlock crate, on
//! one server) and a hand-written extend (`GET` + `PEXPIRE` in a script), interleaved in one
//! process on the same server, with the ratios: latency seen by the client, and the server's
//! time in each script (`SLOWLOG` with every command logged, by key).
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo bench -p leader-redis --bench peers
//! ROUNDS=5000 cargo bench -p leader-redis --bench peers
//! ```
//!
//! It sets `slowlog-log-slower-than` to 0 for the run and puts the server's setting back after.

use std::error::Error;
use std::time::{Duration, Instant};

use leader_core::{Acquisition, ResourceLock};
use leader_redis::RedisStore;
use leader_test_support::bench;

const HAND_WRITTEN: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"#;

fn mean(samples: &[Duration]) -> Duration {
    samples.iter().sum::<Duration>() / u32::try_from(samples.len()).unwrap_or(1).max(1)
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = leader_test_support::redis_url();
    let rounds = bench::knob("ROUNDS", 2000);
    let store = RedisStore::connect(url.clone()).await?;
    let mut admin = store.connection();
    let tag = format!("{:08x}", fastrand::u32(..));

    // Ours: the holder of a lease.
    let lock = store.lock(format!("peers-{tag}"), "ours");
    let record = bench::lasting("ours");
    let Some(Acquisition::Acquired(mut held)) = lock.try_acquire(&record).await? else {
        return Err("could not take a free lease".into());
    };
    // rslock's lock on one server.
    let manager = rslock::LockManager::new(vec![url.clone()]);
    let resource = format!("peers-rslock-{tag}");
    let theirs = manager
        .lock(resource.as_bytes(), Duration::from_secs(10))
        .await
        .map_err(|err| format!("rslock: {err:?}"))?;
    // A hand-written extend of a plain key.
    let plain = format!("peers-plain-{tag}");
    let _: () = redis::cmd("SET")
        .arg(&plain)
        .arg("me")
        .arg("PX")
        .arg(10_000)
        .query_async(&mut admin)
        .await?;
    let hand_written = redis::Script::new(HAND_WRITTEN);

    let previous: (String, String) = redis::cmd("CONFIG")
        .arg("GET")
        .arg("slowlog-log-slower-than")
        .query_async(&mut admin)
        .await?;
    let previous_len: (String, String) = redis::cmd("CONFIG")
        .arg("GET")
        .arg("slowlog-max-len")
        .query_async(&mut admin)
        .await?;
    let config = |key: &str, value: &str| {
        let mut command = redis::cmd("CONFIG");
        command.arg("SET").arg(key).arg(value);
        command
    };
    let _: () = config("slowlog-log-slower-than", "0")
        .query_async(&mut admin)
        .await?;
    let _: () = config("slowlog-max-len", "128")
        .query_async(&mut admin)
        .await?;

    let (mut t_ours, mut t_theirs, mut t_hand) = (Vec::new(), Vec::new(), Vec::new());
    // Server time per script, from the slow log, read every few rounds (it keeps 128 entries).
    let (mut s_ours, mut s_theirs, mut s_hand) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds / 10 {
        let _: () = redis::cmd("SLOWLOG")
            .arg("RESET")
            .query_async(&mut admin)
            .await?;
        for _ in 0..10 {
            let at = Instant::now();
            held = lock
                .renew(&held.version, &bench::renewed(&held.record))
                .await?;
            t_ours.push(at.elapsed());
            let at = Instant::now();
            manager
                .extend(&theirs, Duration::from_secs(10))
                .await
                .map_err(|err| format!("rslock: {err:?}"))?;
            t_theirs.push(at.elapsed());
            let at = Instant::now();
            let _: i64 = hand_written
                .key(&plain)
                .arg("me")
                .arg(10_000)
                .invoke_async(&mut admin)
                .await?;
            t_hand.push(at.elapsed());
        }
        // Each entry: id, time, microseconds, arguments, and (since 4.0) client and name.
        let entries: Vec<(i64, Vec<Vec<u8>>)> = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(128)
            .query_async::<Vec<Vec<redis::Value>>>(&mut admin)
            .await?
            .into_iter()
            .filter_map(|entry| {
                let micros = redis::from_redis_value::<i64>(entry.get(2)?.clone()).ok()?;
                let args = redis::from_redis_value::<Vec<Vec<u8>>>(entry.get(3)?.clone()).ok()?;
                Some((micros, args))
            })
            .collect();
        for (micros, args) in entries {
            if args
                .first()
                .is_none_or(|a| !a.eq_ignore_ascii_case(b"evalsha"))
            {
                continue;
            }
            let time = Duration::from_micros(u64::try_from(micros).unwrap_or(0));
            let names = |key: &str| args.iter().any(|a| a == key.as_bytes());
            if names(lock.key()) {
                s_ours.push(time);
            } else if names(&resource) {
                s_theirs.push(time);
            } else if names(&plain) {
                s_hand.push(time);
            }
        }
    }
    let _: () = config("slowlog-log-slower-than", &previous.1)
        .query_async(&mut admin)
        .await?;
    let _: () = config("slowlog-max-len", &previous_len.1)
        .query_async(&mut admin)
        .await?;
    manager.unlock(&theirs).await;
    let _: () = redis::cmd("DEL")
        .arg(&plain)
        .query_async(&mut admin)
        .await?;

    for samples in [&mut t_ours, &mut t_theirs, &mut t_hand] {
        samples.sort();
    }
    let p50 = |s: &[Duration]| bench::percentile(s, 50);
    println!(
        "Redis lock renewal against rslock's extend and a hand-written extend on {}, {} each, interleaved",
        leader_core::redact_url(&url),
        t_ours.len()
    );
    println!();
    println!(
        "| renewal | latency p50 | latency mean | p50 vs rslock | script time (server), mean | vs rslock |"
    );
    println!("|---|---|---|---|---|---|");
    for (label, latency, script) in [
        ("ours (`RedisLock::renew`)", &t_ours, &s_ours),
        ("rslock `extend`", &t_theirs, &s_theirs),
        ("hand-written GET + PEXPIRE", &t_hand, &s_hand),
    ] {
        println!(
            "| {label} | {} | {} | {:.2}x | {} | {:.2}x |",
            us(p50(latency)),
            us(mean(latency)),
            p50(latency).as_secs_f64() / p50(&t_theirs).as_secs_f64(),
            us(mean(script)),
            mean(script).as_secs_f64() / mean(&s_theirs).as_secs_f64(),
        );
    }
    Ok(())
}
