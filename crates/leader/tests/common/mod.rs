//! What the HTTP layers' tests share: an HTTP client, an axum application served on loopback,
//! and an elector run in the background.

use axum::Router;
use leader::{CancellationToken, ElectionError, LeaderElector, LeaderState};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A plain-HTTP client.
pub(crate) fn client() -> reqwest::Client {
    // reqwest is built without a TLS provider of its own; plain HTTP still builds one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// Serves `app` on a free loopback port in the background; its address (`http://IP:PORT`).
pub(crate) async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Runs `elector` in the background: its state, the token that stops it, and its task.
pub(crate) fn run(
    elector: LeaderElector,
) -> (
    watch::Receiver<LeaderState>,
    CancellationToken,
    JoinHandle<Result<(), ElectionError>>,
) {
    let state = elector.subscribe();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(elector.run(shutdown.clone()));
    (state, shutdown, task)
}
