//! An axum service of which only the leader answers `POST /admin/rebuild` (the other replicas
//! answer 503 naming the leader), with `/leader`, `/readyz` and `/healthz` on every replica for
//! load balancers and probes. Run two or three at once:
//!
//! ```sh
//! LEADER_LOCK=postgres://app@db/app LISTEN=127.0.0.1:8081 cargo run -p leader --features postgres,tower --example leader_only_route
//! curl -X POST 127.0.0.1:8081/admin/rebuild
//! ```
//!
//! SIGTERM or Ctrl-C stops serving and releases the lease at once.

use axum::routing::post;
use axum::{Extension, Router};
use leader::{LeaderElector, LeaderEndpointsLayer, LeaderOnlyLayer, Leadership};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Log what the election does, refused writes and outages included (RUST_LOG, default info).
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let url = std::env::var("LEADER_LOCK")?; // postgres://app@db/app, redis://..., etcd://...
    let lock = leader::open(&url, "admin", &leader::default_identity()).await?;
    let elector = LeaderElector::builder(lock).build()?;
    let app = Router::new()
        .route("/admin/rebuild", post(rebuild))
        .route_layer(LeaderOnlyLayer::new(&elector)) // the leader's alone
        .layer(LeaderEndpointsLayer::new(&elector)); // /leader, /readyz, /healthz
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let shutdown = leader::shutdown_on_signals();
    let stop = shutdown.clone().cancelled_owned();
    let serving = axum::serve(listener, app).with_graceful_shutdown(stop);
    tokio::spawn(async move { serving.await });
    elector.run(shutdown).await?;
    Ok(())
}

/// Only the leader runs this; the term's fencing token goes with its writes.
async fn rebuild(Extension(term): Extension<Leadership>) -> String {
    format!("rebuilt under fencing token {}\n", term.fencing_token())
}
