//! Elect a leader among processes on etcd. Run it in two or three terminals:
//!
//! ```text
//! ETCD_ENDPOINTS=http://127.0.0.1:2379 cargo run --example etcd
//! ```
//!
//! The leader prints a line per second with its fencing token (an etcd revision); stop it with
//! Ctrl-C and another process takes over at once (followers watch the key). Kill it with
//! `kill -9` and another takes over when its etcd lease expires.

use std::error::Error;
use std::time::Duration;

use leader_core::LeaderElector;
use leader_etcd::EtcdStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let endpoints =
        std::env::var("ETCD_ENDPOINTS").unwrap_or_else(|_| "http://127.0.0.1:2379".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "example".into());
    let identity =
        std::env::var("LEADER_IDENTITY").unwrap_or_else(|_| leader_core::default_identity());

    let store = EtcdStore::connect(endpoints.split(',')).await?;
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
                println!("working (fencing token {})", leadership.fencing_token());
            }
        })
        .await?;
    Ok(())
}
