//! The elector's builder and its handle; the loop itself is in `runner.rs`.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::clock::WallClock;
use crate::config::{ElectorConfig, JITTER_FACTOR, LeaseSettings, WorkExit};
use crate::error::ConfigError;
use crate::health::HealthCheck;
use crate::leadership::{LeaderState, Leadership, StepDown};
use crate::lock::ResourceLock;
use crate::runner::{Callbacks, Context, Runner};
use crate::status::{ElectionError, ElectorStatus, Shared};

/// Builds a [`LeaderElector`]; start with [`LeaderElector::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct LeaderElectorBuilder {
    lock: Arc<dyn ResourceLock>,
    name: Option<String>,
    lease: LeaseSettings,
    jitter: f64,
    graceful_stop: bool,
    work_exit: WorkExit,
    callbacks: Callbacks,
}

impl fmt::Debug for LeaderElectorBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderElectorBuilder")
            .field("lock", &self.lock.describe())
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl LeaderElectorBuilder {
    /// The election's name in [`LeaderElector::status`] and its `/leader` view, in
    /// [`Leadership::name`], in logs and in metric labels. Default: the name the lock was made
    /// for ([`ResourceLock::election_name`]: `billing` for `store.lock("billing", ..)` or
    /// `leader::open(url, "billing", ..)`), or the lock's description for a lock that knows no
    /// such name. Set it to show another name than the one the store keeps the record under.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How long followers wait, after the last change of the record they saw, before they take
    /// over (default 15 s). The leader writes it into the record; followers honour the holder's
    /// value, not their own.
    pub fn lease_duration(mut self, duration: Duration) -> Self {
        self.lease.timings.lease_duration = duration;
        self
    }

    /// How long the leader keeps leading without a successful renewal (default 10 s). Its
    /// leadership is cancelled at the start of the last successful renewal plus this.
    pub fn renew_deadline(mut self, duration: Duration) -> Self {
        self.lease.timings.renew_deadline = duration;
        self
    }

    /// Time between renewals, and the base wait between attempts to acquire (default 2 s).
    pub fn retry_period(mut self, duration: Duration) -> Self {
        self.lease.timings.retry_period = duration;
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
        self.lease.request_timeout = Some(duration);
        self
    }

    /// How long the elector waits for the leader's work to stop once its leadership is cancelled
    /// (default: lease duration minus renew deadline, the time that remains before a follower can
    /// take over). Work still running then is aborted (callbacks) or left behind with a warning,
    /// and on shutdown the lease is not released but left to expire.
    pub fn stop_grace(mut self, duration: Duration) -> Self {
        self.lease.stop_grace = Some(duration);
        self
    }

    /// Whether the work of [`run_while_leading`](LeaderElector::run_while_leading) stops on
    /// its own when a term ends (default `false`: its future is dropped at once, wherever it
    /// is). With `true`, the work sees the end ([`Leadership::lost`], its
    /// [`cancellation_token`](Leadership::cancellation_token)) and has the
    /// [`stop_grace`](Self::stop_grace) to return: a controller finishes the reconcile it is
    /// in (kube-runtime's `Controller::graceful_shutdown_on`), a consumer acknowledges what it
    /// processed. Work still running near the grace's end is dropped then, so the lease is
    /// released as usual. The next leader can take over only once the work stopped or the
    /// lease ran out, as always (S6).
    pub fn graceful_stop(mut self, graceful: bool) -> Self {
        self.graceful_stop = graceful;
        self
    }

    /// Release the lease on shutdown, so a follower takes over at once instead of after the
    /// lease duration (default true). The release waits for the leader's work to stop first.
    pub fn release_on_cancel(mut self, release: bool) -> Self {
        self.lease.release_on_cancel = release;
        self
    }

    /// What happens when the term's work ends by itself (returns or panics) while the term goes
    /// on (default [`WorkExit::StepDown`]: the term ends and the lease is released).
    pub fn work_exit(mut self, exit: WorkExit) -> Self {
        self.work_exit = exit;
        self
    }

    /// The lowest fencing token an acquisition takes (default 0: none). Every acquisition's
    /// token is at least this and greater than every earlier one of the lock (S5). When moving
    /// an election to a new store, set it above the highest token the old store gave, so that
    /// downstream stores that fence on the token keep refusing the old leaders' writes.
    ///
    /// A record deleted under a running election (by hand, by a bucket's lifecycle rule, by a
    /// cache's eviction) needs no floor: each candidate takes a token above every one it saw.
    /// A candidate started after the deletion saw none; where a store keeps no token beside
    /// the record and such a deletion may happen, a floor that grows with time (seconds since
    /// the epoch at start, say) keeps its tokens up too, as long as the lock's acquisitions
    /// come less often than one a second on average.
    pub fn fencing_token_floor(mut self, floor: u64) -> Self {
        self.lease.fencing_token_floor = floor;
        self
    }

    /// The wall clock whose times go into the record (default: the system clock). Leases are
    /// judged on the monotonic clock whatever it says; tests step it
    /// ([`WallClock::stepped`]) to check that a clock stepped back or forward changes what the
    /// record shows and never who leads (S14).
    pub fn wall_clock(mut self, clock: WallClock) -> Self {
        self.lease.wall_clock = clock;
        self
    }

    /// Called, in a task of its own, each time this candidate becomes leader (client-go's
    /// `OnStartedLeading`). The work should stop when [`Leadership::lost`] completes; the elector
    /// waits for it before releasing or running again. When the callback returns (and no clone
    /// of its [`Leadership`] is left) or panics while the term goes on, the term ends, or the
    /// callback is started again, as [`work_exit`](Self::work_exit) says.
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

    /// Runs `task` during each term beside the work, for what serves the term without being
    /// its work: the leader's Pod label (`leader_kube::PodLabel::hold`), a heartbeat, a
    /// gauge. It starts when the term begins, with the term's [`Leadership`]; when the term
    /// ends, [`Leadership::lost`] completes and the elector waits for the task (up to the stop
    /// grace, as for the work) before it releases the lease, so that what the task undoes (a
    /// label removed) is undone before another leader begins. Unlike
    /// [`on_started_leading`](Self::on_started_leading), it does not keep the term: when the
    /// work returns, the term ends although the task still runs (clones the task makes of its
    /// leadership count as work, though). A task that returns or panics early is not started
    /// again and does not end the term.
    pub fn beside_work<F, Fut>(mut self, task: F) -> Self
    where
        F: Fn(Leadership) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.callbacks
            .beside
            .push(Arc::new(move |leadership| Box::pin(task(leadership))));
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

    /// Called with every error that keeps the election from working as it should: a failed
    /// lock request (retried with back-off; a lost compare-and-swap is contention and not
    /// reported), or another process leading with this candidate's identity. Keep it quick: it
    /// runs in the loop. [`LeaderElector::status`] keeps the failure going on.
    pub fn on_error<F>(mut self, callback: F) -> Self
    where
        F: Fn(&ElectionError) + Send + Sync + 'static,
    {
        self.callbacks.error = Some(Arc::new(callback));
        self
    }

    /// Validates the configuration (S4) and builds the elector.
    pub fn build(self) -> Result<LeaderElector, ConfigError> {
        if self.lock.identity().is_empty() {
            return Err(ConfigError::EmptyIdentity);
        }
        if !(self.jitter.is_finite() && (0.0..=10.0).contains(&self.jitter)) {
            return Err(ConfigError::InvalidJitter(self.jitter));
        }
        let config = ElectorConfig {
            name: self.name.unwrap_or_else(|| {
                self.lock
                    .election_name()
                    .map_or_else(|| self.lock.describe(), str::to_owned)
            }),
            lease: self.lease.check()?,
            jitter: self.jitter,
            graceful_stop: self.graceful_stop,
            work_exit: self.work_exit,
        };
        let (state, _) = watch::channel(LeaderState::Unknown);
        Ok(LeaderElector {
            lock: self.lock,
            config,
            callbacks: self.callbacks,
            state,
            shared: Shared::new(),
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
/// running.await??;
/// # Ok(())
/// # }
/// ```
pub struct LeaderElector {
    lock: Arc<dyn ResourceLock>,
    config: ElectorConfig,
    callbacks: Callbacks,
    state: watch::Sender<LeaderState>,
    shared: Arc<Mutex<Shared>>,
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
            lease: LeaseSettings::default(),
            jitter: JITTER_FACTOR,
            graceful_stop: false,
            work_exit: WorkExit::StepDown,
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
    /// Its [`ready`](HealthCheck::ready) fails while this replica could not take over (the
    /// store has not answered for longer than a lease plus `tolerance`, or another process leads
    /// with its identity).
    pub fn health_check(&self, tolerance: Duration) -> HealthCheck {
        HealthCheck::new(
            self.config.name.clone(),
            self.shared.clone(),
            self.config.lease.lease_duration,
            tolerance,
        )
    }

    /// A handle on this elector's troubles and on who leads: the failure going on and since
    /// when, when the store last answered, another process with this identity, and the
    /// [`LeaderView`](crate::LeaderView) for `/leader` endpoints. Errors also reach
    /// [`on_error`](LeaderElectorBuilder::on_error) as they happen.
    pub fn status(&self) -> ElectorStatus {
        ElectorStatus::new(
            &self.config.name,
            self.lock.identity(),
            self.state.subscribe(),
            self.shared.clone(),
        )
    }

    /// Runs for leadership until `shutdown` is cancelled. After losing leadership it becomes a
    /// candidate again (S7). On shutdown it cancels the leadership, waits for the work to stop
    /// and releases the lease if configured (S6).
    ///
    /// The shape for a service whose leader-only work is its requests (the leader answers an
    /// admin API, a webhook): the term lasts as long as the lease, with no work of its own, and
    /// the handlers take the [`Leadership`] from [`subscribe`](Self::subscribe) (or the
    /// `leader` crate's `LeaderOnlyLayer`). Work given with
    /// [`on_started_leading`](LeaderElectorBuilder::on_started_leading) ends the term when it
    /// returns, as with [`run_while_leading`](Self::run_while_leading).
    ///
    /// # Errors
    /// [`ElectionError::Lock`] (operation `check_lease`) when the store does not keep a lease
    /// this long ([`ResourceLock::check_lease`](crate::ResourceLock::check_lease): a ZooKeeper
    /// session shorter than the lease, say): the elector stops before its first attempt.
    /// Outages, lost leases and a shared identity are not errors here: the elector waits them
    /// out, reports them to [`on_error`](LeaderElectorBuilder::on_error) and shows them in
    /// its [`status`](Self::status).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ElectionError> {
        let span = tracing::info_span!(
            "leader_election",
            name = %self.config.name,
            identity = %self.lock.identity(),
        );
        let context = Context::new(
            self.lock,
            self.config,
            self.callbacks,
            self.state,
            self.shared,
        );
        Runner::new(context).run(shutdown).instrument(span).await
    }

    /// Runs for leadership until `shutdown` is cancelled and runs `work` during each term: the
    /// future starts when this candidate becomes leader and is dropped the moment leadership ends
    /// (or, with [`graceful_stop`](LeaderElectorBuilder::graceful_stop), is given the stop grace
    /// to return by itself).
    /// When `work` completes or panics while the term goes on, the term ends and the lease is
    /// released (or the work is started again: [`LeaderElectorBuilder::work_exit`]).
    ///
    /// The shape for work the leader does by itself (a loop, a queue consumer, a job): `work`
    /// runs until the term ends (`leadership.lost()`, or a loop the drop of the future stops).
    /// Work that returns at once (`|_| async {}`) ends every term as it begins, so leadership
    /// flaps: the elector says so at error level. A service that only answers requests while
    /// leading calls [`run`](Self::run) instead.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub async fn run_while_leading<F, Fut>(
        mut self,
        shutdown: CancellationToken,
        work: F,
    ) -> Result<(), ElectionError>
    where
        F: Fn(Leadership) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let work = Arc::new(work);
        // A little short of the elector's own wait, so that it finds the work stopped in time
        // and releases the lease.
        let grace = self
            .config
            .graceful_stop
            .then(|| self.config.lease.stop_grace.mul_f64(0.9));
        self.callbacks.started.push(Arc::new(move |leadership| {
            let work = work.clone();
            Box::pin(async move {
                let Some(grace) = grace else {
                    let _ = leadership.run(work(leadership.clone())).await;
                    return;
                };
                let ended = leadership.clone();
                let mut running = std::pin::pin!(work(leadership));
                tokio::select! {
                    biased;
                    () = &mut running => return,
                    () = ended.lost() => {}
                }
                let _ = tokio::time::timeout(grace, running).await;
            })
        }));
        self.run(shutdown).await
    }
}
