//! The loop that drives a [`LeaderElector`](crate::LeaderElector): client-go's acquire/renew
//! loop, kept to the safety rules S1-S15. The elector hands it what it needs; one term's work is
//! in `work.rs`. The loop runs a [`Campaign`] (the attempts to acquire, and what the candidate
//! saw of the record: `runner/campaign.rs`) until it acquires, then leads a [`Term`] (renewals,
//! requests, release: `runner/term.rs`), and again; both run with one [`Context`] (the lock,
//! the configuration, the callbacks and where they report: `runner/context.rs`).

use std::sync::Arc;

use tokio::time::{sleep, timeout};
use tokio_util::sync::CancellationToken;

use self::campaign::Campaign;
pub(crate) use self::context::{Callbacks, Context};
use self::term::Term;
use crate::error::LockError;
use crate::leadership::LeaderState;
use crate::lock::ResourceLock;
use crate::metrics as m;
use crate::status::ElectionError;

mod campaign;
mod context;
mod term;

/// The loop: one campaign, kept across terms, and the term it leads when it acquires.
pub(crate) struct Runner {
    /// What the campaign and each term run with.
    context: Context,
    /// The attempts to acquire and what they saw, kept across terms.
    campaign: Campaign,
}

impl Runner {
    /// A runner that has seen nothing yet.
    pub(crate) fn new(context: Context) -> Self {
        Self {
            campaign: Campaign::new(&context.config),
            context,
        }
    }

    /// Campaigns and leads, by turns, until `shutdown` is cancelled.
    ///
    /// # Errors
    /// The store does not keep a lease this long ([`check_lease`](Self::check_lease)):
    /// the elector stops before its first attempt.
    pub(crate) async fn run(mut self, shutdown: CancellationToken) -> Result<(), ElectionError> {
        m::set_leading(&self.context.config.name, false);
        if let Err(refused) = self.check_lease().await {
            self.close().await;
            self.context.publish(LeaderState::Stopped);
            return Err(refused);
        }
        while let Some((acquired, started)) =
            self.campaign.acquire(&mut self.context, &shutdown).await
        {
            let term = Term::begin(&self.context, acquired, started);
            let reason = term
                .lead(&mut self.context, &mut self.campaign, &shutdown)
                .await;
            if shutdown.is_cancelled() {
                break;
            }
            if reason.stands_back() && !self.stand_back(&shutdown).await {
                break;
            }
        }
        self.close().await;
        self.context.publish(LeaderState::Stopped);
        tracing::debug!("elector stopped");
        Ok(())
    }

    /// Whether the store keeps a lease of this elector's duration ([`ResourceLock::check_lease`]):
    /// a lease it would drop before the renew deadline (a ZooKeeper session shorter than the
    /// lease, say) is refused before the first attempt, in one error, and the elector stops, as
    /// the `leader` command exits 3. A check that cannot be made now (an outage) is left to the
    /// lock, which refuses such a lease's writes itself.
    async fn check_lease(&self) -> Result<(), ElectionError> {
        let context = &self.context;
        let lease = context.config.lease.lease_duration;
        match context
            .request("check_lease", context.lock.check_lease(lease))
            .await
        {
            Err(err @ LockError::Misconfigured { .. }) => {
                tracing::error!(error = %err, "the store does not keep a lease this long: not running for leadership");
                m::error(&context.config.name, "check_lease", err.kind());
                let refused = ElectionError::Lock {
                    operation: "check_lease",
                    error: Arc::new(err),
                };
                context.tell_error(refused.clone());
                Err(refused)
            }
            Err(err) => {
                tracing::debug!(error = %err, "could not check the lease against the store");
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// After giving up the lease (a step-down, its work ending), a candidate lets the others
    /// take it before it runs again: it waits the longest a follower waits between attempts.
    /// (After a planned handover the request itself keeps it back, and it may be the next one
    /// named.) `false` on shutdown.
    async fn stand_back(&self, shutdown: &CancellationToken) -> bool {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => false,
            () = sleep(self.context.config.longest_retry()) => true,
        }
    }

    /// Closes the lock ([`ResourceLock::close`]) within the request timeout.
    async fn close(&self) {
        let context = &self.context;
        let _ = timeout(context.config.lease.request_timeout, context.lock.close()).await;
    }
}
