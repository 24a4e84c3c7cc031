//! What an elector knows of its own troubles, for the program that runs it: the failure going
//! on, when the store last answered, and another process using this candidate's identity.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::LockError;
use crate::leadership::LeaderState;
use crate::view::{LeaderView, ObservedTerm};

/// Something that keeps an elector from working as it should, as reported to
/// [`on_error`](crate::LeaderElectorBuilder::on_error) and kept by [`ElectorStatus`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ElectionError {
    /// A lock request failed; the elector retries it with back-off (S9). A lost
    /// compare-and-swap is contention, not an error, and is not reported.
    Lock {
        /// The lock operation (`get`, `update`, `renew`, `try_acquire`, `watch`, ...).
        operation: &'static str,
        /// The lock's error.
        error: Arc<LockError>,
    },
    /// Another process leads with this candidate's identity (S13).
    IdentityConflict(IdentityConflict),
}

impl fmt::Display for ElectionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Lock { operation, error } => {
                write!(f, "lock request {operation} failed: {error}")
            }
            Self::IdentityConflict(conflict) => conflict.fmt(f),
        }
    }
}

impl std::error::Error for ElectionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Lock { error, .. } => Some(&**error),
            Self::IdentityConflict(_) => None,
        }
    }
}

/// Another process holds the lease under this candidate's identity, in a term this process did
/// not start, and keeps it alive: two processes were given one identity (one configuration for
/// every replica, a fixed host name). The elector treats that lease as another's and never
/// leads while it lasts (S13): a shared identity is a misconfiguration, never two leaders.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{lock}: another process leads with this candidate's identity {identity:?} (fencing token \
     {fencing_token}); every candidate needs an identity of its own, and this one will not lead \
     while that term lasts"
)]
pub struct IdentityConflict {
    /// The lock's description.
    pub lock: String,
    /// The identity both processes use.
    pub identity: String,
    /// The fencing token of the other process's term.
    pub fencing_token: u64,
}

/// The failure going on: the last error of a run of failed lock requests, since when they
/// fail, and how many in a row.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LastError {
    /// The last error.
    pub error: ElectionError,
    /// When the first failure of this run happened, on the monotonic clock.
    pub since: Instant,
    /// Failed requests in a row.
    pub failures: u32,
}

/// What the runner tells its status handles and health checks.
#[derive(Debug)]
pub(crate) struct Shared {
    /// When the elector was built.
    pub(crate) created: Instant,
    /// Start of the last successful acquisition or renewal while leading.
    pub(crate) renewed_at: Option<Instant>,
    /// When the store last answered a lock request (a lost compare-and-swap is an answer).
    pub(crate) last_contact: Option<Instant>,
    pub(crate) last_error: Option<LastError>,
    pub(crate) identity_conflict: Option<IdentityConflict>,
    /// The leader's term as the record last showed it (for [`LeaderView`]).
    pub(crate) term: Option<ObservedTerm>,
}

impl Shared {
    pub(crate) fn new() -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Self {
            created: Instant::now(),
            renewed_at: None,
            last_contact: None,
            last_error: None,
            identity_conflict: None,
            term: None,
        }))
    }

    pub(crate) fn contact(&mut self) {
        self.last_contact = Some(Instant::now());
        self.last_error = None;
    }

    pub(crate) fn failed(&mut self, error: ElectionError) {
        let now = Instant::now();
        let (since, failures) = match &self.last_error {
            Some(last) => (last.since, last.failures.saturating_add(1)),
            None => (now, 1),
        };
        self.last_error = Some(LastError {
            error,
            since,
            failures,
        });
    }
}

pub(crate) fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// A handle on an elector's troubles and on who leads, for programs that want more than logs:
/// the failure going on, when the store last answered, another process with this identity, and
/// the [`LeaderView`]. Get one with [`LeaderElector::status`](crate::LeaderElector::status)
/// before running the elector; it stays valid while the elector runs and after.
#[derive(Clone, Debug)]
pub struct ElectorStatus {
    name: Arc<str>,
    identity: Arc<str>,
    state: watch::Receiver<LeaderState>,
    shared: Arc<Mutex<Shared>>,
}

impl ElectorStatus {
    pub(crate) fn new(
        name: &str,
        identity: &str,
        state: watch::Receiver<LeaderState>,
        shared: Arc<Mutex<Shared>>,
    ) -> Self {
        Self {
            name: name.into(),
            identity: identity.into(),
            state,
            shared,
        }
    }

    /// Who leads, as this replica sees it now: whether it leads, the leader's identity, its
    /// term's fencing token and since when.
    pub fn view(&self) -> LeaderView {
        let state = self.state.borrow().clone();
        let term = lock(&self.shared).term.clone();
        LeaderView::new(&self.name, &self.identity, &state, term.as_ref())
    }

    /// The failure going on, if lock requests fail now; `None` once the store answers again.
    pub fn last_error(&self) -> Option<LastError> {
        lock(&self.shared).last_error.clone()
    }

    /// When the store last answered a lock request, on the monotonic clock; `None` before its
    /// first answer.
    pub fn last_contact(&self) -> Option<Instant> {
        lock(&self.shared).last_contact
    }

    /// Another process leading with this candidate's identity, while that lasts.
    pub fn identity_conflict(&self) -> Option<IdentityConflict> {
        lock(&self.shared).identity_conflict.clone()
    }
}
