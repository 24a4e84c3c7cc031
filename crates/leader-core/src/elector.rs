//! The elector's configuration, its builder and its handle; the loop itself is in `runner.rs`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::ConfigError;
use crate::health::{HealthCheck, HealthState};
use crate::leadership::{LeaderState, Leadership, StepDown};
use crate::lock::ResourceLock;
use crate::runner::Runner;

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
pub(crate) struct Callbacks {
    pub(crate) started: Vec<StartedFn>,
    pub(crate) stopped: Option<StoppedFn>,
    pub(crate) new_leader: Option<NewLeaderFn>,
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
    pub(crate) lock: Arc<dyn ResourceLock>,
    pub(crate) config: ElectorConfig,
    pub(crate) callbacks: Callbacks,
    pub(crate) state: watch::Sender<LeaderState>,
    pub(crate) health: Arc<Mutex<HealthState>>,
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
