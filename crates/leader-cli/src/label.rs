//! `--label-pod`: on Kubernetes, this replica's Pod labelled while it leads, for a Service that
//! sends traffic to the leader only (`leader_kube::PodLabel`).

use std::time::Duration;

use leader_core::{LeaderElectorBuilder, Timings};

/// Adds to `builder` a task beside the term's work that holds the label `key: election` on this replica's
/// Pod, or says why it cannot (a line for exit code 2).
#[cfg(feature = "kubernetes")]
pub(crate) async fn attach(
    builder: LeaderElectorBuilder,
    key: &str,
    election: &str,
    timings: Timings,
) -> Result<LeaderElectorBuilder, String> {
    leader::kubernetes::PodLabel::check_key(key).map_err(|err| format!("--label-pod: {err}"))?;
    let label = leader::kubernetes::PodLabel::from_env(election, timings.renew_deadline / 2)
        .await
        .and_then(|label| label.label(key, election))
        .map_err(|err| format!("--label-pod: {err}"))?
        .retry(timings.retry_period)
        .removal_timeout(removal_timeout(timings));
    tracing::info!(label = %label.selector(), "labelling this Pod while it leads");
    Ok(builder.beside_work(move |leadership| {
        let label = label.clone();
        async move { label.hold(leadership).await }
    }))
}

/// Without the `kubernetes` feature there is no Kubernetes client to label a Pod with.
#[cfg(not(feature = "kubernetes"))]
pub(crate) async fn attach(
    _builder: LeaderElectorBuilder,
    _key: &str,
    _election: &str,
    timings: Timings,
) -> Result<LeaderElectorBuilder, String> {
    let _ = removal_timeout(timings);
    Err("--label-pod needs the kubernetes feature, which this leader was built without".to_owned())
}

/// How long the end of a term waits for the label's removal: 1 s, or a quarter of the time
/// between the step-down and the lease's end when that is shorter, so that the release (which
/// waits for it, as it waits for COMMAND) still comes before the lease runs out.
fn removal_timeout(timings: Timings) -> Duration {
    Duration::from_secs(1).min(timings.stop_window() / 4)
}
