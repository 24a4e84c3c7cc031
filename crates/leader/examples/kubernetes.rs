//! A replica of a Deployment that elects a leader through a Kubernetes Lease: run it in a
//! cluster with `deploy/kubernetes/rbac.yaml` and `deploy/kubernetes/deployment.yaml`.
//!
//! - Identity: the pod name (`POD_NAME`, from the downward API); namespace from `POD_NAMESPACE`;
//!   the Lease's name from `LEADER_NAME`.
//! - `:8080/readyz` fails while this pod could not take over (the API server has not answered
//!   it for a lease, or another pod leads with its name); `:8080/healthz` is the
//!   HealthzAdaptor-like check, failing when this pod believes it leads although its lease ran
//!   out; `:8080/leader` says who leads (JSON; 200 on the leader, 503 elsewhere): the library's
//!   `LeaderEndpointsLayer`.
//! - With `LEADER_LABEL_POD=leader-rs.io/leader` (the label's key), the leader's Pod carries the label
//!   `leader-rs.io/leader: LEADER_NAME` while it leads, for `deploy/kubernetes/
//!   service-leader.yaml` (needs `deploy/kubernetes/rbac-pod-label.yaml`).
//! - SIGTERM (pod deletion, rolling update) stops the work and releases the Lease, so another
//!   replica takes over at once.
//! - With `LEADER_BINARY_VERSION` set (a semantic version such as `1.4.0`; the emulation
//!   version is `LEADER_EMULATION_VERSION`, by default the same), the replica takes part in
//!   coordinated leader election: the API server's coordinator gives the Lease to the oldest
//!   version. It needs `deploy/kubernetes/rbac-coordinated.yaml` as well and a cluster with the
//!   `CoordinatedLeaderElection` feature gate.
//!
//! Outside a cluster it uses your kubeconfig: `POD_NAME=me cargo run -p leader --features kubernetes,tower --example
//! kubernetes`.

use std::error::Error;
use std::time::Duration;

use axum::Router;
use leader::kubernetes::{Coordination, DEFAULT_REQUEST_TIMEOUT, LeaseLock, PodLabel};
use leader::{LeaderElector, LeaderEndpointsLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    // The pod name (POD_NAME, which the Deployment sets from the downward API), else this
    // host's name and process id: one identity per process.
    let identity = leader::default_identity();
    let namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "leader-example".into());

    let mut lock =
        LeaseLock::from_env(&namespace, &name, &identity, DEFAULT_REQUEST_TIMEOUT).await?;
    if let Ok(binary) = std::env::var("LEADER_BINARY_VERSION") {
        let emulation =
            std::env::var("LEADER_EMULATION_VERSION").unwrap_or_else(|_| binary.clone());
        lock = lock.coordinated(Coordination::oldest_emulation_version(binary, emulation))?;
    }
    let mut builder = LeaderElector::builder(lock)
        .lease_duration(Duration::from_secs(15))
        .renew_deadline(Duration::from_secs(10))
        .retry_period(Duration::from_secs(2))
        .on_new_leader(|leader| tracing::info!(leader, "new leader"));
    // The label's key, as `leader run --label-pod=KEY` takes it: the Pod gets KEY=NAME.
    if let Some(key) = std::env::var("LEADER_LABEL_POD")
        .ok()
        .filter(|k| !k.is_empty())
    {
        let label = PodLabel::from_env(&name, DEFAULT_REQUEST_TIMEOUT)
            .await?
            .label(key, &name)?;
        builder = builder.beside_work(move |leadership| {
            let label = label.clone();
            async move { label.hold(leadership).await }
        });
    }
    let elector = builder.build()?;

    // /leader, /readyz and /healthz, as `leader run --serve` answers them.
    let app = Router::new().layer(LeaderEndpointsLayer::new(&elector));
    let listener = tokio::net::TcpListener::bind("0.0.0.0:8080").await?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    // SIGTERM (the kubelet's stop) or Ctrl-C: the work stops, then the Lease is released.
    let shutdown = leader::shutdown_on_signals();
    elector
        .run_while_leading(shutdown, |leadership| async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                // The singleton work goes here, with the fencing token on every write.
                tracing::info!(
                    fencing_token = leadership.fencing_token(),
                    "working as the leader"
                );
            }
        })
        .await?;
    Ok(())
}
