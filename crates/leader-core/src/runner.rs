//! The loop that drives a [`LeaderElector`](crate::LeaderElector): client-go's acquire/renew
//! loop, kept to the safety rules S1-S13. The elector hands it what it needs; one term's work is
//! in `work.rs`.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

use crate::config::ElectorConfig;
use crate::error::LockError;
use crate::leadership::{
    ExtensionChanges, ExtensionError, LeaderState, Leadership, LeadershipLost, StepDown,
    StepDownReason, TermDeadline, TermRequest,
};
use crate::lock::{Acquisition, ChangeStream, LeaderEvent, ResourceLock};
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed, Version};
use crate::retry::{Backoff, FailureLog, LogLine};
use crate::status::{self, ElectionError, IdentityConflict, Shared};
use crate::view::ObservedTerm;
use crate::work::{StartedFn, TermWork, WorkEnd};

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
    /// When `observed`'s version was first seen, on this process's monotonic clock (S1, S2).
    observed_at: Instant,
    /// When the holder's lease runs out by the store's clock, as its last `Held` answer said
    /// (on this process's clock, counted from when that answer arrived). Only a wake-up time:
    /// the store itself decides a store-clock acquisition.
    store_expiry: Option<Instant>,
    /// Whether the last `Held` answer said the store keeps the holder's lease alive.
    held_in_store: bool,
    /// Whether a wait was already cut short for `observed`'s expiry: an early wake-up is used
    /// once per version, so a lease that has run out never makes attempts follow each other.
    woke_for_expiry: bool,
    /// The pending handover request last seen (the candidate it names), and until when other
    /// candidates stand back: one lease duration (the record's, when the request was first seen)
    /// from then, on this process's clock.
    handover_seen: Option<(String, Instant)>,
    reported_leader: Option<String>,
    /// The fencing token of the last term this process led (S13): a record held by this
    /// identity under another token is another process's.
    own_term: Option<u64>,
    /// A term of this identity that this process did not start, as first seen (S13).
    shared_identity: Option<SharedIdentity>,
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

/// A term held under this candidate's identity that this process did not start (S13).
struct SharedIdentity {
    fencing_token: u64,
    /// The version it was first seen at: a newer one under the same term is a renewal.
    version: Version,
    first_seen: Instant,
    /// When the store said it would run out, when first seen.
    first_expiry: Option<Instant>,
    /// Whether it was found alive (renewed) and reported as a conflict.
    reported: bool,
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
        let backoff = Backoff::new(config.retry_period, config.jitter, config.lease_duration);
        Self {
            lock,
            config,
            callbacks,
            state,
            shared,
            observed: None,
            observed_at: Instant::now(),
            store_expiry: None,
            held_in_store: false,
            woke_for_expiry: false,
            handover_seen: None,
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
        while let Some((acquired, started)) = self.acquire(&shutdown).await {
            let reason = self.lead(acquired, started, &shutdown).await;
            if shutdown.is_cancelled() {
                break;
            }
            if reason.stands_back() && !self.stand_back(&shutdown).await {
                break;
            }
        }
        let _ = timeout(self.config.request_timeout, self.lock.close()).await;
        self.publish(LeaderState::Stopped);
        tracing::debug!("elector stopped");
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
        let after = self.config.request_timeout;
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
        let is_new = self
            .observed
            .as_ref()
            .is_none_or(|previous| previous.version != observed.version);
        if is_new {
            self.observed_at = Instant::now();
            self.woke_for_expiry = false;
            status::lock(&self.shared).term = ObservedTerm::of(&observed.record);
        }
        match observed.record.handover_to() {
            Some(to)
                if self
                    .handover_seen
                    .as_ref()
                    .is_some_and(|(seen, _)| seen == to) => {}
            Some(to) => {
                tracing::info!(to, "handover requested");
                let until = Instant::now() + observed.record.lease_duration;
                self.handover_seen = Some((to.to_owned(), until));
            }
            None => self.handover_seen = None,
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
        record.is_held_by(self.identity()) && self.own_term == Some(record.leader_transitions)
    }

    /// S13: a lease held under this candidate's identity by a term this process did not start
    /// is another process's. Says so once when first seen, and reports a conflict once that
    /// term is seen alive: renewed in the record, or still held by the store after it would
    /// have run out. A process of this identity that died holding the lease is not a conflict:
    /// its lease runs out and this one takes over.
    fn check_identity(&mut self, observed: &Observed) {
        let record = &observed.record;
        if !record.is_held_by(self.identity()) || self.started(record) {
            if self.shared_identity.take().is_some_and(|s| s.reported) {
                status::lock(&self.shared).identity_conflict = None;
                tracing::info!("the term of the other process with this identity is over");
            }
            return;
        }
        let now = Instant::now();
        let seen = match &mut self.shared_identity {
            Some(seen) if seen.fencing_token == record.leader_transitions => seen,
            _ => {
                tracing::warn!(
                    identity = self.identity(),
                    fencing_token = record.leader_transitions,
                    "the lease is held under this candidate's identity by a term this process did \
                     not start: waiting for it as for another holder (another process may run \
                     with the same identity)"
                );
                self.shared_identity = Some(SharedIdentity {
                    fencing_token: record.leader_transitions,
                    version: observed.version.clone(),
                    first_seen: now,
                    first_expiry: self.store_expiry,
                    reported: false,
                });
                return;
            }
        };
        let renewed = seen.version != observed.version;
        // A lease the store keeps alive does not change its version when renewed: it is alive
        // when still held after it would have run out.
        let outlived = self.held_in_store
            && now
                >= seen
                    .first_expiry
                    .unwrap_or(seen.first_seen + record.lease_duration * 2)
                    + self.config.retry_period;
        if seen.reported || !(renewed || outlived) {
            return;
        }
        seen.reported = true;
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

    /// The record of an acquisition by this candidate with token `leader_transitions`, raised
    /// to the configured floor.
    fn desired(
        &self,
        leader_transitions: u64,
        base: Option<&LeaderElectionRecord>,
    ) -> LeaderElectionRecord {
        let now = self.config.wall_clock.now();
        LeaderElectionRecord {
            holder_identity: self.identity().to_owned(),
            lease_duration: self.config.lease_duration,
            acquire_time: now,
            renew_time: now,
            leader_transitions: leader_transitions.max(self.config.fencing_token_floor),
            strategy: base.and_then(|r| r.strategy.clone()),
            // An acquisition fulfils (or overrides) a pending handover request.
            preferred_holder: None,
            // An acquisition keeps the extensions of the record it replaces (a store-clock
            // acquisition keeps the stored ones, whatever these are).
            extensions: base.map(|r| r.extensions.clone()).unwrap_or_default(),
        }
    }

    /// Until when this candidate stands back from `record`, whose pending handover names
    /// another candidate: one lease duration from when it first saw the request. `None` when
    /// no such request is pending.
    fn stand_back_until(&self, record: &LeaderElectionRecord) -> Option<Instant> {
        if !record.reserved_for_other_than(self.identity()) {
            return None;
        }
        self.handover_seen.as_ref().map(|(_, until)| *until)
    }

    /// The candidate loop: returns the acquired record and when the acquiring request started,
    /// or `None` on shutdown.
    async fn acquire(&mut self, shutdown: &CancellationToken) -> Option<(Observed, Instant)> {
        loop {
            if shutdown.is_cancelled() {
                return None;
            }
            self.ensure_watch().await;
            let started = Instant::now();
            let attempt = tokio::select! {
                biased;
                () = shutdown.cancelled() => return None,
                attempt = self.try_acquire() => attempt,
            };
            match attempt {
                Ok(Attempt::Acquired(observed)) => {
                    self.backoff.succeeded();
                    self.report_success();
                    return Some((observed, started));
                }
                Ok(Attempt::Handed(observed, alive_since)) => {
                    // S3: the term counts from when the store last confirmed the lease alive.
                    // With less than a retry period of it left, a renewal confirms it first.
                    let config = &self.config;
                    if Instant::now() + config.retry_period < alive_since + config.renew_deadline {
                        self.backoff.succeeded();
                        self.report_success();
                        return Some((observed, alive_since.min(started)));
                    }
                    let confirming = Instant::now();
                    let mut record = observed.record.clone();
                    record.renew_time = record.renewal_time(self.config.wall_clock.now());
                    let renewal = tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return None,
                        renewal = self.request("renew", self.lock.renew(&observed.version, &record)) => renewal,
                    };
                    match renewal {
                        Ok(stored) => {
                            self.observe(stored.clone());
                            self.backoff.succeeded();
                            self.report_success();
                            return Some((stored, confirming));
                        }
                        Err(err) => {
                            if !err.is_conflict() {
                                self.backoff.failed();
                            }
                            self.report_error("renew", err);
                        }
                    }
                }
                Ok(Attempt::NotAcquired) => {
                    self.backoff.succeeded();
                    self.report_success();
                }
                Err(err) => {
                    if !err.is_conflict() {
                        self.backoff.failed();
                    }
                    self.report_error("acquire", err);
                }
            }
            self.publish_following();
            if !self.wait_for_next_attempt(started, shutdown).await {
                return None;
            }
        }
    }

    /// Waits until the next attempt; `false` on shutdown. A change notification ends the wait at
    /// once. After a failure it ends the back-off no sooner than a retry period after the last
    /// attempt started, and only once until an attempt succeeds: a stream that fires (or ends)
    /// over and over never makes a failing candidate retry faster than its back-off (S9).
    async fn wait_for_next_attempt(
        &mut self,
        attempt_started: Instant,
        shutdown: &CancellationToken,
    ) -> bool {
        let mut wake_at = Instant::now() + self.next_attempt_in();
        let failing = self.backoff.is_failing();
        if !failing {
            self.change_shortened_backoff = false;
        }
        loop {
            let changes = self.changes.as_mut();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return false,
                () = sleep_until(wake_at) => return true,
                more = next_change(changes) => {
                    if !more {
                        // Subscribe again at the next attempt; wait out this one's time.
                        self.changes = None;
                        continue;
                    }
                    if !failing {
                        return true;
                    }
                    if !self.change_shortened_backoff {
                        self.change_shortened_backoff = true;
                        wake_at = wake_at.min(attempt_started + self.config.retry_period);
                    }
                }
            }
        }
    }

    /// How long a candidate waits before the next attempt (S9): after a failure, the back-off;
    /// otherwise the jittered retry period, or less when the observed lease runs out sooner. That
    /// early wake-up is used once per observed version and only for an instant still to come.
    fn next_attempt_in(&mut self) -> Duration {
        let wait = self.backoff.wait();
        if self.backoff.is_failing() || self.woke_for_expiry {
            return wait;
        }
        let Some(observed) = &self.observed else {
            return wait;
        };
        let record = &observed.record;
        let expires = if let Some(until) = self.stand_back_until(record) {
            until
        } else if record.is_free() || self.started(record) {
            return wait;
        } else {
            self.store_expiry
                .unwrap_or(self.observed_at + record.lease_duration)
        };
        let now = Instant::now();
        if expires <= now {
            return wait;
        }
        // A hair past expiry, so the check that follows sees it expired.
        let until = expires - now + Duration::from_millis(1);
        if until < wait {
            self.woke_for_expiry = true;
            return until;
        }
        wait
    }

    /// Subscribes to change notifications when there is no subscription; a failure is retried
    /// on its own back-off, and never delays an attempt.
    async fn ensure_watch(&mut self) {
        if self.changes.is_some() || !self.watch_supported {
            return;
        }
        if self.watch_retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        match self.request("watch", self.lock.watch()).await {
            Ok(stream) => {
                self.watch_supported = stream.is_some();
                self.changes = stream.map(Mutex::new);
                self.watch_backoff.succeeded();
                self.watch_retry_at = None;
                log_recovery(self.watch_failures.succeeded(), "watch");
            }
            Err(err) => {
                m::error(&self.config.name, "watch", err.kind());
                self.watch_backoff.failed();
                self.watch_retry_at = Some(Instant::now() + self.watch_backoff.wait());
                let line = self.watch_failures.failed("watch", &err);
                log_failure(line, "watch", &err, self.watch_backoff.failures());
                self.tell_error(ElectionError::Lock {
                    operation: "watch",
                    error: Arc::new(err),
                });
            }
        }
    }

    /// One attempt of client-go's `tryAcquireOrRenew` for a candidate.
    async fn try_acquire(&mut self) -> Result<Attempt, LockError> {
        self.store_expiry = None;
        self.held_in_store = false;
        let mut current = None;
        if self.try_acquire_supported {
            // The store gives the next token; the floor, if any, is what it asks for at least.
            let desired = self.desired(0, self.observed.as_ref().map(|o| &o.record));
            match self
                .request("try_acquire", self.lock.try_acquire(&desired))
                .await?
            {
                Some(Acquisition::Acquired(observed)) => {
                    self.took(&observed);
                    return Ok(Attempt::Acquired(observed));
                }
                Some(Acquisition::Handed {
                    observed,
                    alive_since,
                }) => {
                    self.took(&observed);
                    return Ok(Attempt::Handed(observed, alive_since));
                }
                Some(Acquisition::Held {
                    observed,
                    expires_in,
                    renewed_in_store,
                }) => {
                    self.store_expiry = expires_in.map(|left| Instant::now() + left);
                    self.held_in_store = renewed_in_store;
                    self.observe(observed.clone());
                    // The holder renews in the store without changing the record: only the
                    // store can say it expired (S2 by the store's clock alone). A term this
                    // process led itself (before its renew deadline passed) it takes again
                    // with a compare-and-swap, below.
                    if renewed_in_store && !self.started(&observed.record) {
                        return Ok(Attempt::NotAcquired);
                    }
                    // The store's clock says held; ours may still say expired (below): a record
                    // the store never expires (written without a TTL by another client) must
                    // not block the election forever (S8).
                    current = Some(observed);
                }
                Some(Acquisition::Unassigned(observed)) => {
                    if let Some(observed) = observed {
                        self.observe(observed);
                    }
                    return Ok(Attempt::NotAcquired);
                }
                None => self.try_acquire_supported = false,
            }
        }
        if current.is_none() {
            let Some(read) = self.request("get", self.lock.get()).await? else {
                let created = self
                    .request("create", self.lock.create(&self.desired(1, None)))
                    .await?;
                self.took(&created);
                return Ok(Attempt::Acquired(created));
            };
            self.observe(read.clone());
            current = Some(read);
        }
        let Some(current) = current else {
            return Ok(Attempt::NotAcquired);
        };
        let record = &current.record;
        // S2: another holder's lease runs for *its* duration from when we first saw this version.
        // A term of this identity that this process did not start is another's (S13).
        if !record.is_free()
            && !self.started(record)
            && Instant::now() < self.observed_at + record.lease_duration
        {
            return Ok(Attempt::NotAcquired);
        }
        // A planned handover to another candidate: stand back for a lease, so that it wins.
        if self
            .stand_back_until(record)
            .is_some_and(|until| Instant::now() < until)
        {
            return Ok(Attempt::NotAcquired);
        }
        // S5: every acquisition, also our own again, gets the next fencing token.
        let desired = self.desired(record.leader_transitions + 1, Some(record));
        let stored = self
            .request("update", self.lock.update(&current.version, &desired))
            .await?;
        self.took(&stored);
        Ok(Attempt::Acquired(stored))
    }

    /// One term of leadership, from acquisition to step-down; returns why it ended.
    async fn lead(
        &mut self,
        acquired: Observed,
        started: Instant,
        shutdown: &CancellationToken,
    ) -> StepDownReason {
        let fencing_token = acquired.record.leader_transitions;
        let cancel = CancellationToken::new();
        // Should this future be dropped mid-term (an aborted task), the work must still stop.
        let _cancel_on_drop = cancel.clone().drop_guard();
        // S3: the term lasts until the start of the last successful renewal plus the deadline.
        let mut deadline = started + self.config.renew_deadline;
        let shared_deadline = TermDeadline::new(deadline.into_std());
        let (leadership, mut requests, alive) = Leadership::new(
            self.config.name.clone(),
            self.identity().to_owned(),
            fencing_token,
            cancel.clone(),
            acquired.record.extensions.clone(),
            shared_deadline.clone(),
            self.config.wall_clock.now(),
        );
        let extensions = leadership.extensions_handle();
        status::lock(&self.shared).renewed_at = Some(started);
        tracing::info!(fencing_token, "became leader");
        m::acquired(&self.config.name);
        m::set_leading(&self.config.name, true);
        self.spawn_event(LeaderEvent::BecameLeader { fencing_token });
        self.publish(LeaderState::Leading(leadership.uncounted()));
        let mut work = TermWork::start(
            &self.callbacks.started,
            &self.callbacks.beside,
            leadership,
            alive,
            self.config.work_exit,
            self.config.retry_period,
        );

        // A handover this term was asked for (by its own work, or by a request in the record).
        let mut hand_to: Option<String> = None;
        // Extensions the term's work asked to write, with where to answer.
        let mut pending: Option<(
            ExtensionChanges,
            oneshot::Sender<Result<(), ExtensionError>>,
        )> = None;
        let reason = loop {
            let changes = self.changes.as_mut();
            tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                Some(request) = requests.recv() => match request {
                    TermRequest::HandOver(to) => {
                        hand_to = Some(to);
                        break StepDownReason::HandedOver;
                    }
                    TermRequest::StepDown => break StepDownReason::SteppedDown,
                    TermRequest::SetExtensions { changes, reply } => {
                        pending = Some((changes, reply));
                    }
                },
                end = work.ended() => match end {
                    WorkEnd::Returned => {
                        let lasted = started.elapsed();
                        if lasted < self.config.retry_period {
                            // `run_while_leading(.., |_| async {})`: every term ends at once,
                            // the work runs again next term, and leadership flaps.
                            tracing::error!(
                                fencing_token,
                                ?lasted,
                                "leader work returned as soon as the term began: the term ends, \
                                 this candidate stands back and campaigns again, so leadership \
                                 flaps and the work runs once per term; work that runs until \
                                 the term ends awaits `leadership.lost()`, and a service whose \
                                 leader-only work is its requests calls `run` (no work) with \
                                 `LeaderOnlyLayer`"
                            );
                        } else {
                            tracing::warn!(fencing_token, "leader work returned: ending the term");
                        }
                        m::work_ended(&self.config.name, false);
                        break StepDownReason::WorkEnded;
                    }
                    WorkEnd::Panicked => {
                        m::work_ended(&self.config.name, true);
                        break StepDownReason::WorkPanicked;
                    }
                },
                () = sleep(self.config.retry_period) => {}
                // A release or a handover request: renew now, which reads what changed.
                more = next_change(changes) => if !more {
                    self.changes = None;
                },
            }
            let attempt_started = Instant::now();
            let write = pending.take();
            let renewed = tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                renewed = self.renew(fencing_token, write.as_ref().map(|(c, _)| c)) => renewed,
            };
            let answer = |result: Result<(), ExtensionError>| {
                if let Some((_, reply)) = write {
                    let _ = reply.send(result);
                }
            };
            match renewed {
                // An answer after the deadline does not extend the term; the next select ends it.
                Ok(Renewal::Renewed) if Instant::now() < deadline => {
                    self.report_success();
                    deadline = attempt_started + self.config.renew_deadline;
                    shared_deadline.set(deadline.into_std());
                    m::renewed(&self.config.name, attempt_started.elapsed());
                    status::lock(&self.shared).renewed_at = Some(attempt_started);
                    if let Some(observed) = &self.observed {
                        *extensions.lock().unwrap_or_else(|p| p.into_inner()) =
                            observed.record.extensions.clone();
                    }
                    answer(Ok(()));
                }
                Ok(Renewal::Renewed) => {
                    answer(Err(ExtensionError::Lost(LeadershipLost { fencing_token })))
                }
                Ok(Renewal::Lost) => {
                    answer(Err(ExtensionError::Lost(LeadershipLost { fencing_token })));
                    break StepDownReason::Lost;
                }
                Ok(Renewal::HandOver(to)) => {
                    answer(Err(ExtensionError::Lost(LeadershipLost { fencing_token })));
                    self.report_success();
                    hand_to = Some(to);
                    break StepDownReason::HandedOver;
                }
                Err(err) => {
                    let err = Arc::new(err);
                    answer(Err(ExtensionError::Lock(err.clone())));
                    self.report_error_shared("renew", err);
                }
            }
        };

        cancel.cancel();
        m::set_leading(&self.config.name, false);
        status::lock(&self.shared).renewed_at = None;
        tracing::info!(fencing_token, ?reason, "stopped leading");
        self.publish_following();
        let stopped = work.stop(self.config.stop_grace).await;
        let mut released = false;
        let release = match reason {
            StepDownReason::Shutdown => self.config.release_on_cancel,
            StepDownReason::RenewDeadlineExceeded | StepDownReason::Lost => false,
            _ => true,
        };
        if release {
            if stopped {
                if reason == StepDownReason::Shutdown {
                    let _ = timeout(self.config.request_timeout, self.lock.withdraw()).await;
                }
                released = self.release(fencing_token, hand_to.as_deref()).await;
                if released && let Some(to) = &hand_to {
                    tracing::info!(fencing_token, to, "handed the lease over");
                    m::handed_over(&self.config.name);
                }
            } else {
                tracing::warn!(
                    fencing_token,
                    "leader work did not stop within the grace period; not releasing the lease, it will expire"
                );
            }
        }
        // What the release wrote (a free lease, or one handed to another), not this term.
        self.publish_following();
        self.spawn_event(LeaderEvent::StoppedLeading { fencing_token });
        if let Some(callback) = &self.callbacks.stopped {
            callback(StepDown {
                fencing_token,
                reason,
                released,
            });
        }
        reason
    }

    /// Renews the lease: one request from the cached record (client-go's fast path), and a read
    /// only when that loses the compare-and-swap, which is also how a handover request written
    /// by someone else is found.
    async fn renew(
        &mut self,
        fencing_token: u64,
        changes: Option<&ExtensionChanges>,
    ) -> Result<Renewal, LockError> {
        if let Some(cached) = self
            .observed
            .clone()
            .filter(|o| self.is_ours(o, fencing_token) && o.record.handover_to().is_none())
        {
            let mut record = cached.record.clone();
            record.renew_time = record.renewal_time(self.config.wall_clock.now());
            let written = match changes {
                // Extensions change the record: a write, which renews too.
                Some(changes) => {
                    changes.apply(&mut record.extensions);
                    self.request("update", self.lock.update(&cached.version, &record))
                        .await
                }
                None => {
                    self.request("renew", self.lock.renew(&cached.version, &record))
                        .await
                }
            };
            match written {
                Ok(stored) => {
                    self.observe(stored);
                    return Ok(Renewal::Renewed);
                }
                Err(err) if err.is_conflict() => {}
                Err(err) => return Err(err),
            }
        }
        m::slow_path(&self.config.name);
        let Some(current) = self.request("get", self.lock.get()).await? else {
            return Ok(Renewal::Lost);
        };
        self.observe(current.clone());
        if !self.is_ours(&current, fencing_token) {
            return Ok(Renewal::Lost);
        }
        if let Some(to) = current.record.handover_to()
            && to != self.identity()
        {
            return Ok(Renewal::HandOver(to.to_owned()));
        }
        let mut record = current.record.clone();
        record.renew_time = record.renewal_time(self.config.wall_clock.now());
        if let Some(changes) = changes {
            changes.apply(&mut record.extensions);
        }
        let stored = if record.handover_to().is_some() || changes.is_some() {
            // A request naming this leader is fulfilled already: clear it.
            record.preferred_holder = None;
            self.request("update", self.lock.update(&current.version, &record))
                .await?
        } else {
            self.request("renew", self.lock.renew(&current.version, &record))
                .await?
        };
        self.observe(stored);
        Ok(Renewal::Renewed)
    }

    /// The record is this term's: our identity and our fencing token (a re-acquisition by a
    /// process with the same identity would have raised the token).
    fn is_ours(&self, observed: &Observed, fencing_token: u64) -> bool {
        observed.record.is_held_by(self.identity())
            && observed.record.leader_transitions == fencing_token
    }

    /// Clears the holder with a compare-and-swap, so a release never frees a lease that someone
    /// else holds (S6). A handover names `hand_to` as the next holder; otherwise a pending
    /// request in the record is kept.
    async fn release(&mut self, fencing_token: u64, hand_to: Option<&str>) -> bool {
        let mut current = self.observed.clone();
        // Two tries: from the cached record, then, if that lost the compare-and-swap, from a
        // fresh read. The cache can be stale without anyone else having written: a renewal cut
        // short by the shutdown may still have reached the store.
        for attempt in 0..2 {
            let Some(ours) = current.filter(|o| self.is_ours(o, fencing_token)) else {
                return false;
            };
            let now = self.config.wall_clock.now();
            let mut record = LeaderElectionRecord {
                holder_identity: String::new(),
                acquire_time: now,
                renew_time: now,
                ..ours.record.clone()
            };
            if let Some(to) = hand_to {
                record.preferred_holder = Some(to.to_owned());
            }
            match self
                .request("release", self.lock.update(&ours.version, &record))
                .await
            {
                Ok(stored) => {
                    tracing::info!(fencing_token, "released the lease");
                    self.observe(stored);
                    return true;
                }
                Err(err) if err.is_conflict() && attempt == 0 => {
                    current = match self.request("get", self.lock.get()).await {
                        Ok(fresh) => fresh,
                        Err(err) => {
                            self.report_error("release", err);
                            return false;
                        }
                    };
                    if let Some(fresh) = &current {
                        self.observe(fresh.clone());
                    }
                }
                Err(err) => {
                    self.report_error("release", err);
                    return false;
                }
            }
        }
        false
    }

    fn spawn_event(&self, event: LeaderEvent) {
        let lock = self.lock.clone();
        let after = self.config.request_timeout;
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
