//! Elect a leader among processes on a Postgres table. Run it in two or three terminals:
//!
//! ```text
//! DATABASE_URL=postgres://postgres:postgres@127.0.0.1:5432/postgres cargo run --example postgres
//! LEADER_LOCK=advisory cargo run --example postgres    # the advisory lock instead
//! ```
//!
//! The leader prints a line per second with its fencing token; stop it with Ctrl-C and another
//! process takes over at once (the release is announced with NOTIFY). Kill it with `kill -9` and
//! another takes over when its lease runs out.

use std::error::Error;
use std::time::Duration;

use leader_core::{LeaderElector, LeaderState, ResourceLock};
use leader_postgres::PostgresStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/postgres".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "example".into());
    let identity =
        std::env::var("LEADER_IDENTITY").unwrap_or_else(|_| leader_core::default_identity());

    let store = PostgresStore::builder(url)
        .create_table(true)
        .build()
        .await?;
    let lock: Box<dyn ResourceLock> = match std::env::var("LEADER_LOCK").as_deref() {
        Ok("advisory") => Box::new(store.advisory_lock(&name, &identity)),
        _ => Box::new(store.lock(&name, &identity)),
    };
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
        .await;
    watcher.abort();
    Ok(())
}
