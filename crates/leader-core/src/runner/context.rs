//! What the campaign and the term run with: the lock, the configuration and the callbacks,
//! and how both publish the state, make a lock request and report its outcome.

use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::timeout;

use crate::config::ElectorConfig;
use crate::error::LockError;
use crate::leadership::{LeaderState, StepDown};
use crate::lock::{LeaderEvent, ResourceLock, within};
use crate::metrics as m;
use crate::record::Observed;
use crate::retry::{FailureLog, LogLine};
use crate::status::{self, ElectionError, Shared};
use crate::work::StartedFn;

/// Called when a term ends ([`Callbacks::stopped`]).
type StoppedFn = Arc<dyn Fn(StepDown) + Send + Sync>;
/// Called with each new leader observed ([`Callbacks::new_leader`]).
type NewLeaderFn = Arc<dyn Fn(&str) + Send + Sync>;
/// Called with each error ([`Callbacks::error`]).
type ErrorFn = Arc<dyn Fn(&ElectionError) + Send + Sync>;

/// The callbacks a builder collected.
#[derive(Clone, Default)]
pub(crate) struct Callbacks {
    /// The work of each term (`on_started_leading`).
    pub(crate) started: Vec<StartedFn>,
    /// Tasks of each term that run beside the work without keeping the term.
    pub(crate) beside: Vec<StartedFn>,
    /// `on_stopped_leading`: only for a process that led (S7).
    pub(crate) stopped: Option<StoppedFn>,
    /// `on_new_leader`.
    pub(crate) new_leader: Option<NewLeaderFn>,
    /// `on_error`.
    pub(crate) error: Option<ErrorFn>,
}

/// What the campaign and the term run with: the lock, the configuration and callbacks, and
/// where they publish and report. Both read its lock, settings, callbacks and status; its
/// methods are what both do alike.
pub(crate) struct Context {
    /// The lock this elector runs on.
    pub(super) lock: Arc<dyn ResourceLock>,
    /// The elector's settings.
    pub(super) config: ElectorConfig,
    /// The callbacks the builder collected.
    pub(super) callbacks: Callbacks,
    /// The state channel ([`LeaderElector::subscribe`](crate::LeaderElector::subscribe)).
    state: watch::Sender<LeaderState>,
    /// What [`LeaderElector::status`](crate::LeaderElector::status) reads.
    pub(super) shared: Arc<Mutex<Shared>>,
    /// The failed lock requests, the campaign's and the term's alike: one outage, one log (S9).
    failures: FailureLog,
}

impl Context {
    /// The context of an elector on `lock` that has reported nothing yet.
    pub(crate) fn new(
        lock: Arc<dyn ResourceLock>,
        config: ElectorConfig,
        callbacks: Callbacks,
        state: watch::Sender<LeaderState>,
        shared: Arc<Mutex<Shared>>,
    ) -> Self {
        Self {
            lock,
            config,
            callbacks,
            state,
            shared,
            failures: FailureLog::default(),
        }
    }

    /// This candidate's identity.
    pub(super) fn identity(&self) -> &str {
        self.lock.identity()
    }

    /// Sends `state` on the state channel, unless it says what the channel holds already.
    pub(super) fn publish(&self, state: LeaderState) {
        self.state.send_if_modified(|current| {
            if current.same_as(&state) {
                false
            } else {
                *current = state;
                true
            }
        });
    }

    /// Publishes that this candidate follows the holder of `observed`, if it has one.
    pub(super) fn publish_following(&self, observed: Option<&Observed>) {
        let leader = observed
            .map(|o| &o.record)
            .filter(|r| !r.is_free())
            .map(|r| r.holder_identity.clone());
        self.publish(LeaderState::Following { leader });
    }

    /// Runs one lock request with the request timeout (S4).
    pub(super) async fn request<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        within(
            &*self.lock,
            operation,
            self.config.lease.request_timeout,
            fut,
        )
        .await
    }

    /// Reports a failed lock request: counted in metrics every time, logged as [`FailureLog`]
    /// says (S9) with the `consecutive` failed attempts of the campaign, kept as the failure
    /// going on and passed to `on_error`. A lost compare-and-swap is contention, not a
    /// failure: the store answered.
    pub(super) fn report_error(
        &mut self,
        operation: &'static str,
        err: impl Into<Arc<LockError>>,
        consecutive: u32,
    ) {
        let err = err.into();
        m::error(&self.config.name, operation, err.kind());
        if err.is_conflict() {
            tracing::debug!(operation, "lost a compare-and-swap");
            self.report_success();
            return;
        }
        let line = self.failures.failed(operation, &err);
        log_failure(line, operation, &err, consecutive);
        self.tell_error(ElectionError::Lock {
            operation,
            error: err,
        });
    }

    /// Keeps `error` as the failure going on and passes it to `on_error`.
    pub(super) fn tell_error(&self, error: ElectionError) {
        status::lock(&self.shared).failed(error.clone());
        if let Some(callback) = &self.callbacks.error {
            callback(&error);
        }
    }

    /// Notes that the store answered: the end of an outage, if there was one.
    pub(super) fn report_success(&mut self) {
        status::lock(&self.shared).contact();
        log_recovery(self.failures.succeeded(), "lock");
    }

    /// Records `event` in the backend's event facility, in the background and best effort.
    pub(super) fn spawn_event(&self, event: LeaderEvent) {
        let lock = self.lock.clone();
        let after = self.config.lease.request_timeout;
        tokio::spawn(async move {
            let _ = timeout(after, lock.record_event(&event)).await;
        });
    }
}

/// Logs what [`FailureLog`] decided about a failure.
pub(super) fn log_failure(
    line: LogLine,
    operation: &'static str,
    err: &LockError,
    consecutive: u32,
) {
    match line {
        LogLine::Started => {
            tracing::warn!(operation, error = %err, "lock request failed; retrying with back-off");
        }
        LogLine::Changed => {
            tracing::warn!(operation, error = %err, "lock request failed differently; still retrying");
        }
        LogLine::Summary { count, since } => tracing::warn!(
            operation,
            failures = count,
            since = ?since,
            consecutive,
            last_error = %err,
            "lock requests still failing"
        ),
        LogLine::Quiet | LogLine::Recovered { .. } => {
            tracing::debug!(operation, error = %err, "lock request failed");
        }
    }
}

/// Logs the end of an outage, if one ended.
pub(super) fn log_recovery(line: LogLine, what: &'static str) {
    if let LogLine::Recovered { count, lasted } = line {
        tracing::info!(failures = count, lasted = ?lasted, "{what} requests succeed again");
    }
}
