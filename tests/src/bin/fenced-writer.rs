//! A COMMAND for fault tests: while it runs, writes its `LEADER_FENCING_TOKEN` to a fenced sink
//! in Postgres every 20 ms. The sink accepts a write only if its token is at least the highest
//! accepted so far (one compare-and-set on a high-water mark), and logs every write with the
//! `CLOCK_MONOTONIC` time it was sent and whether it was accepted. Records `start`/`stop` lines
//! in `JOB_LOG` like the `job` binary.
//!
//! Environment: `DATABASE_URL`, `SINK` (the table prefix), `LEADER_IDENTITY`,
//! `LEADER_FENCING_TOKEN`, `JOB_LOG`. Under `leader run --shards` (`LEADER_SHARD` set) the sink
//! keeps a high-water mark per shard, and its writes name the shard.
//!
//! Under `leader cron` (`LEADER_FIRING_SCHEDULED` set) it is one firing's COMMAND: it appends
//! `SCHEDULED ATTEMPT TOKEN IDENTITY MONOTONIC_NS WALL_MS` to `FIRINGS_LOG` when it starts, makes
//! `FIRING_WRITES` writes (default 5), 20 ms apart, or fewer when a SIGTERM stops it (a firing
//! replaced, cancelled or timed out), appends `end SCHEDULED ATTEMPT TOKEN MONOTONIC_NS`, and
//! exits; with `FIRING_FAILS=N` its first attempt exits with 1 after the writes when the
//! scheduled second is a multiple of N (a firing that fails, for `--retries`).

use std::time::Duration;

use leader_tests::{firing_fails, log_term_event, now_ns};

/// Whether this attempt of the firing fails on purpose (`FIRING_FAILS`).
fn fails(scheduled: &str, attempt: &str) -> bool {
    let every = std::env::var("FIRING_FAILS")
        .ok()
        .and_then(|n| n.parse().ok());
    let scheduled = chrono::DateTime::parse_from_rfc3339(scheduled).ok();
    match (every, scheduled) {
        (Some(every), Some(at)) => {
            firing_fails(at.with_timezone(&chrono::Utc), attempt == "1", every)
        }
        _ => false,
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")?;
    let sink = std::env::var("SINK")?;
    let identity = std::env::var("LEADER_IDENTITY")?;
    let token: i64 = std::env::var("LEADER_FENCING_TOKEN")?.parse()?;
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let shard: Option<i32> = std::env::var("LEADER_SHARD")
        .ok()
        .and_then(|s| s.parse().ok());
    let sql = match shard {
        None => format!(
            "WITH ok AS (UPDATE {sink}_mark SET token = $1 WHERE token <= $1 RETURNING token)
             INSERT INTO {sink}_writes (token, writer, at, accepted) SELECT $1, $2, $3, EXISTS (SELECT 1 FROM ok)"
        ),
        Some(shard) => format!(
            "WITH ok AS (UPDATE {sink}_mark SET token = $1 WHERE token <= $1 AND shard = {shard} RETURNING token)
             INSERT INTO {sink}_writes (shard, token, writer, at, accepted) SELECT {shard}, $1, $2, $3, EXISTS (SELECT 1 FROM ok)"
        ),
    };
    let write = client.prepare(&sql).await?;
    if let Ok(scheduled) = std::env::var("LEADER_FIRING_SCHEDULED") {
        let attempt = std::env::var("LEADER_FIRING_ATTEMPT").unwrap_or_default();
        let log = |line: String| -> std::io::Result<()> {
            use std::io::Write;
            let Ok(path) = std::env::var("FIRINGS_LOG") else {
                return Ok(());
            };
            // One write per line: lines from different processes never interleave.
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?
                .write_all(line.as_bytes())
        };
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis();
        // The handler first: a SIGTERM right after the start line must still log the end.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        log(format!(
            "{scheduled} {attempt} {token} {identity} {} {wall}\n",
            now_ns()
        ))?;
        let writes: u32 = std::env::var("FIRING_WRITES")
            .ok()
            .and_then(|w| w.parse().ok())
            .unwrap_or(5);
        let mut stopped = false;
        for _ in 0..writes {
            let at = i64::try_from(now_ns())?;
            tokio::select! {
                _ = term.recv() => stopped = true,
                written = async {
                    client.execute(&write, &[&token, &identity, &at]).await?;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok::<_, tokio_postgres::Error>(())
                } => written?,
            }
            if stopped {
                break;
            }
        }
        log(format!("end {scheduled} {attempt} {token} {}\n", now_ns()))?;
        if stopped {
            std::process::exit(143);
        }
        if fails(&scheduled, &attempt) {
            std::process::exit(1);
        }
        return Ok(());
    }
    // The handler first: a SIGTERM right after the start line must still log the stop.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    log_term_event("start");
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tick.tick() => {
                let at = i64::try_from(now_ns())?;
                client.execute(&write, &[&token, &identity, &at]).await?;
            }
        }
    }
    log_term_event("stop");
    Ok(())
}
