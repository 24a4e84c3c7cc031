//! A health check like client-go's `HealthzAdaptor`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// What the elector tells its health check.
#[derive(Debug, Default)]
pub(crate) struct HealthState {
    /// Start of the last successful acquisition or renewal while leading.
    renewed_at: Option<Instant>,
}

impl HealthState {
    pub(crate) fn lead(&mut self, at: Instant) {
        self.renewed_at = Some(at);
    }

    pub(crate) fn renewed(&mut self, at: Instant) {
        self.renewed_at = Some(at);
    }

    pub(crate) fn follow(&mut self) {
        self.renewed_at = None;
    }
}

/// Reports an elector that believes it leads although its lease ran out: its loop is stuck, so
/// the process should be restarted. Followers are always healthy.
///
/// Wire [`check`](Self::check) to a liveness probe.
#[derive(Clone, Debug)]
pub struct HealthCheck {
    name: String,
    state: Arc<Mutex<HealthState>>,
    lease_duration: Duration,
    tolerance: Duration,
}

/// Why [`HealthCheck::check`] failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "leader election {name}: still leading although the lease was last renewed {since:?} ago (lease duration {lease_duration:?})"
)]
pub struct Unhealthy {
    /// The elector's name.
    pub name: String,
    /// Time since the start of the last successful renewal.
    pub since: Duration,
    /// The lease duration.
    pub lease_duration: Duration,
}

impl HealthCheck {
    pub(crate) fn new(
        name: String,
        state: Arc<Mutex<HealthState>>,
        lease_duration: Duration,
        tolerance: Duration,
    ) -> Self {
        Self {
            name,
            state,
            lease_duration,
            tolerance,
        }
    }

    /// `Ok` unless this elector leads and its last renewal is older than the lease duration plus
    /// the tolerance.
    pub fn check(&self) -> Result<(), Unhealthy> {
        let renewed_at = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .renewed_at;
        match renewed_at {
            Some(at) if at.elapsed() > self.lease_duration + self.tolerance => Err(Unhealthy {
                name: self.name.clone(),
                since: at.elapsed(),
                lease_duration: self.lease_duration,
            }),
            _ => Ok(()),
        }
    }
}
