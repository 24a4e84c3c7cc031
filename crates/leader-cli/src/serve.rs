//! `--metrics-addr`: Prometheus metrics at `/metrics`, liveness at `/healthz` and readiness at
//! `/readyz`.

use std::net::SocketAddr;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use leader_core::HealthCheck;
use metrics_exporter_prometheus::PrometheusBuilder;

/// Installs the Prometheus recorder and serves it, with the health check, in the background.
pub(crate) async fn start(addr: SocketAddr, health: HealthCheck) -> Result<(), String> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|err| format!("cannot install the metrics recorder: {err}"))?;
    leader_core::metrics::describe();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|err| format!("cannot listen: {err}"))?;
    let app = Router::new()
        .route("/metrics", get(move || std::future::ready(handle.render())))
        .route("/healthz", {
            let health = health.clone();
            get(move || std::future::ready(answer(health.check())))
        })
        .route(
            "/readyz",
            get(move || std::future::ready(answer(health.ready()))),
        );
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(error = %err, "metrics server stopped");
        }
    });
    Ok(())
}

/// 200 `ok`, or 503 with the reason.
fn answer<E: std::fmt::Display>(result: Result<(), E>) -> (StatusCode, String) {
    match result {
        Ok(()) => (StatusCode::OK, "ok".to_owned()),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, err.to_string()),
    }
}
