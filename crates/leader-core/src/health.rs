//! A health check like client-go's `HealthzAdaptor`, and a readiness check for replicas that
//! could not take over.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::status::{self, IdentityConflict, Shared};

/// Checks an elector for probes: [`check`](Self::check) for liveness (a leader whose loop is
/// stuck), [`ready`](Self::ready) for readiness (a replica that could not take over).
///
/// Get one with [`LeaderElector::health_check`](crate::LeaderElector::health_check).
#[derive(Clone, Debug)]
pub struct HealthCheck {
    name: String,
    shared: Arc<Mutex<Shared>>,
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

/// Why [`HealthCheck::ready`] failed: this replica could not take over if the leader went away.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotReady {
    /// The store has not answered for longer than a lease (plus the tolerance).
    #[error(
        "leader election {name}: the store has not answered for {since:?} (lease duration {lease_duration:?}){}",
        last_error.as_ref().map(|e| format!("; last error: {e}")).unwrap_or_default()
    )]
    StoreUnreachable {
        /// The elector's name.
        name: String,
        /// Time since the store last answered (or since the elector was built).
        since: Duration,
        /// The lease duration.
        lease_duration: Duration,
        /// The last error, as text.
        last_error: Option<String>,
    },
    /// Another process leads with this candidate's identity.
    #[error("leader election {name}: {conflict}")]
    IdentityConflict {
        /// The elector's name.
        name: String,
        /// The conflict.
        conflict: IdentityConflict,
    },
}

impl HealthCheck {
    pub(crate) fn new(
        name: String,
        shared: Arc<Mutex<Shared>>,
        lease_duration: Duration,
        tolerance: Duration,
    ) -> Self {
        Self {
            name,
            shared,
            lease_duration,
            tolerance,
        }
    }

    /// Liveness: `Ok` unless this elector leads and its last renewal is older than the lease
    /// duration plus the tolerance (its loop is stuck, so the process should be restarted).
    /// Followers are always live.
    pub fn check(&self) -> Result<(), Unhealthy> {
        let renewed_at = status::lock(&self.shared).renewed_at;
        match renewed_at {
            Some(at) if at.elapsed() > self.lease_duration + self.tolerance => Err(Unhealthy {
                name: self.name.clone(),
                since: at.elapsed(),
                lease_duration: self.lease_duration,
            }),
            _ => Ok(()),
        }
    }

    /// Readiness: `Ok` unless this replica could not take over: the store has not answered it
    /// for longer than the lease duration plus the tolerance (counted from when the elector was
    /// built, before its first answer), or another process leads with its identity. A replica
    /// that is not ready keeps running for leadership; the probe only says so.
    pub fn ready(&self) -> Result<(), NotReady> {
        let shared = status::lock(&self.shared);
        if let Some(conflict) = &shared.identity_conflict {
            return Err(NotReady::IdentityConflict {
                name: self.name.clone(),
                conflict: conflict.clone(),
            });
        }
        let since = shared.last_contact.unwrap_or(shared.created).elapsed();
        if since > self.lease_duration + self.tolerance {
            return Err(NotReady::StoreUnreachable {
                name: self.name.clone(),
                since,
                lease_duration: self.lease_duration,
                last_error: shared.last_error.as_ref().map(|e| e.error.to_string()),
            });
        }
        Ok(())
    }
}
