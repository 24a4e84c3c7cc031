//! A job with its own election: one call for a service that runs a schedule on one replica.

use std::sync::{Arc, Mutex};

use leader_core::{CancellationToken, LeaderElector, LeaderElectorBuilder, ResourceLock};

use crate::job::{CronError, CronJob};

impl CronJob {
    /// Runs the job on whichever replica leads the election behind `lock`, until `shutdown`
    /// fires: the election is named after the job (one name for the schedule, the election,
    /// `leader status` and the metrics), with the default timings (a lease of 15 s), and the
    /// job runs in each term of this replica ([`run`](Self::run)). On shutdown the running
    /// firing is cancelled and waited for, and the lease released so that another replica
    /// takes over at once. For other timings use [`run_with`](Self::run_with).
    ///
    /// `lock` is any [`ResourceLock`] (`leader::open(url, name, identity)` opens one from a
    /// URL), naming this replica's identity.
    ///
    /// # Errors
    /// An election that cannot be built (an empty identity), or the store holding another
    /// schedule under this name ([`CronError::ScheduleMismatch`]) or a state it cannot read:
    /// then the job stops on this replica, since running it would break the schedule's word.
    pub async fn run_elected(
        &self,
        lock: impl ResourceLock + 'static,
        shutdown: CancellationToken,
    ) -> Result<(), CronError> {
        self.run_with(LeaderElector::builder(lock), shutdown).await
    }

    /// As [`run_elected`](Self::run_elected), with an election configured by the caller
    /// (timings, callbacks, metrics); its name is set to the job's.
    ///
    /// # Errors
    /// As [`run_elected`](Self::run_elected).
    pub async fn run_with(
        &self,
        elector: LeaderElectorBuilder,
        shutdown: CancellationToken,
    ) -> Result<(), CronError> {
        let elector = elector.name(self.name()).build()?;
        let stop = shutdown.child_token();
        let refused: Arc<Mutex<Option<CronError>>> = Arc::default();
        let (job, seen, stopping) = (self.clone(), refused.clone(), stop.clone());
        elector
            .run_while_leading(stop, move |leadership| {
                let (job, seen, stopping) = (job.clone(), seen.clone(), stopping.clone());
                async move {
                    if let Err(err) = job.run(leadership).await {
                        tracing::error!(schedule = %job.name(), error = %err, "the schedule cannot run here: stopping");
                        *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(err);
                        stopping.cancel();
                    }
                }
            })
            .await?;
        let refused = refused.lock().unwrap_or_else(|p| p.into_inner()).take();
        refused.map_or(Ok(()), Err)
    }
}
