//! Elect a leader among processes on one Redis. Run it in two or three terminals:
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example redis
//! ```
//!
//! The leader prints a line per second with its fencing token; stop it with Ctrl-C and another
//! process takes over at once (the release is published on the election's channel). Kill it with
//! `kill -9` and another takes over when its key expires.

use std::error::Error;
use std::time::Duration;

use leader_core::LeaderElector;
use leader_redis::RedisStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "example".into());
    let identity =
        std::env::var("LEADER_IDENTITY").unwrap_or_else(|_| leader_core::default_identity());

    let store = RedisStore::connect(url).await?;
    let lock = store.lock(&name, &identity);
    println!(
        "{identity} runs for leadership of {name:?} in key {}",
        lock.key()
    );
    let elector = LeaderElector::builder(lock)
        .lease_duration(Duration::from_secs(15))
        .renew_deadline(Duration::from_secs(10))
        .retry_period(Duration::from_secs(2))
        .on_new_leader(|leader| println!("leader is now {leader}"))
        .build()?;
    // SIGTERM (Kubernetes, systemd) or Ctrl-C: stop the work, then release the lease.
    let shutdown = leader_core::shutdown_on_signals();
    elector
        .run_while_leading(shutdown, |leadership| async move {
            println!("leading with fencing token {}", leadership.fencing_token());
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                // Real work would pass the fencing token to every write it makes.
                println!("working (fencing token {})", leadership.fencing_token());
            }
        })
        .await?;
    Ok(())
}
