//! Elect a leader among processes on one bucket. Run it in two or three terminals:
//!
//! ```text
//! LEADER_LOCK=s3://my-bucket/locks/ cargo run -p leader-object-store --example object_store
//! ```
//!
//! Credentials, region and endpoint come from the environment (`AWS_*`, `GOOGLE_*`,
//! `AZURE_*`). With no bucket at hand, moto's S3 server (`scripts/setup` starts it) will do:
//! `AWS_ENDPOINT=http://127.0.0.1:9000 AWS_ALLOW_HTTP=true AWS_ACCESS_KEY_ID=test
//! AWS_SECRET_ACCESS_KEY=test AWS_REGION=us-east-1 LEADER_LOCK=s3://BUCKET/locks/`.
//!
//! The leader prints a line per second with its fencing token; stop it with Ctrl-C and another
//! process takes over at its next poll (it releases the lease); kill it with `kill -9` and
//! another takes over once the lease (15 s) has passed unrenewed.

use std::error::Error;
use std::time::Duration;

use leader_core::LeaderElector;
use leader_object_store::BucketStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("LEADER_LOCK").unwrap_or_else(|_| "memory://".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "example".into());
    let identity =
        std::env::var("LEADER_IDENTITY").unwrap_or_else(|_| leader_core::default_identity());

    // The application picks rustls' crypto provider for the HTTP clients: ring.
    leader_object_store::ensure_crypto_provider();
    let store = BucketStore::from_url(&url).build()?;
    let lock = store.lock(&name, &identity);
    println!(
        "{identity} runs for leadership of {name:?} in object {}",
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
