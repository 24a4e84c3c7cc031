//! A kube-runtime controller on one replica at a time: the replica that leads the Lease runs a
//! `Controller` that reconciles Pods, the others wait. Run two or three at once, with your
//! kubeconfig or in a cluster:
//!
//! ```sh
//! POD_NAME=a cargo run -p leader-kube --example controller
//! ```
//!
//! - It reconciles the Pods that `POD_SELECTOR` selects (default `app=demo`) in
//!   `POD_NAMESPACE` (default `default`): after two seconds of stand-in work, it stamps each
//!   with the replica and the fencing token of the term that reconciled it (the annotations
//!   `leader-rs.io/reconciled-by` and `leader-rs.io/reconciled-token`), and prints
//!   `reconciling NAME` and `reconciled NAME` around it.
//! - The Lease is `LEADER_NAME` (default `pod-controller`); the identity is `POD_NAME`. Each
//!   term runs a controller of its own, which lists the Pods afresh.
//! - When the term ends (SIGTERM, Ctrl-C, a lease that could not be renewed), the controller
//!   takes no new reconcile and the ones in flight finish, within the elector's stop grace
//!   (the lease duration less the renew deadline, 5 s by default); only then is the Lease
//!   released, so another replica never reconciles beside them.
//! - RBAC: the rights on `leases` and `events` of `deploy/kubernetes/rbac.yaml`, and `list`,
//!   `watch` and `patch` on `pods`.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use leader_kube::leader_core::{LeaderElector, default_identity, shutdown_on_signals};
use leader_kube::{DEFAULT_REQUEST_TIMEOUT, LeaseLock};
use serde_json::json;

const RECONCILED_BY: &str = "leader-rs.io/reconciled-by";
const RECONCILED_TOKEN: &str = "leader-rs.io/reconciled-token";
/// Stands in for a reconcile's slow part (a cloud API, a migration), which a stop must not cut.
const WORK: Duration = Duration::from_secs(2);

/// What the reconciles of one term share.
struct Term {
    pods: Api<Pod>,
    identity: String,
    fencing_token: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Log what the election and the controller do (RUST_LOG, default info).
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let identity = default_identity();
    let namespace = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".into());
    let name = std::env::var("LEADER_NAME").unwrap_or_else(|_| "pod-controller".into());
    let selector = std::env::var("POD_SELECTOR").unwrap_or_else(|_| "app=demo".into());

    let lock = LeaseLock::from_env(&namespace, &name, &identity, DEFAULT_REQUEST_TIMEOUT).await?;
    let elector = LeaderElector::builder(lock)
        // The work is told that the term ended and given the stop grace, not dropped mid-way.
        .graceful_stop(true)
        .build()?;
    let client = Client::try_default().await?;
    elector
        .run_while_leading(shutdown_on_signals(), move |leadership| {
            let term = Arc::new(Term {
                pods: Api::namespaced(client.clone(), &namespace),
                identity: identity.clone(),
                fencing_token: leadership.fencing_token(),
            });
            let pods = watcher::Config::default().labels(&selector);
            async move {
                Controller::new(term.pods.clone(), pods)
                    // At the term's end: no new reconcile, and the stream ends once those in
                    // flight have finished.
                    .graceful_shutdown_on(leadership.cancellation_token().cancelled_owned())
                    .run(reconcile, retry_later, term)
                    .for_each(|reconciled| async move {
                        if let Err(err) = reconciled {
                            tracing::warn!(%err, "reconcile failed");
                        }
                    })
                    .await;
            }
        })
        .await?;
    Ok(())
}

/// Stamps `pod` with this term, once per term: the stamp's own write comes back through the
/// watch and finds nothing to do.
async fn reconcile(pod: Arc<Pod>, term: Arc<Term>) -> Result<Action, kube::Error> {
    let token = term.fencing_token.to_string();
    if pod.annotations().get(RECONCILED_TOKEN) == Some(&token) {
        return Ok(Action::await_change());
    }
    let name = pod.name_any();
    println!("reconciling {name} (fencing token {token})");
    tokio::time::sleep(WORK).await;
    let stamp = json!({"metadata": {"annotations": {
        RECONCILED_BY: term.identity,
        RECONCILED_TOKEN: token,
    }}});
    let params = PatchParams::default();
    term.pods
        .patch(&name, &params, &Patch::Merge(stamp))
        .await?;
    println!("reconciled {name} (fencing token {token})");
    Ok(Action::await_change())
}

fn retry_later(_pod: Arc<Pod>, _err: &kube::Error, _term: Arc<Term>) -> Action {
    Action::requeue(Duration::from_secs(5))
}
