//! What the test files of this crate share: a lock that changes some requests of the lock it
//! wraps ([`TestLock`]), the switch that turns its changes on and off, the wait for a
//! condition on tokio's paused clock, the elector's default timings, captured logs, and a
//! shard set's member run on a task of its own.

// Each test file is its own crate and uses a part of this module.
#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::LeaderElectionRecord as Record;
use leader_core::backend::HolderCheck;
use leader_core::background::Candidate;
use leader_core::faults::Faults;
use leader_core::{
    Acquisition, CancellationToken, ChangeStream, LeaderElectionRecord, LeaderElector,
    LeaderElectorBuilder, LeaderEvent, LockError, MemoryStore, Observed, ResourceLock, Shards,
    ShardsError, ShardsState, Version,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

/// Advances the paused clock a tenth of a second at a time until `done`, up to `within`;
/// returns how long it took, or `None` when `done` never held.
pub async fn until(within: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() <= within {
        if done() {
            return Some(start.elapsed());
        }
        sleep(Duration::from_millis(100)).await;
    }
    None
}

/// The requests `faults` saw, in order, and the one that followed the last acquisition
/// (`try_acquire`), if any: what confirmed a lease handed over.
pub fn after_last_acquisition(faults: &Faults) -> (Vec<&'static str>, Option<&'static str>) {
    let operations: Vec<_> = faults.calls().iter().map(|c| c.operation).collect();
    let last = operations
        .iter()
        .rposition(|o| *o == "try_acquire")
        .expect("an acquisition");
    let next = operations.get(last + 1).copied();
    (operations, next)
}

/// The record of `key` in `store`, which must exist and be readable.
pub async fn stored_record(store: &MemoryStore, key: &str) -> LeaderElectionRecord {
    let observed = store
        .lock(key, "reader")
        .get()
        .await
        .expect("read the record");
    observed.expect("the record exists").record
}

/// A switch a test turns on and off while a [`TestLock`] runs; off at first.
#[derive(Clone, Debug, Default)]
pub struct Switch(Arc<AtomicBool>);

impl Switch {
    /// Turns the switch on (`true`) or off.
    pub fn set(&self, on: bool) {
        self.0.store(on, Ordering::SeqCst);
    }

    /// Whether the switch is on.
    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A request on the record, as a [`TestLock`]'s settings name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// [`ResourceLock::get`].
    Get,
    /// [`ResourceLock::create`].
    Create,
    /// [`ResourceLock::update`].
    Update,
    /// [`ResourceLock::renew`].
    Renew,
    /// [`ResourceLock::try_acquire`].
    TryAcquire,
}

/// The claims of a lock: both ways of taking a record.
pub const CLAIMS: [Request; 2] = [Request::Create, Request::TryAcquire];

/// How a [`TestLock`]'s store answers acquisitions.
#[derive(Clone, Copy, Debug, Default)]
enum Acquiring {
    /// As the wrapped lock does.
    #[default]
    AsWrapped,
    /// An acquisition comes as handed over by a release, on a lease the store confirmed alive
    /// this long before the attempt (as the etcd lock's waiting candidates get it).
    Handed(Duration),
    /// The store assigns the lease (as Kubernetes' coordinator does): a candidate takes up a
    /// lease only once the record names it.
    Assigned,
}

/// A lock that forwards every request to the lock it wraps, the optional methods included,
/// but for what its settings change: requests slow while a [`Switch`] is on, answers that
/// come late, writes that fail while a switch is on, a bound on the leases the store keeps,
/// and the acquisitions of a store that hands leases over or assigns them.
#[derive(Debug)]
pub struct TestLock {
    inner: Arc<dyn ResourceLock>,
    /// Requests that wait a while before reaching the wrapped lock while a switch is on.
    slow: Vec<(Request, Switch, Duration)>,
    /// Requests whose answers wait a while after the wrapped lock has acted on them.
    late: Vec<(Request, Duration)>,
    /// While on, updates and renewals fail without reaching the wrapped lock.
    failing_writes: Option<Switch>,
    /// The longest lease the store keeps.
    longest_lease: Option<Duration>,
    acquiring: Acquiring,
    /// What the acquisition says it knows of the holder, if not the wrapped lock's.
    holder_check: Option<HolderCheck>,
    /// The updates (`update holder="…"`) and withdrawals (`withdraw`), in order; a withdrawal
    /// is not forwarded while this is set.
    log: Option<Arc<Mutex<Vec<String>>>>,
}

impl TestLock {
    /// Wraps `inner`, changing nothing yet.
    pub fn new(inner: impl ResourceLock + 'static) -> Self {
        Self::wrap(Arc::new(inner))
    }

    /// Wraps a shared lock, changing nothing yet.
    pub fn wrap(inner: Arc<dyn ResourceLock>) -> Self {
        Self {
            inner,
            slow: Vec::new(),
            late: Vec::new(),
            failing_writes: None,
            longest_lease: None,
            acquiring: Acquiring::AsWrapped,
            holder_check: None,
            log: None,
        }
    }

    /// Makes `requests` wait `delay` before reaching the wrapped lock while `switch` is on: a
    /// loaded store that answers some requests slowly.
    #[must_use]
    pub fn slow(mut self, requests: &[Request], delay: Duration, switch: &Switch) -> Self {
        let rules = requests.iter().map(|&r| (r, switch.clone(), delay));
        self.slow.extend(rules);
        self
    }

    /// Makes the answers to `requests` come `delay` late, the wrapped lock acting on them at
    /// once: a slow network.
    #[must_use]
    pub fn late(mut self, requests: &[Request], delay: Duration) -> Self {
        self.late.extend(requests.iter().map(|&r| (r, delay)));
        self
    }

    /// Makes updates and renewals fail ([`LockError::Unavailable`]) while `switch` is on.
    #[must_use]
    pub fn failing_writes(mut self, switch: &Switch) -> Self {
        self.failing_writes = Some(switch.clone());
        self
    }

    /// Makes the store keep leases of at most `longest` ([`ResourceLock::check_lease`]), as a
    /// ZooKeeper session bounds them.
    #[must_use]
    pub fn longest_lease(mut self, longest: Duration) -> Self {
        self.longest_lease = Some(longest);
        self
    }

    /// Makes the lock say its acquisition knows the holder as `check` says
    /// ([`ResourceLock::holder_check`]).
    #[must_use]
    pub fn holder_check(mut self, check: HolderCheck) -> Self {
        self.holder_check = Some(check);
        self
    }

    /// Makes every acquisition come as handed over by a release
    /// ([`Acquisition::Handed`]), on a lease the store confirmed alive `confirmed_ago` before
    /// the attempt.
    #[must_use]
    pub fn handed(mut self, confirmed_ago: Duration) -> Self {
        self.acquiring = Acquiring::Handed(confirmed_ago);
        self
    }

    /// Makes the store assign the lease: an acquisition takes up only a lease whose record
    /// names this lock's identity, and is [`Acquisition::Unassigned`] otherwise. The updates
    /// and withdrawals go to `log`, in order.
    #[must_use]
    pub fn assigned(mut self, log: &Arc<Mutex<Vec<String>>>) -> Self {
        self.acquiring = Acquiring::Assigned;
        self.log = Some(log.clone());
        self
    }

    /// Runs `answer`, the wrapped lock's answer to `request`, with the delays and failures set
    /// for it.
    async fn request<T>(
        &self,
        request: Request,
        answer: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        for (_, switch, delay) in self.slow.iter().filter(|(r, ..)| *r == request) {
            if switch.is_on() {
                sleep(*delay).await;
            }
        }
        let write = matches!(request, Request::Update | Request::Renew);
        if write && self.failing_writes.as_ref().is_some_and(Switch::is_on) {
            return Err(LockError::unavailable("test", "writes fail".to_owned()));
        }
        let answer = answer.await;
        for (_, delay) in self.late.iter().filter(|(r, _)| *r == request) {
            sleep(*delay).await;
        }
        answer
    }

    /// An acquisition as the store assigning leases answers it.
    async fn take_assigned(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let current = match self.inner.get().await? {
            Some(current) if current.record.holder_identity == self.identity() => current,
            other => return Ok(Some(Acquisition::Unassigned(other))),
        };
        let mut taken = desired.clone();
        taken.leader_transitions = current.record.leader_transitions + 1;
        let stored = self.inner.update(&current.version, &taken).await?;
        Ok(Some(Acquisition::Acquired(stored)))
    }

    fn log(&self, entry: String) {
        if let Some(log) = &self.log {
            log.lock().unwrap_or_else(|p| p.into_inner()).push(entry);
        }
    }
}

// Every method forwarded, the optional ones included, in an order of its own: the changed
// requests between those passed on as they are.
#[warn(clippy::missing_trait_methods)]
#[leader_core::async_trait]
impl ResourceLock for TestLock {
    fn identity(&self) -> &str {
        self.inner.identity()
    }

    async fn get(&self) -> Result<Option<Observed>, LockError> {
        self.request(Request::Get, self.inner.get()).await
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn create(&self, record: &Record) -> Result<Observed, LockError> {
        self.request(Request::Create, self.inner.create(record))
            .await
    }

    fn election_name(&self) -> Option<&str> {
        self.inner.election_name()
    }

    async fn update(&self, version: &Version, record: &Record) -> Result<Observed, LockError> {
        self.log(format!("update holder={:?}", record.holder_identity));
        let answer = self.inner.update(version, record);
        self.request(Request::Update, answer).await
    }

    async fn record_event(&self, event: &LeaderEvent) {
        self.inner.record_event(event).await;
    }

    async fn renew(&self, version: &Version, record: &Record) -> Result<Observed, LockError> {
        let answer = self.inner.renew(version, record);
        self.request(Request::Renew, answer).await
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        self.inner.watch().await
    }

    async fn check_lease(&self, lease_duration: Duration) -> Result<(), LockError> {
        match self.longest_lease {
            Some(longest) if lease_duration > longest => Err(LockError::Misconfigured {
                backend: "test",
                message: format!("the store keeps leases of {longest:?} at most"),
            }),
            _ => self.inner.check_lease(lease_duration).await,
        }
    }

    async fn time_left(&self) -> Result<Option<Duration>, LockError> {
        self.inner.time_left().await
    }

    async fn withdraw(&self) {
        match &self.log {
            Some(_) => self.log("withdraw".into()),
            None => self.inner.withdraw().await,
        }
    }

    async fn close(&self) {
        self.inner.close().await;
    }

    async fn try_acquire(&self, desired: &Record) -> Result<Option<Acquisition>, LockError> {
        let attempted = Instant::now();
        let acquisition = async {
            match self.acquiring {
                Acquiring::AsWrapped => self.inner.try_acquire(desired).await,
                Acquiring::Handed(confirmed_ago) => {
                    Ok(match self.inner.try_acquire(desired).await? {
                        Some(Acquisition::Acquired(observed)) => Some(Acquisition::Handed {
                            observed,
                            alive_since: attempted - confirmed_ago,
                        }),
                        other => other,
                    })
                }
                Acquiring::Assigned => self.take_assigned(desired).await,
            }
        };
        self.request(Request::TryAcquire, acquisition).await
    }

    fn holder_check(&self) -> HolderCheck {
        match (self.holder_check, &self.acquiring) {
            (Some(check), _) => check,
            (None, Acquiring::Assigned) => HolderCheck::Assigned,
            (None, _) => self.inner.holder_check(),
        }
    }
}

/// The log lines of a test, at warn and above, once [`capture`](Self::capture)d.
#[derive(Clone, Debug, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// Collects this thread's log lines at warn and above until the guard returned is dropped.
    pub fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let logs = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || logs.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }

    /// The lines that say `words`.
    pub fn lines_with(&self, words: &str) -> Vec<String> {
        let text = self.text();
        text.lines()
            .filter(|l| l.contains(words))
            .map(str::to_owned)
            .collect()
    }
}

/// The elector's default lease duration (client-go's).
pub const LEASE: Duration = Duration::from_secs(15);
/// The elector's default renew deadline.
pub const RENEW: Duration = Duration::from_secs(10);
/// The elector's default retry period.
pub const RETRY: Duration = Duration::from_secs(2);

/// An elector builder for `lock` with the default timings and no jitter, so that every
/// request's time is exact.
pub fn builder(lock: impl ResourceLock + 'static) -> LeaderElectorBuilder {
    LeaderElector::builder(lock).jitter(0.0)
}

/// Waits for `candidate` to lead, then makes its requests hang (through `faults`, the handle
/// of its lock) until that term ends, and lets them through again.
pub async fn lose_a_term(candidate: &mut Candidate, faults: &Faults) {
    let term = candidate.leadership().await;
    faults.hang(true);
    term.lost().await;
    drop(term);
    faults.hang(false);
}

/// Runs `shards` on a task of its own, each shard's work running until the shard is taken
/// away: the member's state, the shutdown that stops it, and its task.
pub fn spawn_member(
    shards: Shards,
) -> (
    watch::Receiver<ShardsState>,
    CancellationToken,
    JoinHandle<Result<(), ShardsError>>,
) {
    let state = shards.subscribe();
    let shutdown = CancellationToken::new();
    let task =
        tokio::spawn(shards.run_per_shard(shutdown.clone(), |_, _| std::future::pending::<()>()));
    (state, shutdown, task)
}
