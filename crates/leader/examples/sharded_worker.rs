//! A worker of a set of 8 shards (tenants, partitions, queues) split among the replicas that
//! run: each shard is worked on by one replica at a time, under its own fencing token, and the
//! shards move when replicas come and go. Run two or three at once:
//!
//! ```sh
//! LEADER_LOCK=postgres://app@db/app cargo run -p leader --features postgres --example sharded_worker
//! ```
//!
//! SIGTERM or Ctrl-C stops the work, releases the shards and leaves the set at once.

use std::time::Duration;

use leader::{Leadership, Shards};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Log what the election does, refused writes and outages included (RUST_LOG, default info).
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let url = std::env::var("LEADER_LOCK")?; // postgres://app@db/app, redis://..., etcd://...
    let locks = leader::open_set(&url, "tenants", &leader::default_identity()).await?;
    let shards = Shards::builder("tenants", 8, locks).build()?;
    let work = |shard: u32, term: Leadership| async move {
        loop {
            // The shard's work goes here, passing the shard's fencing token with its writes.
            let token = term.fencing_token();
            println!("shard {shard}: working (fencing token {token})");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    };
    let shutdown = leader::shutdown_on_signals();
    shards.run_per_shard(shutdown, work).await?;
    Ok(())
}
