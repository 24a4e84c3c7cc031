//! Three processes elect a leader over a file lock; the leader is stopped, then another is
//! killed, and the output shows who leads, the fencing token and how long each handover took.
//!
//! ```text
//! cargo run --example demo
//! ```
//!
//! The demo starts three copies of itself as candidates (`demo candidate ID PATH`), each with its
//! own `FileLock` on one lock directory, and reads what they print.

use std::error::Error;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use leader_core::{CancellationToken, FileLock, LeaderElector};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

const LEASE: Duration = Duration::from_secs(3);
const RENEW: Duration = Duration::from_secs(2);
const RETRY: Duration = Duration::from_millis(500);
const NAMES: [&str; 3] = ["ant", "bee", "cat"];

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [mode, id, path] if mode == "candidate" => candidate(id, PathBuf::from(path)).await,
        [] => narrate().await,
        _ => Err("usage: demo [candidate ID PATH]".into()),
    }
}

/// One candidate process: leads while it can, prints what happens, shuts down (releasing the
/// lease) when its standard input closes.
async fn candidate(id: &str, path: PathBuf) -> Result<(), Box<dyn Error>> {
    let elector = LeaderElector::builder(FileLock::new(path, id))
        .lease_duration(LEASE)
        .renew_deadline(RENEW)
        .retry_period(RETRY)
        .on_started_leading(|leadership| async move {
            println!("leading {}", leadership.fencing_token());
            leadership.lost().await;
        })
        .on_stopped_leading(|step_down| {
            println!(
                "stopped {} {:?} released={}",
                step_down.fencing_token, step_down.reason, step_down.released
            );
        })
        .build()?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::io::stdin().read_to_end(&mut Vec::new()).await;
        stop.cancel();
    });
    elector.run(shutdown).await?;
    Ok(())
}

struct Event {
    at: Instant,
    who: usize,
    line: String,
}

/// Starts the three candidates and tells the story.
async fn narrate() -> Result<(), Box<dyn Error>> {
    let dir = tempfile_dir()?;
    let path = dir.join("demo.lock");
    let exe = std::env::current_exe()?;
    let (tx, mut events) = mpsc::unbounded_channel();
    let mut children: Vec<Option<Child>> = Vec::new();
    let began = Instant::now();
    println!("lock directory: {}", path.display());
    println!("timings: lease {LEASE:?}, renew deadline {RENEW:?}, retry {RETRY:?}\n");
    for (who, name) in NAMES.iter().enumerate() {
        let mut child = Command::new(&exe)
            .args(["candidate", name, &path.to_string_lossy()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = tx.send(Event {
                    at: Instant::now(),
                    who,
                    line,
                });
            }
        });
        children.push(Some(child));
    }

    let (leader, token, at) = next_leader(&mut events, None).await?;
    println!(
        "{:>7.3}s  {} leads, fencing token {token}",
        (at - began).as_secs_f64(),
        NAMES[leader]
    );

    // 1. A graceful stop: the leader's work stops, then it releases the lease.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopped_at = Instant::now();
    println!(
        "{:>7.3}s  stopping {} (graceful: it releases the lease)",
        (stopped_at - began).as_secs_f64(),
        NAMES[leader]
    );
    let mut child = children[leader].take().ok_or("leader gone")?;
    drop(child.stdin.take());
    let (next, next_token, at) = next_leader(&mut events, Some(leader)).await?;
    println!(
        "{:>7.3}s  {} leads, fencing token {next_token}: handover took {} ms",
        (at - began).as_secs_f64(),
        NAMES[next],
        (at - stopped_at).as_millis()
    );
    child.wait().await?;

    // 2. A crash: no release, but the kernel drops the dead leader's term lock, so the others
    //    take over at once. (A frozen leader keeps it: then they wait out the lease.)
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed_at = Instant::now();
    println!(
        "{:>7.3}s  killing {} with SIGKILL (no release, but its term lock dies with it)",
        (killed_at - began).as_secs_f64(),
        NAMES[next]
    );
    let mut child = children[next].take().ok_or("leader gone")?;
    child.kill().await?;
    let (last, last_token, at) = next_leader(&mut events, Some(next)).await?;
    println!(
        "{:>7.3}s  {} leads, fencing token {last_token}: failover took {} ms after the kill (without the term lock it would wait out the {} ms lease)",
        (at - began).as_secs_f64(),
        NAMES[last],
        (at - killed_at).as_millis(),
        LEASE.as_millis()
    );

    for mut child in children.into_iter().flatten() {
        drop(child.stdin.take());
        let _ = timeout(Duration::from_secs(5), child.wait()).await;
    }
    println!(
        "\nfencing tokens grew {token} -> {next_token} -> {last_token}: a store that refuses lower tokens refuses a stale leader."
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Waits for a candidate other than `except` to report leading.
async fn next_leader(
    events: &mut mpsc::UnboundedReceiver<Event>,
    except: Option<usize>,
) -> Result<(usize, u64, Instant), Box<dyn Error>> {
    loop {
        let event = timeout(LEASE * 4, events.recv())
            .await
            .map_err(|_| "no leader within four lease durations")?
            .ok_or("all candidates exited")?;
        if let Some(token) = event.line.strip_prefix("leading ")
            && Some(event.who) != except
        {
            return Ok((event.who, token.parse()?, event.at));
        }
    }
}

fn tempfile_dir() -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("leader-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
