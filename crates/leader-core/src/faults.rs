//! A lock wrapper that injects latency, errors, conflicts and hangs (feature `testing`).
//!
//! Wrap any lock in [`FaultyLock`], keep its [`Faults`] handle, and change the faults while an
//! elector runs on it. Combined with tokio's paused clock this tests timing rules deterministically.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::lock::HolderCheck;
use crate::{
    Acquisition, ChangeStream, LeaderElectionRecord, LeaderEvent, LockError, Observed,
    ResourceLock, Version,
};

const BACKEND: &str = "faults";

/// An error to inject; [`LockError`] itself is not `Clone`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// [`LockError::Conflict`].
    Conflict,
    /// [`LockError::Unavailable`].
    Unavailable,
    /// [`LockError::InvalidRecord`].
    InvalidRecord,
    /// [`LockError::Forbidden`].
    Forbidden,
}

impl Fault {
    fn error(self, operation: &'static str) -> LockError {
        match self {
            Self::Conflict => LockError::conflict(BACKEND),
            Self::Unavailable => {
                LockError::unavailable(BACKEND, format!("injected outage in {operation}"))
            }
            Self::InvalidRecord => LockError::invalid_record(BACKEND, "injected bad data"),
            Self::Forbidden => LockError::Forbidden {
                backend: BACKEND,
                message: format!("injected denial of {operation}"),
            },
        }
    }
}

/// How the wrapper's change notifications misbehave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChangeFault {
    /// The wrapped lock's own notifications.
    #[default]
    None,
    /// A notification every interval, forever, whatever the record does.
    Flood(Duration),
    /// Every subscription ends at once.
    EndAtOnce,
}

/// One request as the wrapper saw it, on tokio's clock.
#[derive(Clone, Debug)]
pub struct Call {
    /// `get`, `create`, `update`, `renew` or `try_acquire`.
    pub operation: &'static str,
    /// When the caller sent it.
    pub sent: Instant,
    /// When it reached the wrapped lock (after request latency), if it did.
    pub reached: Option<Instant>,
    /// When its answer reached the caller, if it did.
    pub returned: Option<Instant>,
    /// Whether it succeeded, once returned.
    pub ok: Option<bool>,
}

#[derive(Debug, Default)]
struct State {
    request_delay: Duration,
    response_delay: Duration,
    fail_all: Option<Fault>,
    fail_next: VecDeque<Fault>,
    lose_next_answer: VecDeque<(&'static str, Fault)>,
    calls: Vec<Call>,
    changes: ChangeFault,
    watches: usize,
}

/// The handle that changes a [`FaultyLock`]'s faults.
#[derive(Clone, Debug)]
pub struct Faults {
    state: Arc<Mutex<State>>,
    hang: Arc<watch::Sender<bool>>,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            state: Arc::default(),
            hang: Arc::new(watch::channel(false).0),
        }
    }
}

impl Faults {
    /// A handle with no faults set, to share between locks ([`FaultyLock::with_faults`]).
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Delays every request before it reaches the lock.
    pub fn delay_requests(&self, delay: Duration) {
        self.state().request_delay = delay;
    }

    /// Delays every answer after the lock has acted on the request.
    pub fn delay_responses(&self, delay: Duration) {
        self.state().response_delay = delay;
    }

    /// Makes every request fail with `fault` (before reaching the lock), or stops that with `None`.
    pub fn fail_all(&self, fault: Option<Fault>) {
        self.state().fail_all = fault;
    }

    /// Makes the next request fail with `fault` (before reaching the lock); queues up.
    pub fn fail_next(&self, fault: Fault) {
        self.state().fail_next.push_back(fault);
    }

    /// Makes the next `operation` request (`get`, `create`, `update`, `renew` or
    /// `try_acquire`) that reaches the lock fail with `fault` once the lock has acted on it: a
    /// write that landed, whose answer was lost (a connection reset after the server applied
    /// it); queues up.
    pub fn lose_next_answer(&self, operation: &'static str, fault: Fault) {
        self.state().lose_next_answer.push_back((operation, fault));
    }

    /// While `true`, requests hang before reaching the lock; they continue when it is set back.
    pub fn hang(&self, hang: bool) {
        self.hang.send_replace(hang);
    }

    /// Makes new subscriptions to change notifications misbehave (or behave, with
    /// [`ChangeFault::None`]).
    pub fn changes(&self, fault: ChangeFault) {
        self.state().changes = fault;
    }

    /// Removes every fault.
    pub fn clear(&self) {
        self.hang(false);
        let mut state = self.state();
        state.request_delay = Duration::ZERO;
        state.response_delay = Duration::ZERO;
        state.fail_all = None;
        state.fail_next.clear();
        state.lose_next_answer.clear();
        state.changes = ChangeFault::None;
    }

    /// How many times a subscription to change notifications was asked for. Subscriptions hang
    /// with [`hang`](Self::hang) and fail with [`fail_all`](Self::fail_all), but are not in
    /// [`calls`](Self::calls), which lists requests on the record.
    pub fn watches(&self) -> usize {
        self.state().watches
    }

    /// Every request so far.
    pub fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    /// How many `operation` requests so far returned a failure (injected or the lock's own).
    pub fn failures(&self, operation: &str) -> usize {
        self.state()
            .calls
            .iter()
            .filter(|c| c.operation == operation && c.ok == Some(false))
            .count()
    }
}

/// Wraps a lock and injects the faults set on its [`Faults`] handle.
#[derive(Debug)]
pub struct FaultyLock<L> {
    inner: L,
    faults: Faults,
}

impl<L: ResourceLock> FaultyLock<L> {
    /// Wraps `inner` with no faults set.
    pub fn new(inner: L) -> Self {
        Self::with_faults(inner, Faults::new())
    }

    /// Wraps `inner` with the faults of `faults`, which other locks may share: a process's
    /// locks frozen or cut off together.
    pub fn with_faults(inner: L, faults: Faults) -> Self {
        Self { inner, faults }
    }

    /// The handle that sets faults; clone it before handing the lock to an elector.
    pub fn faults(&self) -> Faults {
        self.faults.clone()
    }

    async fn call<T>(
        &self,
        operation: &'static str,
        inner: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let index = {
            let mut state = self.faults.state();
            state.calls.push(Call {
                operation,
                sent: Instant::now(),
                reached: None,
                returned: None,
                ok: None,
            });
            state.calls.len() - 1
        };
        let request_delay = self.faults.state().request_delay;
        tokio::time::sleep(request_delay).await;
        let mut hang = self.faults.hang.subscribe();
        let _ = hang.wait_for(|hung| !hung).await;
        let injected = {
            let mut state = self.faults.state();
            state.fail_next.pop_front().or(state.fail_all)
        };
        let result = match injected {
            Some(fault) => Err(fault.error(operation)),
            None => {
                self.faults.state().calls[index].reached = Some(Instant::now());
                let answer = inner.await;
                let lost = {
                    let queue = &mut self.faults.state().lose_next_answer;
                    let next = queue.front().is_some_and(|&(lost, _)| lost == operation);
                    next.then(|| queue.pop_front()).flatten()
                };
                match lost {
                    Some((_, fault)) => Err(fault.error(operation)),
                    None => answer,
                }
            }
        };
        let response_delay = self.faults.state().response_delay;
        tokio::time::sleep(response_delay).await;
        let mut state = self.faults.state();
        state.calls[index].returned = Some(Instant::now());
        state.calls[index].ok = Some(result.is_ok());
        result
    }
}

// A wrapper forwards every method, the optional ones included: one it left out would fall
// back to the default and hide the wrapped lock's own (its lease check, its store clock).
#[warn(clippy::missing_trait_methods)]
#[async_trait]
impl<L: ResourceLock> ResourceLock for FaultyLock<L> {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        self.call("get", self.inner.get()).await
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        self.call("create", self.inner.create(record)).await
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        self.call("update", self.inner.update(version, record))
            .await
    }

    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        self.call("renew", self.inner.renew(version, record)).await
    }

    async fn record_event(&self, event: &LeaderEvent) {
        self.inner.record_event(event).await;
    }

    fn identity(&self) -> &str {
        self.inner.identity()
    }

    fn describe(&self) -> String {
        format!("faulty({})", self.inner.describe())
    }

    fn election_name(&self) -> Option<&str> {
        self.inner.election_name()
    }

    async fn time_left(&self) -> Result<Option<std::time::Duration>, LockError> {
        self.inner.time_left().await
    }

    async fn check_lease(&self, lease_duration: std::time::Duration) -> Result<(), LockError> {
        self.inner.check_lease(lease_duration).await
    }

    async fn close(&self) {
        self.inner.close().await;
    }

    async fn withdraw(&self) {
        self.inner.withdraw().await;
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        self.faults.state().watches += 1;
        let mut hang = self.faults.hang.subscribe();
        let _ = hang.wait_for(|hung| !hung).await;
        let (fault, changes) = {
            let state = self.faults.state();
            (state.fail_all, state.changes)
        };
        if let Some(fault) = fault {
            return Err(fault.error("watch"));
        }
        match changes {
            ChangeFault::None => self.inner.watch().await,
            ChangeFault::Flood(every) => Ok(Some(Box::pin(futures_util::stream::unfold(
                (),
                move |()| async move {
                    tokio::time::sleep(every).await;
                    Some(((), ()))
                },
            )))),
            ChangeFault::EndAtOnce => Ok(Some(Box::pin(futures_util::stream::empty()))),
        }
    }

    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        self.call("try_acquire", self.inner.try_acquire(desired))
            .await
    }

    fn holder_check(&self) -> HolderCheck {
        self.inner.holder_check()
    }
}
