//! `--metrics-addr`: Prometheus metrics at `/metrics` and a health check at `/healthz`.

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
        .route(
            "/healthz",
            get(move || {
                std::future::ready(match health.check() {
                    Ok(()) => (StatusCode::OK, "ok".to_owned()),
                    Err(err) => (StatusCode::SERVICE_UNAVAILABLE, err.to_string()),
                })
            }),
        );
    tracing::info!(%addr, "serving /metrics and /healthz");
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(error = %err, "metrics server stopped");
        }
    });
    Ok(())
}
