//! The elector: client-go's acquire/renew loop, kept to the safety rules S1-S8.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::{ConfigError, LockError};
use crate::health::{HealthCheck, HealthState};
use crate::leadership::{LeaderState, Leadership, StepDown, StepDownReason};
use crate::lock::{Acquisition, ChangeStream, LeaderEvent, ResourceLock};
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed};

/// client-go's default lease duration.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// client-go's default renew deadline.
pub const DEFAULT_RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// client-go's default retry period.
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);
/// client-go's jitter factor: candidates wait up to `retry_period * (1 + jitter)`; the renew
/// deadline must exceed `retry_period` times this factor (S4).
pub const JITTER_FACTOR: f64 = 1.2;

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;
type StartedFn = Arc<dyn Fn(Leadership) -> BoxFuture + Send + Sync>;
type StoppedFn = Arc<dyn Fn(StepDown) + Send + Sync>;
type NewLeaderFn = Arc<dyn Fn(&str) + Send + Sync>;

#[derive(Clone, Default)]
struct Callbacks {
    started: Vec<StartedFn>,
    stopped: Option<StoppedFn>,
    new_leader: Option<NewLeaderFn>,
}

/// The elector's timings and switches, as validated by [`LeaderElectorBuilder::build`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ElectorConfig {
    /// Name for logs and metrics labels.
    pub name: String,
    /// How long followers wait after the last change they saw before taking over.
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// Time between attempts.
    pub retry_period: Duration,
    /// Candidates wait `retry_period * (1 + random(0..jitter))` between attempts.
    pub jitter: f64,
    /// Timeout of every lock request.
    pub request_timeout: Duration,
    /// How long the elector waits for the leader's work to stop after cancelling it.
    pub stop_grace: Duration,
    /// Release the lease on shutdown.
    pub release_on_cancel: bool,
}

/// Builds a [`LeaderElector`]; start with [`LeaderElector::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct LeaderElectorBuilder {
    lock: Arc<dyn ResourceLock>,
    name: Option<String>,
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
    jitter: f64,
    request_timeout: Option<Duration>,
    stop_grace: Option<Duration>,
    release_on_cancel: bool,
    callbacks: Callbacks,
}

impl fmt::Debug for LeaderElectorBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderElectorBuilder")
            .field("lock", &self.lock.describe())
            .field("lease_duration", &self.lease_duration)
            .field("renew_deadline", &self.renew_deadline)
            .field("retry_period", &self.retry_period)
            .finish_non_exhaustive()
    }
}

impl LeaderElectorBuilder {
    /// Name for logs and metrics (default: the lock's description).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How long followers wait, after the last change of the record they saw, before they take
    /// over (default 15 s). The leader writes it into the record; followers honour the holder's
    /// value, not their own.
    pub fn lease_duration(mut self, duration: Duration) -> Self {
        self.lease_duration = duration;
        self
    }

    /// How long the leader keeps leading without a successful renewal (default 10 s). Its
    /// leadership is cancelled at the start of the last successful renewal plus this.
    pub fn renew_deadline(mut self, duration: Duration) -> Self {
        self.renew_deadline = duration;
        self
    }

    /// Time between renewals, and the base wait between attempts to acquire (default 2 s).
    pub fn retry_period(mut self, duration: Duration) -> Self {
        self.retry_period = duration;
        self
    }

    /// Spread of a candidate's wait between attempts: `retry_period * (1 + random(0..jitter))`
    /// (default 1.2, client-go's). Zero makes candidates retry on exact ticks.
    pub fn jitter(mut self, factor: f64) -> Self {
        self.jitter = factor;
        self
    }

    /// Timeout of every request to the lock (default: half the renew deadline).
    pub fn request_timeout(mut self, duration: Duration) -> Self {
        self.request_timeout = Some(duration);
        self
    }

    /// How long the elector waits for the leader's work to stop once its leadership is cancelled
    /// (default: lease duration minus renew deadline, the time that remains before a follower can
    /// take over). Work still running then is aborted (callbacks) or left behind with a warning,
    /// and on shutdown the lease is not released but left to expire.
    pub fn stop_grace(mut self, duration: Duration) -> Self {
        self.stop_grace = Some(duration);
        self
    }

    /// Release the lease on shutdown, so a follower takes over at once instead of after the
    /// lease duration (default true). The release waits for the leader's work to stop first.
    pub fn release_on_cancel(mut self, release: bool) -> Self {
        self.release_on_cancel = release;
        self
    }

    /// Called, in a task of its own, each time this candidate becomes leader (client-go's
    /// `OnStartedLeading`). The work should stop when [`Leadership::lost`] completes; the elector
    /// waits for it before releasing or running again.
    pub fn on_started_leading<F, Fut>(mut self, callback: F) -> Self
    where
        F: Fn(Leadership) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.callbacks
            .started
            .push(Arc::new(move |leadership| Box::pin(callback(leadership))));
        self
    }

    /// Called when a term of this candidate ends, after its work has stopped (client-go's
    /// `OnStoppedLeading`, but only for a candidate that led: client-go#1187).
    pub fn on_stopped_leading<F>(mut self, callback: F) -> Self
    where
        F: Fn(StepDown) + Send + Sync + 'static,
    {
        self.callbacks.stopped = Some(Arc::new(callback));
        self
    }

    /// Called with the leader's identity whenever a different leader is observed, this
    /// candidate's own included (client-go's `OnNewLeader`). Keep it quick: it runs in the loop.
    pub fn on_new_leader<F>(mut self, callback: F) -> Self
    where
        F: Fn(&str) + Send + Sync + 'static,
    {
        self.callbacks.new_leader = Some(Arc::new(callback));
        self
    }

    /// Validates the configuration (S4) and builds the elector.
    pub fn build(self) -> Result<LeaderElector, ConfigError> {
        if self.lock.identity().is_empty() {
            return Err(ConfigError::EmptyIdentity);
        }
        if self.retry_period.is_zero() {
            return Err(ConfigError::ZeroRetryPeriod);
        }
        if !(self.jitter.is_finite() && (0.0..=10.0).contains(&self.jitter)) {
            return Err(ConfigError::InvalidJitter(self.jitter));
        }
        if self.renew_deadline <= self.retry_period.mul_f64(JITTER_FACTOR) {
            return Err(ConfigError::RenewDeadlineNotLongerThanRetry {
                renew_deadline: self.renew_deadline,
                retry_period: self.retry_period,
                factor: JITTER_FACTOR,
            });
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(ConfigError::LeaseNotLongerThanRenewDeadline {
                lease_duration: self.lease_duration,
                renew_deadline: self.renew_deadline,
            });
        }
        let request_timeout = self.request_timeout.unwrap_or(self.renew_deadline / 2);
        if request_timeout.is_zero() || request_timeout > self.renew_deadline {
            return Err(ConfigError::InvalidRequestTimeout {
                request_timeout,
                renew_deadline: self.renew_deadline,
            });
        }
        let config = ElectorConfig {
            name: self.name.unwrap_or_else(|| self.lock.describe()),
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
            jitter: self.jitter,
            request_timeout,
            stop_grace: self
                .stop_grace
                .unwrap_or(self.lease_duration - self.renew_deadline),
            release_on_cancel: self.release_on_cancel,
        };
        let (state, _) = watch::channel(LeaderState::Unknown);
        let health = Arc::new(Mutex::new(HealthState::default()));
        Ok(LeaderElector {
            lock: self.lock,
            config,
            callbacks: self.callbacks,
            state,
            health,
        })
    }
}

/// Runs for leadership on a [`ResourceLock`] until shut down: client-go's `LeaderElector`, with
/// fencing tokens, release that waits for the leader's work, and no one-shot `Run`.
///
/// ```
/// use std::time::Duration;
/// use leader_core::{LeaderElector, MemoryLock};
/// use tokio_util::sync::CancellationToken;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let elector = LeaderElector::builder(MemoryLock::new("jobs", "replica-1"))
///     .lease_duration(Duration::from_secs(15))
///     .on_started_leading(|leadership| async move {
///         println!("leading with fencing token {}", leadership.fencing_token());
///         leadership.lost().await; // do the work until leadership ends
///     })
///     .build()?;
/// let mut state = elector.subscribe();
/// let shutdown = CancellationToken::new();
/// let running = tokio::spawn(elector.run(shutdown.clone()));
/// state.wait_for(|s| s.is_leading()).await?;
/// shutdown.cancel(); // steps down, waits for the work, releases the lease
/// running.await?;
/// # Ok(())
/// # }
/// ```
pub struct LeaderElector {
    lock: Arc<dyn ResourceLock>,
    config: ElectorConfig,
    callbacks: Callbacks,
    state: watch::Sender<LeaderState>,
    health: Arc<Mutex<HealthState>>,
}

impl fmt::Debug for LeaderElector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderElector")
            .field("lock", &self.lock.describe())
            .field("identity", &self.lock.identity())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl LeaderElector {
    /// Starts a builder with client-go's defaults (15 s / 10 s / 2 s, jitter 1.2).
    pub fn builder(lock: impl ResourceLock + 'static) -> LeaderElectorBuilder {
        LeaderElectorBuilder {
            lock: Arc::new(lock),
            name: None,
            lease_duration: DEFAULT_LEASE_DURATION,
            renew_deadline: DEFAULT_RENEW_DEADLINE,
            retry_period: DEFAULT_RETRY_PERIOD,
            jitter: JITTER_FACTOR,
            request_timeout: None,
            stop_grace: None,
            release_on_cancel: true,
            callbacks: Callbacks::default(),
        }
    }

    /// The validated configuration.
    pub fn config(&self) -> &ElectorConfig {
        &self.config
    }

    /// The identity this elector runs as.
    pub fn identity(&self) -> &str {
        self.lock.identity()
    }

    /// A channel of the current state: unknown, following whom, or leading with which token.
    pub fn subscribe(&self) -> watch::Receiver<LeaderState> {
        self.state.subscribe()
    }

    /// A health check like client-go's `HealthzAdaptor`: it fails while this elector believes it
    /// leads although its lease expired more than `tolerance` ago (a stuck leader).
    pub fn health_check(&self, tolerance: Duration) -> HealthCheck {
        HealthCheck::new(
            self.config.name.clone(),
            self.health.clone(),
            self.config.lease_duration,
            tolerance,
        )
    }

    /// Runs for leadership until `shutdown` is cancelled. After losing leadership it becomes a
    /// candidate again (S7). On shutdown it cancels the leadership, waits for the work to stop
    /// and releases the lease if configured (S6).
    pub async fn run(self, shutdown: CancellationToken) {
        let span = tracing::info_span!(
            "leader_election",
            name = %self.config.name,
            identity = %self.lock.identity(),
        );
        Runner::new(self).run(shutdown).instrument(span).await;
    }

    /// Runs for leadership until `shutdown` is cancelled and runs `work` during each term: the
    /// future starts when this candidate becomes leader and is dropped the moment leadership ends.
    pub async fn run_while_leading<F, Fut>(mut self, shutdown: CancellationToken, work: F)
    where
        F: Fn(Leadership) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let work = Arc::new(work);
        self.callbacks.started.push(Arc::new(move |leadership| {
            let work = work.clone();
            Box::pin(async move {
                let _ = leadership.run(work(leadership.clone())).await;
            })
        }));
        self.run(shutdown).await;
    }
}

/// The loop's mutable state.
struct Runner {
    lock: Arc<dyn ResourceLock>,
    config: ElectorConfig,
    callbacks: Callbacks,
    state: watch::Sender<LeaderState>,
    health: Arc<Mutex<HealthState>>,
    /// The last record seen, read or written.
    observed: Option<Observed>,
    /// When `observed`'s version was first seen, on this process's monotonic clock (S1, S2).
    observed_at: Instant,
    /// When the holder's lease runs out by the store's clock, as its last `Held` answer said
    /// (on this process's clock, counted from when that answer arrived). Only a wake-up time:
    /// the store itself decides a store-clock acquisition.
    store_expiry: Option<Instant>,
    reported_leader: Option<String>,
    /// In a mutex only to keep the runner `Sync`; it is reached through `&mut` and never locked.
    changes: Option<Mutex<ChangeStream>>,
    watch_supported: bool,
    try_acquire_supported: bool,
}

enum Attempt {
    Acquired(Observed),
    NotAcquired,
}

impl Runner {
    fn new(elector: LeaderElector) -> Self {
        Self {
            lock: elector.lock,
            config: elector.config,
            callbacks: elector.callbacks,
            state: elector.state,
            health: elector.health,
            observed: None,
            observed_at: Instant::now(),
            store_expiry: None,
            reported_leader: None,
            changes: None,
            watch_supported: true,
            try_acquire_supported: true,
        }
    }

    async fn run(mut self, shutdown: CancellationToken) {
        m::set_leading(&self.config.name, false);
        while let Some((acquired, started)) = self.acquire(&shutdown).await {
            self.lead(acquired, started, &shutdown).await;
            if shutdown.is_cancelled() {
                break;
            }
        }
        self.publish(LeaderState::Stopped);
        tracing::debug!("elector stopped");
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
        timeout(after, fut)
            .await
            .unwrap_or(Err(LockError::Timeout { operation, after }))
    }

    fn report_error(&self, operation: &'static str, err: &LockError) {
        m::error(&self.config.name, operation, err.kind());
        match err {
            LockError::Conflict { .. } => tracing::debug!(operation, "lost a compare-and-swap"),
            _ => tracing::warn!(operation, error = %err, "lock request failed"),
        }
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
        }
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

    fn publish_following(&self) {
        let leader = self
            .observed
            .as_ref()
            .map(|o| &o.record)
            .filter(|r| !r.is_free())
            .map(|r| r.holder_identity.clone());
        self.publish(LeaderState::Following { leader });
    }

    fn desired(
        &self,
        leader_transitions: u64,
        base: Option<&LeaderElectionRecord>,
    ) -> LeaderElectionRecord {
        let now = Utc::now();
        LeaderElectionRecord {
            holder_identity: self.identity().to_owned(),
            lease_duration: self.config.lease_duration,
            acquire_time: now,
            renew_time: now,
            leader_transitions,
            strategy: base.and_then(|r| r.strategy.clone()),
            preferred_holder: base.and_then(|r| r.preferred_holder.clone()),
        }
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
                Ok(Attempt::Acquired(observed)) => return Some((observed, started)),
                Ok(Attempt::NotAcquired) => {}
                Err(err) => self.report_error("acquire", &err),
            }
            self.publish_following();
            let wait = self.next_attempt_in();
            let changes = self.changes.as_mut();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return None,
                () = sleep(wait) => {}
                more = next_change(changes) => {
                    if !more {
                        self.changes = None;
                    }
                }
            }
        }
    }

    /// How long a candidate waits before the next attempt: the jittered retry period, or less
    /// when the observed lease runs out sooner.
    fn next_attempt_in(&self) -> Duration {
        let jitter = self
            .config
            .retry_period
            .mul_f64(fastrand::f64() * self.config.jitter);
        let mut wait = self.config.retry_period + jitter;
        if let Some(observed) = &self.observed {
            let record = &observed.record;
            if !record.is_free() && record.holder_identity != self.identity() {
                let expires = self
                    .store_expiry
                    .unwrap_or(self.observed_at + record.lease_duration);
                // A hair past expiry, so the check that follows sees it expired.
                let until =
                    expires.saturating_duration_since(Instant::now()) + Duration::from_millis(1);
                wait = wait.min(until);
            }
        }
        wait
    }

    async fn ensure_watch(&mut self) {
        if self.changes.is_some() || !self.watch_supported {
            return;
        }
        match self.request("watch", self.lock.watch()).await {
            Ok(Some(stream)) => self.changes = Some(Mutex::new(stream)),
            Ok(None) => self.watch_supported = false,
            Err(err) => self.report_error("watch", &err),
        }
    }

    /// One attempt of client-go's `tryAcquireOrRenew` for a candidate.
    async fn try_acquire(&mut self) -> Result<Attempt, LockError> {
        self.store_expiry = None;
        if self.try_acquire_supported {
            let desired = self.desired(0, self.observed.as_ref().map(|o| &o.record));
            match self
                .request("try_acquire", self.lock.try_acquire(&desired))
                .await?
            {
                Some(Acquisition::Acquired(observed)) => {
                    self.observe(observed.clone());
                    return Ok(Attempt::Acquired(observed));
                }
                Some(Acquisition::Held {
                    observed,
                    expires_in,
                }) => {
                    self.observe(observed);
                    self.store_expiry = expires_in.map(|left| Instant::now() + left);
                    return Ok(Attempt::NotAcquired);
                }
                None => self.try_acquire_supported = false,
            }
        }

        let Some(current) = self.request("get", self.lock.get()).await? else {
            let created = self
                .request("create", self.lock.create(&self.desired(1, None)))
                .await?;
            self.observe(created.clone());
            return Ok(Attempt::Acquired(created));
        };
        self.observe(current.clone());
        let record = &current.record;
        // S2: another holder's lease runs for *its* duration from when we first saw this version.
        if !record.is_free()
            && record.holder_identity != self.identity()
            && Instant::now() < self.observed_at + record.lease_duration
        {
            return Ok(Attempt::NotAcquired);
        }
        // S5: every acquisition, also our own again, gets the next fencing token.
        let desired = self.desired(record.leader_transitions + 1, Some(record));
        let stored = self
            .request("update", self.lock.update(&current.version, &desired))
            .await?;
        self.observe(stored.clone());
        Ok(Attempt::Acquired(stored))
    }

    /// One term of leadership, from acquisition to step-down.
    async fn lead(&mut self, acquired: Observed, started: Instant, shutdown: &CancellationToken) {
        let fencing_token = acquired.record.leader_transitions;
        let cancel = CancellationToken::new();
        // Should this future be dropped mid-term (an aborted task), the work must still stop.
        let _cancel_on_drop = cancel.clone().drop_guard();
        let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
        let leadership = Leadership::new(
            self.config.name.clone(),
            self.identity().to_owned(),
            fencing_token,
            cancel.clone(),
            alive_tx,
        );
        // S3: the term lasts until the start of the last successful renewal plus the deadline.
        let mut deadline = started + self.config.renew_deadline;
        self.health_update(|h| h.lead(started));
        tracing::info!(fencing_token, "became leader");
        m::acquired(&self.config.name);
        m::set_leading(&self.config.name, true);
        self.spawn_event(LeaderEvent::BecameLeader { fencing_token });
        self.publish(LeaderState::Leading(leadership.clone()));
        let work: Vec<JoinHandle<()>> = self
            .callbacks
            .started
            .iter()
            .map(|callback| tokio::spawn(callback(leadership.clone())))
            .collect();
        drop(leadership);

        let reason = loop {
            tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                () = sleep(self.config.retry_period) => {}
            }
            let attempt_started = Instant::now();
            let renewed = tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                renewed = self.renew(fencing_token) => renewed,
            };
            match renewed {
                // An answer after the deadline does not extend the term; the next select ends it.
                Ok(true) if Instant::now() < deadline => {
                    deadline = attempt_started + self.config.renew_deadline;
                    m::renewed(&self.config.name, attempt_started.elapsed());
                    self.health_update(|h| h.renewed(attempt_started));
                }
                Ok(true) => {}
                Ok(false) => break StepDownReason::Lost,
                Err(err) => self.report_error("renew", &err),
            }
        };

        cancel.cancel();
        m::set_leading(&self.config.name, false);
        self.health_update(HealthState::follow);
        tracing::info!(fencing_token, ?reason, "stopped leading");
        self.publish_following();
        let stopped = self.wait_for_work(work, &mut alive_rx).await;
        let mut released = false;
        if reason == StepDownReason::Shutdown && self.config.release_on_cancel {
            if stopped {
                released = self.release(fencing_token).await;
            } else {
                tracing::warn!(
                    fencing_token,
                    "leader work did not stop within the grace period; not releasing the lease, it will expire"
                );
            }
        }
        self.spawn_event(LeaderEvent::StoppedLeading { fencing_token });
        if let Some(callback) = &self.callbacks.stopped {
            callback(StepDown {
                fencing_token,
                reason,
                released,
            });
        }
    }

    /// Renews the lease: one request from the cached record (client-go's fast path), and a read
    /// only when that loses the compare-and-swap. `Ok(false)` means someone else holds it now.
    async fn renew(&mut self, fencing_token: u64) -> Result<bool, LockError> {
        if let Some(cached) = self
            .observed
            .clone()
            .filter(|o| self.is_ours(o, fencing_token))
        {
            let mut record = cached.record.clone();
            record.renew_time = Utc::now().max(record.acquire_time);
            match self
                .request("update", self.lock.update(&cached.version, &record))
                .await
            {
                Ok(stored) => {
                    self.observe(stored);
                    return Ok(true);
                }
                Err(err) if err.is_conflict() => {}
                Err(err) => return Err(err),
            }
        }
        m::slow_path(&self.config.name);
        let Some(current) = self.request("get", self.lock.get()).await? else {
            return Ok(false);
        };
        self.observe(current.clone());
        if !self.is_ours(&current, fencing_token) {
            return Ok(false);
        }
        let mut record = current.record.clone();
        record.renew_time = Utc::now().max(record.acquire_time);
        let stored = self
            .request("update", self.lock.update(&current.version, &record))
            .await?;
        self.observe(stored);
        Ok(true)
    }

    /// The record is this term's: our identity and our fencing token (a re-acquisition by a
    /// process with the same identity would have raised the token).
    fn is_ours(&self, observed: &Observed, fencing_token: u64) -> bool {
        observed.record.is_held_by(self.identity())
            && observed.record.leader_transitions == fencing_token
    }

    /// Waits, up to the stop grace, until the work has stopped and every clone of the
    /// leadership is gone; aborts callback tasks that outlive it.
    async fn wait_for_work(
        &self,
        work: Vec<JoinHandle<()>>,
        alive: &mut mpsc::Receiver<()>,
    ) -> bool {
        let aborts: Vec<_> = work.iter().map(JoinHandle::abort_handle).collect();
        let all_stopped = async {
            for task in work {
                if let Err(err) = task.await
                    && err.is_panic()
                {
                    tracing::error!("leader work panicked");
                }
            }
            // `None` once every `Leadership` clone has been dropped.
            while alive.recv().await.is_some() {}
        };
        if timeout(self.config.stop_grace, all_stopped).await.is_ok() {
            return true;
        }
        for abort in aborts {
            abort.abort();
        }
        tracing::warn!(
            grace = ?self.config.stop_grace,
            "leader work still running after the stop grace; callback tasks aborted"
        );
        false
    }

    /// Clears the holder with a compare-and-swap, so a release never frees a lease that someone
    /// else holds (S6).
    async fn release(&mut self, fencing_token: u64) -> bool {
        let mut current = self.observed.clone();
        // Two tries: from the cached record, then, if that lost the compare-and-swap, from a
        // fresh read. The cache can be stale without anyone else having written: a renewal cut
        // short by the shutdown may still have reached the store.
        for attempt in 0..2 {
            let Some(ours) = current.filter(|o| self.is_ours(o, fencing_token)) else {
                return false;
            };
            let now = Utc::now();
            let record = LeaderElectionRecord {
                holder_identity: String::new(),
                acquire_time: now,
                renew_time: now,
                ..ours.record.clone()
            };
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
                            self.report_error("release", &err);
                            return false;
                        }
                    };
                    if let Some(fresh) = &current {
                        self.observe(fresh.clone());
                    }
                }
                Err(err) => {
                    self.report_error("release", &err);
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

    fn health_update(&self, update: impl FnOnce(&mut HealthState)) {
        update(&mut self.health.lock().unwrap_or_else(|p| p.into_inner()));
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
