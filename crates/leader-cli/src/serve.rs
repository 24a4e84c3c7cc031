//! `--serve`: who leads at `/leader`, readiness at `/readyz`, liveness at `/healthz` and
//! Prometheus metrics at `/metrics`.

use std::net::SocketAddr;

use axum::Router;
use axum::http::StatusCode;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use leader_core::{ElectorStatus, HealthCheck};
use metrics_exporter_prometheus::PrometheusBuilder;

/// What the endpoints answer from.
#[derive(Clone)]
pub(crate) struct Endpoints {
    pub(crate) health: HealthCheck,
    pub(crate) status: ElectorStatus,
    /// `--ready-only-while-leading`.
    pub(crate) ready_only_while_leading: bool,
}

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

/// Installs the Prometheus recorder and serves it, with the other endpoints, in the
/// background.
pub(crate) async fn start(addr: SocketAddr, endpoints: Endpoints) -> Result<(), String> {
    let (app, listener) = listen(addr).await?;
    let app = app
        .route("/healthz", {
            let health = endpoints.health.clone();
            get(move || std::future::ready(answer(health.check())))
        })
        .route("/readyz", {
            let endpoints = endpoints.clone();
            get(move || std::future::ready(endpoints.ready()))
        })
        .route(
            "/leader",
            get(move || std::future::ready(leader(&endpoints.status))),
        );
    tracing::info!(%addr, "serving /leader, /readyz, /healthz and /metrics");
    spawn(listener, app);
    Ok(())
}

impl Endpoints {
    /// Ready unless this replica could not take over (the store has not answered for a lease,
    /// or another process leads with its identity), and, with `--ready-only-while-leading`,
    /// unless it does not lead.
    fn ready(&self) -> (StatusCode, String) {
        if let Err(err) = self.health.ready() {
            return answer(Err(err));
        }
        if self.ready_only_while_leading {
            let view = self.status.view();
            if !view.leading {
                let leader = view.leader.as_deref().unwrap_or("nobody");
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not leading (--ready-only-while-leading); the leader: {leader}"),
                );
            }
        }
        (StatusCode::OK, "ok".to_owned())
    }
}

/// The [`LeaderView`](leader_core::LeaderView) as JSON: 200 on the leader, 503 elsewhere, so
/// that a load balancer's health check on `/leader` routes to the leader.
fn leader(status: &ElectorStatus) -> Response {
    let view = status.view();
    let code = if view.leading {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::to_string(&view).unwrap_or_default();
    (
        code,
        [
            (CONTENT_TYPE, "application/json"),
            (CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

/// 200 `ok`, or 503 with the reason.
fn answer<E: std::fmt::Display>(result: Result<(), E>) -> (StatusCode, String) {
    match result {
        Ok(()) => (StatusCode::OK, "ok".to_owned()),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, err.to_string()),
    }
}
