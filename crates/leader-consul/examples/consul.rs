//! Elect a leader among processes on one Consul agent. Run it in two or three terminals:
//!
//! ```text
//! CONSUL_HTTP_ADDR=http://127.0.0.1:8500 cargo run -p leader-consul --example consul
//! ```
//!
//! With no agent at hand, the test Consul server of this workspace will do:
//! `cargo run -p leader-test-support --features consul-api --bin consul-api-server -- --listen
//! 127.0.0.1:8500`.
//!
//! The leader prints a line per second with its fencing token; stop it with Ctrl-C and another
//! process takes over at once (it releases the key, and the others' blocking queries report
//! it). Kill it with `kill -9` and another takes over once the holder's renewals have stopped
//! for a lease (15 s here), within a lease and a jittered retry period (up to 4.4 s) of the
//! kill.

use std::error::Error;
use std::time::Duration;

use leader_consul::ConsulStore;
use leader_core::LeaderElector;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let address =
        std::env::var("CONSUL_HTTP_ADDR").unwrap_or_else(|_| "http://127.0.0.1:8500".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "example".into());
    let identity =
        std::env::var("LEADER_IDENTITY").unwrap_or_else(|_| leader_core::default_identity());

    let store = ConsulStore::builder(address)
        .token(std::env::var("CONSUL_HTTP_TOKEN").unwrap_or_default())
        .build()?;
    let lock = store.lock(&name, &identity)?;
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
