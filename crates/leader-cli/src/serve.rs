//! `--serve`: who leads at `/leader`, readiness at `/readyz`, liveness at `/healthz` and
//! Prometheus metrics at `/metrics`.

use std::net::SocketAddr;

use axum::Router;
use axum::http::StatusCode;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::routing::get;
use leader::LeaderEndpointsLayer;
use metrics_exporter_prometheus::PrometheusBuilder;

/// Installs the Prometheus recorder and listens on `addr`: the router with `/metrics`, and the
/// listener.
async fn listen(addr: SocketAddr) -> Result<(Router, tokio::net::TcpListener), String> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|err| format!("cannot install the metrics recorder: {err}"))?;
    leader_core::metrics::describe();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|err| format!("cannot listen: {err}"))?;
    let app = Router::new().route("/metrics", get(move || std::future::ready(handle.render())));
    Ok((app, listener))
}

fn spawn(listener: tokio::net::TcpListener, app: Router) {
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(error = %err, "the --serve server stopped");
        }
    });
}

/// `leader run --shards --serve`: the shards this replica owns at `/shards` (JSON: each
/// shard's fencing token, the members alive, the problem if any), liveness at `/healthz` (503
/// while the replica takes no shard for a reason, such as another process with its identity)
/// and Prometheus metrics at `/metrics`.
pub(crate) async fn start_shards(
    addr: SocketAddr,
    state: tokio::sync::watch::Receiver<leader_core::ShardsState>,
) -> Result<(), String> {
    let (app, listener) = listen(addr).await?;
    let app = app
        .route("/shards", {
            let state = state.clone();
            get(move || {
                let state = state.borrow();
                let body = serde_json::json!({
                    "owned": state.tokens(),
                    "members": state.members,
                    "problem": state.problem.as_ref().map(ToString::to_string),
                });
                std::future::ready((
                    [
                        (CONTENT_TYPE, "application/json"),
                        (CACHE_CONTROL, "no-store"),
                    ],
                    body.to_string(),
                ))
            })
        })
        .route(
            "/healthz",
            get(move || {
                let problem = state.borrow().problem.clone();
                std::future::ready(answer(problem.map_or(Ok(()), Err)))
            }),
        );
    tracing::info!(%addr, "serving /shards, /healthz and /metrics");
    spawn(listener, app);
    Ok(())
}

/// Installs the Prometheus recorder and serves it, with `endpoints` (`/leader`, `/readyz`,
/// `/healthz`: the library's [`LeaderEndpointsLayer`], as a service mounts it), in the
/// background.
pub(crate) async fn start(addr: SocketAddr, endpoints: LeaderEndpointsLayer) -> Result<(), String> {
    let (app, listener) = listen(addr).await?;
    let app = app.layer(endpoints);
    tracing::info!(%addr, "serving /leader, /readyz, /healthz and /metrics");
    spawn(listener, app);
    Ok(())
}

/// 200 `ok`, or 503 with the reason.
fn answer<E: std::fmt::Display>(result: Result<(), E>) -> (StatusCode, String) {
    match result {
        Ok(()) => (StatusCode::OK, "ok".to_owned()),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, err.to_string()),
    }
}
