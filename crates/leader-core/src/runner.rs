//! The loop that drives a [`LeaderElector`](crate::LeaderElector): client-go's acquire/renew
//! loop, kept to the safety rules S1-S15. The elector hands it what it needs; one term's work is
//! in `work.rs`. This file holds the loop and what it observes and reports; the campaign (the
//! attempts to acquire) is in `runner/campaign.rs`, a term (renewals, requests, release) in
//! `runner/term.rs`.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

use crate::backoff::{Backoff, Jitter};
use crate::config::ElectorConfig;
use crate::error::LockError;
use crate::leadership::{
    ExtensionChanges, ExtensionError, LeaderState, Leadership, LeadershipLost, StepDown,
    StepDownReason, TermDeadline, TermRequest,
};
use crate::lock::{Acquisition, ChangeStream, LeaderEvent, ResourceLock};
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed};
use crate::retry::{FailureLog, LogLine};
use crate::rules::{self, Changes, OtherTerm, Sighting, next_token};
use crate::status::{self, ElectionError, IdentityConflict, Shared};
use crate::view::ObservedTerm;
use crate::work::{StartedFn, TermWork, WorkEnd};

mod campaign;
mod term;

type StoppedFn = Arc<dyn Fn(StepDown) + Send + Sync>;
type NewLeaderFn = Arc<dyn Fn(&str) + Send + Sync>;
type ErrorFn = Arc<dyn Fn(&ElectionError) + Send + Sync>;

/// The callbacks a builder collected.
#[derive(Clone, Default)]
pub(crate) struct Callbacks {
    pub(crate) started: Vec<StartedFn>,
    /// Tasks of each term that run beside the work without keeping the term.
    pub(crate) beside: Vec<StartedFn>,
    pub(crate) stopped: Option<StoppedFn>,
    pub(crate) new_leader: Option<NewLeaderFn>,
    pub(crate) error: Option<ErrorFn>,
}

/// The loop's state: what it runs with and what it has observed.
pub(crate) struct Runner {
    lock: Arc<dyn ResourceLock>,
    config: ElectorConfig,
    callbacks: Callbacks,
    state: watch::Sender<LeaderState>,
    shared: Arc<Mutex<Shared>>,
    /// The last record seen, read or written.
    observed: Option<Observed>,
    /// What this candidate saw of `observed` and since when, on this process's monotonic
    /// clock: the holder's lease (S1, S2) and a pending handover request (S10).
    sighting: Option<Sighting>,
    /// When the holder's lease runs out by the store's clock, as its last `Held` answer said
    /// (on this process's clock, counted from when that answer arrived). Only a wake-up time:
    /// the store itself decides a store-clock acquisition.
    store_expiry: Option<Instant>,
    /// Whether the last `Held` answer said the store keeps the holder's lease alive.
    held_in_store: bool,
    /// Whether a wait was already cut short for `observed`'s expiry: an early wake-up is used
    /// once per version, so a lease that has run out never makes attempts follow each other.
    woke_for_expiry: bool,
    reported_leader: Option<String>,
    /// The fencing token of the last term this process led (S13): a record held by this
    /// identity under another token is another process's.
    own_term: Option<u64>,
    /// A term of this identity that this process did not start, as first seen (S13).
    shared_identity: Option<OtherTerm>,
    /// In a mutex only to keep the runner `Sync`; it is reached through `&mut` and never locked.
    changes: Option<Mutex<ChangeStream>>,
    watch_supported: bool,
    try_acquire_supported: bool,
    /// Waits between a candidate's attempts (S9).
    backoff: Backoff,
    /// Waits between attempts to subscribe to changes, apart from the lock's own requests: a
    /// backend whose notifications fail must not slow down the election itself.
    watch_backoff: Backoff,
    watch_retry_at: Option<Instant>,
    /// Whether a change notification already cut short a back-off since the last success.
    change_shortened_backoff: bool,
    failures: FailureLog,
    watch_failures: FailureLog,
}

enum Attempt {
    Acquired(Observed),
    /// Handed over by a release, on a lease the store confirmed alive at that instant.
    Handed(Observed, Instant),
    NotAcquired,
}

/// What a leader's renewal found.
enum Renewal {
    Renewed,
    /// Someone else holds the lease now.
    Lost,
    /// The record asks for a handover to this candidate.
    HandOver(String),
}

impl Runner {
    pub(crate) fn new(
        lock: Arc<dyn ResourceLock>,
        config: ElectorConfig,
        callbacks: Callbacks,
        state: watch::Sender<LeaderState>,
        shared: Arc<Mutex<Shared>>,
    ) -> Self {
        let backoff = Backoff::new(config.lease.retry_period, config.lease.lease_duration)
            .jitter(Jitter::Spread(config.jitter));
        Self {
            lock,
            config,
            callbacks,
            state,
            shared,
            observed: None,
            sighting: None,
            store_expiry: None,
            held_in_store: false,
            woke_for_expiry: false,
            reported_leader: None,
            own_term: None,
            shared_identity: None,
            changes: None,
            watch_supported: true,
            try_acquire_supported: true,
            watch_backoff: backoff.clone(),
            backoff,
            watch_retry_at: None,
            change_shortened_backoff: false,
            failures: FailureLog::default(),
            watch_failures: FailureLog::default(),
        }
    }

    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        m::set_leading(&self.config.name, false);
        if !self.lease_is_kept().await {
            let _ = timeout(self.config.lease.request_timeout, self.lock.close()).await;
            self.publish(LeaderState::Stopped);
            return;
        }
        while let Some((acquired, started)) = self.acquire(&shutdown).await {
            let reason = self.lead(acquired, started, &shutdown).await;
            if shutdown.is_cancelled() {
                break;
            }
            if reason.stands_back() && !self.stand_back(&shutdown).await {
                break;
            }
        }
        let _ = timeout(self.config.lease.request_timeout, self.lock.close()).await;
        self.publish(LeaderState::Stopped);
        tracing::debug!("elector stopped");
    }

    /// Whether the store keeps a lease of this elector's duration ([`ResourceLock::check_lease`]):
    /// a lease it would drop before the renew deadline (a ZooKeeper session shorter than the
    /// lease, say) is refused before the first attempt, in one error, and the elector stops, as
    /// the `leader` command exits 3. A check that cannot be made now (an outage) is left to the
    /// lock, which refuses such a lease's writes itself.
    async fn lease_is_kept(&mut self) -> bool {
        let lease = self.config.lease.lease_duration;
        match self
            .request("check_lease", self.lock.check_lease(lease))
            .await
        {
            Err(err @ LockError::Misconfigured { .. }) => {
                tracing::error!(error = %err, "the store does not keep a lease this long: not running for leadership");
                m::error(&self.config.name, "check_lease", err.kind());
                self.tell_error(ElectionError::Lock {
                    operation: "check_lease",
                    error: Arc::new(err),
                });
                false
            }
            Err(err) => {
                tracing::debug!(error = %err, "could not check the lease against the store");
                true
            }
            Ok(()) => true,
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
            () = sleep(self.config.longest_retry()) => true,
        }
    }

    fn identity(&self) -> &str {
        self.lock.identity()
    }

    fn publish(&self, state: LeaderState) {
        self.state.send_if_modified(|current| {
            if current.same_as(&state) {
                false
            } else {
                *current = state;
                true
            }
        });
    }

    /// Runs one lock request with the request timeout (S4).
    async fn request<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let after = self.config.lease.request_timeout;
        timeout(after, fut).await.unwrap_or_else(|_| {
            Err(LockError::Timeout {
                lock: self.lock.describe(),
                operation,
                after,
            })
        })
    }

    /// Reports a failed lock request: counted in metrics every time, logged as [`FailureLog`]
    /// says (S9), kept as the failure going on and passed to `on_error`. A lost
    /// compare-and-swap is contention, not a failure: the store answered.
    fn report_error(&mut self, operation: &'static str, err: LockError) {
        self.report_error_shared(operation, Arc::new(err));
    }

    /// [`report_error`](Self::report_error) for an error shared with the term's work.
    fn report_error_shared(&mut self, operation: &'static str, err: Arc<LockError>) {
        m::error(&self.config.name, operation, err.kind());
        if err.is_conflict() {
            tracing::debug!(operation, "lost a compare-and-swap");
            self.report_success();
            return;
        }
        let line = self.failures.failed(operation, &err);
        log_failure(line, operation, &err, self.backoff.failures());
        self.tell_error(ElectionError::Lock {
            operation,
            error: err,
        });
    }

    /// Keeps `error` as the failure going on and passes it to `on_error`.
    fn tell_error(&self, error: ElectionError) {
        status::lock(&self.shared).failed(error.clone());
        if let Some(callback) = &self.callbacks.error {
            callback(&error);
        }
    }

    /// Notes that the store answered: the end of an outage, if there was one.
    fn report_success(&mut self) {
        status::lock(&self.shared).contact();
        log_recovery(self.failures.succeeded(), "lock");
    }

    /// Takes note of a record read or written. The follower's clock for the holder's lease
    /// starts when a version is first seen, after the request returned (S2).
    fn observe(&mut self, observed: Observed) {
        let now = Instant::now();
        let changes = match &mut self.sighting {
            Some(sighting) => sighting.see(&observed, now),
            None => {
                let sighting = Sighting::new(&observed, now);
                self.sighting = Some(sighting);
                Changes {
                    version: true,
                    handover: observed.record.handover_to().is_some(),
                }
            }
        };
        if changes.version {
            self.woke_for_expiry = false;
            status::lock(&self.shared).term = ObservedTerm::of(&observed.record);
        }
        if changes.handover
            && let Some(to) = observed.record.handover_to()
        {
            tracing::info!(to, "handover requested");
        }
        self.check_identity(&observed);
        let holder = &observed.record.holder_identity;
        if !holder.is_empty() && self.reported_leader.as_deref() != Some(holder.as_str()) {
            tracing::info!(leader = %holder, "new leader observed");
            self.reported_leader = Some(holder.clone());
            if let Some(callback) = &self.callbacks.new_leader {
                callback(holder);
            }
        }
        self.observed = Some(observed);
    }

    /// Takes note of a record this candidate acquired: its term is this process's own (S13).
    fn took(&mut self, acquired: &Observed) {
        self.own_term = Some(acquired.record.leader_transitions);
        self.observe(acquired.clone());
    }

    /// True when `record` is the term this process led last: its identity and its token. A
    /// term of this identity with any other token was started by another process (S13).
    fn started(&self, record: &LeaderElectionRecord) -> bool {
        self.own_term
            .is_some_and(|token| rules::is_term(record, self.identity(), token))
    }

    /// S13: a lease held under this candidate's identity by a term this process did not start
    /// is another process's. Says so once when first seen, and reports a conflict once that
    /// term is seen alive: renewed in the record, or still held by the store after it would
    /// have run out. A process of this identity that died holding the lease is not a conflict:
    /// its lease runs out and this one takes over.
    fn check_identity(&mut self, observed: &Observed) {
        let record = &observed.record;
        if !rules::started_elsewhere(record, self.identity(), self.own_term) {
            if self.shared_identity.take().is_some_and(|s| s.reported()) {
                status::lock(&self.shared).identity_conflict = None;
                tracing::info!("the term of the other process with this identity is over");
            }
            return;
        }
        let now = Instant::now();
        let seen = match &mut self.shared_identity {
            Some(seen) if seen.is(observed) => seen,
            _ => {
                tracing::warn!(
                    identity = self.identity(),
                    fencing_token = record.leader_transitions,
                    "the lease is held under this candidate's identity by a term this process did \
                     not start: waiting for it as for another holder (another process may run \
                     with the same identity)"
                );
                self.shared_identity = Some(OtherTerm::new(observed, now, self.store_expiry));
                return;
            }
        };
        // Whether the store keeps leases alive without a new version, as its last answer said;
        // unknown without such answers (a store with no one-request acquisition).
        let kept = self.try_acquire_supported.then_some(self.held_in_store);
        if !seen.seen_alive(observed, kept, self.config.lease.retry_period, now) {
            return;
        }
        let conflict = IdentityConflict {
            lock: self.lock.describe(),
            identity: self.identity().to_owned(),
            fencing_token: record.leader_transitions,
        };
        tracing::error!(
            identity = self.identity(),
            fencing_token = record.leader_transitions,
            "{conflict}"
        );
        m::identity_conflict(&self.config.name);
        status::lock(&self.shared).identity_conflict = Some(conflict.clone());
        if let Some(callback) = &self.callbacks.error {
            callback(&ElectionError::IdentityConflict(conflict));
        }
    }

    fn publish_following(&self) {
        let leader = self
            .observed
            .as_ref()
            .map(|o| &o.record)
            .filter(|r| !r.is_free())
            .map(|r| r.holder_identity.clone());
        self.publish(LeaderState::Following { leader });
    }

    fn spawn_event(&self, event: LeaderEvent) {
        let lock = self.lock.clone();
        let after = self.config.lease.request_timeout;
        tokio::spawn(async move {
            let _ = timeout(after, lock.record_event(&event)).await;
        });
    }
}

/// Logs what [`FailureLog`] decided about a failure.
fn log_failure(line: LogLine, operation: &'static str, err: &LockError, consecutive: u32) {
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
fn log_recovery(line: LogLine, what: &'static str) {
    if let LogLine::Recovered { count, lasted } = line {
        tracing::info!(failures = count, lasted = ?lasted, "{what} requests succeed again");
    }
}

/// The next change notification: `true` when one arrived, `false` when the stream ended. Without
/// a stream it never completes.
async fn next_change(changes: Option<&mut Mutex<ChangeStream>>) -> bool {
    match changes {
        Some(stream) => {
            let stream = stream.get_mut().unwrap_or_else(|p| p.into_inner());
            stream.next().await.is_some()
        }
        None => std::future::pending().await,
    }
}
