//! Elect a leader among processes on one NATS server. Run it in two or three terminals:
//!
//! ```text
//! NATS_URL=nats://127.0.0.1:4222 cargo run -p leader-nats --example nats
//! ```
//!
//! The leader prints a line per second with its fencing token; stop it with Ctrl-C and another
//! process takes over at once (the release reaches the others through their KV watch). Kill it
//! with `kill -9` and another takes over once it has seen the lease go unrenewed for a whole
//! lease.

use std::error::Error;
use std::time::Duration;

use leader_core::LeaderElector;
use leader_nats::NatsStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "example".into());
    let identity =
        std::env::var("LEADER_IDENTITY").unwrap_or_else(|_| leader_core::default_identity());

    let store = NatsStore::builder(url).create_bucket(true).build().await?;
    let lock = store.lock(&name, &identity);
    println!(
        "{identity} runs for leadership of {name:?} under key {} of bucket {}",
        lock.key(),
        store.bucket()
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
