//! Elect a leader among processes on any lock: the same program for every backend, only the URL
//! (and the feature that builds its backend) differs. Run it in two or three terminals:
//!
//! ```sh
//! LEADER_LOCK=postgres://postgres@127.0.0.1/postgres cargo run -p leader --features postgres --example elect
//! LEADER_LOCK=redis://127.0.0.1:6379 cargo run -p leader --features redis --example elect
//! LEADER_LOCK=etcd://127.0.0.1:2379 cargo run -p leader --features etcd --example elect  # needs protoc
//! LEADER_LOCK=nats://127.0.0.1:4222 cargo run -p leader --features nats --example elect
//! LEADER_LOCK=consul://127.0.0.1:8500 cargo run -p leader --features consul --example elect
//! LEADER_LOCK=s3://my-bucket/locks/ cargo run -p leader --features object-store --example elect
//! LEADER_LOCK=file:///tmp/leader-example cargo run -p leader --example elect
//! ```
//!
//! Each backend's README says how its lock hands over and fails over; the URL's query sets its
//! options (`?advisory=true` on a Postgres URL takes the session advisory lock). The leader
//! prints a line per second with its fencing token. Stop it with Ctrl-C (or SIGTERM): it stops
//! its work and releases the lease, and another process takes over at once. Kill it with
//! `kill -9`: another takes over once the lease has run out unrenewed. With no Consul agent at
//! hand, the workspace's test Consul server will do: `cargo run -p leader-test-support
//! --features consul-api --bin consul-api-server -- --listen 127.0.0.1:8500`.

use std::time::Duration;

use leader::LeaderElector;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Log what the election does, refused writes and outages included (RUST_LOG, default info).
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let url = std::env::var("LEADER_LOCK")?;
    let lock = leader::open(&url, "example", &leader::default_identity()).await?;
    let elector = LeaderElector::builder(lock)
        .on_new_leader(|leader| println!("leader is now {leader}"))
        .build()?;
    // SIGTERM (Kubernetes, systemd) or Ctrl-C: stop the work, then release the lease.
    let shutdown = leader::shutdown_on_signals();
    elector
        .run_while_leading(shutdown, |term| async move {
            loop {
                // Real work would pass the fencing token with every write it makes.
                let (identity, token) = (term.identity(), term.fencing_token());
                println!("{identity}: working (fencing token {token})");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
        .await?;
    Ok(())
}
