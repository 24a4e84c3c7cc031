//! Elect a leader among processes on a Postgres table. Run it in two or three terminals:
//!
//! ```text
//! LEADER_LOCK=postgres://postgres:postgres@127.0.0.1:5432/postgres cargo run --example postgres
//! LEADER_LOCK='postgres://...?advisory=true' cargo run --example postgres  # the advisory lock
//! ```
//!
//! `LEADER_LOCK` is the lock URL, as for the `leader` command (default: `DATABASE_URL`, else
//! the local server).
//!
//! The leader prints a line per second with its fencing token; stop it with Ctrl-C and another
//! process takes over at once (the release is announced with NOTIFY). Kill it with `kill -9` and
//! another takes over when its lease runs out.

use std::error::Error;
use std::time::Duration;

use leader_core::LockTarget;
use leader_core::{LeaderElector, LeaderState, ResourceLock};
use leader_postgres::LockUrl;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("LEADER_LOCK")
        .or_else(|_| std::env::var("DATABASE_URL"))
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/postgres".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "example".into());
    let identity =
        std::env::var("LEADER_IDENTITY").unwrap_or_else(|_| leader_core::default_identity());

    // The table lock, or the advisory lock with `?advisory=true`; the table is created when
    // the role may.
    let lock: Box<dyn ResourceLock> = LockUrl::parse(&url)?.open(&name, &identity).await?;
    println!(
        "{identity} runs for leadership of {:?} on {}",
        name,
        lock.describe()
    );

    let elector = LeaderElector::builder(lock)
        .lease_duration(Duration::from_secs(15))
        .renew_deadline(Duration::from_secs(10))
        .retry_period(Duration::from_secs(2))
        .on_new_leader(|leader| println!("leader is now {leader}"))
        .build()?;
    let mut state = elector.subscribe();
    // SIGTERM (Kubernetes, systemd) or Ctrl-C: stop the work, then release the lease.
    let shutdown = leader_core::shutdown_on_signals();
    let watcher = tokio::spawn(async move {
        while state.changed().await.is_ok() {
            if let LeaderState::Leading(leadership) = &*state.borrow() {
                println!("leading with fencing token {}", leadership.fencing_token());
            }
        }
    });
    elector
        .run_while_leading(shutdown, |leadership| async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                // Real work would pass the fencing token to every write it makes.
                println!("working (fencing token {})", leadership.fencing_token());
            }
        })
        .await?;
    watcher.abort();
    Ok(())
}
