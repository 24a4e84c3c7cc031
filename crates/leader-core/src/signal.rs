//! Shutting down on the signals an orchestrator sends: SIGTERM (Kubernetes, systemd, `docker
//! stop`) and SIGINT (Ctrl-C).

use tokio_util::sync::CancellationToken;

/// Resolves when the process gets SIGTERM or SIGINT (on platforms without SIGTERM, Ctrl-C).
///
/// Kubernetes and systemd stop a process with SIGTERM, then SIGKILL after a grace period; a
/// leader that waits only for Ctrl-C dies by the SIGKILL holding its lease, and the next
/// replica waits the lease out. Pass [`shutdown_on_signals`] (or this, to a token of your own)
/// as the elector's shutdown: the work stops and the lease is released at once.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                return;
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot listen for SIGTERM; shutting down on Ctrl-C only");
            }
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// A cancellation that fires on SIGTERM or SIGINT ([`shutdown_signal`]), for the elector's
/// `shutdown`. Call it inside the tokio runtime (it spawns the task that waits).
///
/// ```no_run
/// # async fn example(elector: leader_core::LeaderElector) -> Result<(), leader_core::ElectionError> {
/// let shutdown = leader_core::shutdown_on_signals();
/// elector
///     .run_while_leading(shutdown, |leadership| async move {
///         // the leader's work, until the term ends or the process is asked to stop
///         let _ = leadership.fencing_token();
///     })
///     .await?;
/// # Ok(())
/// # }
/// ```
#[must_use = "pass the token as the shutdown of the elector or of the work"]
pub fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let fired = token.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("asked to stop: stopping the work, then releasing the lease");
        fired.cancel();
    });
    token
}
