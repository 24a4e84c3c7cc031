//! The leadership token handed to the leader's work, and the elector's observable state.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::LockError;

/// Proof of one term of leadership: its fencing token and a cancellation that fires when the term
/// ends.
///
/// The elector cancels it no later than the start of the last successful renewal plus the renew
/// deadline, by a timer, even while a renewal request hangs (S3). Pass
/// [`fencing_token`](Self::fencing_token) along with every write the leader makes downstream, and
/// have the downstream store refuse tokens lower than the highest it has seen: that makes a
/// leader that was paused past its lease harmless.
///
/// Holding a clone keeps the term's work "running": when the elector steps down it cancels the
/// token, then waits (up to its stop grace) until every clone is dropped before it releases the
/// lease or runs for leadership again (S6). So keep the `Leadership` itself, not only a
/// [`cancellation_token`](Self::cancellation_token), for as long as the work runs. The copy in
/// the elector's state channel ([`LeaderState::Leading`]) does not count; clones made from it
/// do, while the term's work runs.
///
/// When the term's work ([`on_started_leading`](crate::LeaderElectorBuilder::on_started_leading)
/// or [`run_while_leading`](crate::LeaderElector::run_while_leading)) has ended by itself (every
/// callback returned or one panicked, and no clone is left), the term ends too, as
/// [`WorkExit`](crate::WorkExit) says: a leader never keeps a lease for work that no longer runs.
pub struct Leadership {
    term: Arc<Term>,
    /// Dropped with this clone; the elector waits until every counted clone is gone. `None` for
    /// the copy in the state channel, and for clones made once the work had ended.
    _alive: Option<mpsc::Sender<()>>,
}

struct Term {
    name: String,
    identity: String,
    fencing_token: u64,
    acquired_at: Instant,
    /// When this term began, by the elector's wall clock: for people.
    began: DateTime<Utc>,
    deadline: TermDeadline,
    cancel: CancellationToken,
    /// Asks the elector to end this term: hand its lease to a named candidate, or step down.
    requests: mpsc::Sender<TermRequest>,
    /// Makes counted clones while any is left.
    alive: mpsc::WeakSender<()>,
    /// The record's extensions as this term last stored them.
    extensions: Arc<Mutex<BTreeMap<String, String>>>,
}

/// When a term ends unless a renewal succeeds first: the start of its last successful renewal
/// plus the renew deadline (S3), as the elector last moved it. A plain shared value that any
/// thread may read, for a watchdog that must act even when the runtime running the elector is
/// stuck ([`Leadership::deadline`]).
#[derive(Clone, Debug)]
pub struct TermDeadline(Arc<Mutex<std::time::Instant>>);

/// Two handles are equal when they follow the same term's deadline.
impl PartialEq for TermDeadline {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for TermDeadline {}

impl TermDeadline {
    /// A deadline at `at`, which [`set`](Self::set) moves.
    pub fn new(at: std::time::Instant) -> Self {
        Self(Arc::new(Mutex::new(at)))
    }

    /// The instant the term ends unless a renewal succeeds before.
    pub fn get(&self) -> std::time::Instant {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the deadline to `at`.
    pub fn set(&self, at: std::time::Instant) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = at;
    }
}

/// What a term's work asks of the elector.
#[derive(Debug)]
pub(crate) enum TermRequest {
    /// Hand the lease over to this candidate.
    HandOver(String),
    /// Step down and release the lease.
    StepDown,
    /// Write these extensions into the record (a write that renews the lease too).
    SetExtensions {
        changes: ExtensionChanges,
        reply: oneshot::Sender<Result<(), ExtensionError>>,
    },
}

/// Changes to a record's extensions: a value to set, or `None` to remove the key.
#[derive(Debug)]
pub(crate) struct ExtensionChanges(Vec<(String, Option<String>)>);

impl ExtensionChanges {
    pub(crate) fn apply(&self, extensions: &mut BTreeMap<String, String>) {
        for (key, value) in &self.0 {
            match value {
                Some(value) => extensions.insert(key.clone(), value.clone()),
                None => extensions.remove(key),
            };
        }
    }
}

/// Why [`Leadership::set_extensions`] did not write.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExtensionError {
    /// The term ended (or the record is no longer this term's) before the write was
    /// confirmed. Mostly nothing was written; but a request in flight when the term's deadline
    /// passed, or answered after it, may have reached the store: treat the write as unknown,
    /// as the next term, which reads the record, does.
    #[error(transparent)]
    Lost(#[from] LeadershipLost),
    /// The lock failed; the write may or may not have reached the store, and the term goes on
    /// until its renew deadline unless a later renewal succeeds. Read
    /// [`Leadership::extensions`] after the next write to know.
    #[error("writing the extensions failed: {0}")]
    Lock(Arc<LockError>),
}

/// Returned by [`Leadership::run`] when leadership ended before the future completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("leadership (fencing token {fencing_token}) was lost before the work completed")]
pub struct LeadershipLost {
    /// The fencing token of the term that ended.
    pub fencing_token: u64,
}

impl Clone for Leadership {
    fn clone(&self) -> Self {
        Self {
            term: self.term.clone(),
            _alive: self.term.alive.upgrade(),
        }
    }
}

impl Leadership {
    /// A term's first, counted leadership, with the requests the term's work may make and the
    /// receiver that completes once every counted clone is gone.
    pub(crate) fn new(
        name: String,
        identity: String,
        fencing_token: u64,
        cancel: CancellationToken,
        extensions: BTreeMap<String, String>,
        deadline: TermDeadline,
        began: DateTime<Utc>,
    ) -> (Self, mpsc::Receiver<TermRequest>, mpsc::Receiver<()>) {
        let (requests, requests_rx) = mpsc::channel(1);
        let (alive, alive_rx) = mpsc::channel(1);
        let leadership = Self {
            term: Arc::new(Term {
                name,
                identity,
                fencing_token,
                acquired_at: Instant::now(),
                began,
                deadline,
                cancel,
                requests,
                alive: alive.downgrade(),
                extensions: Arc::new(Mutex::new(extensions)),
            }),
            _alive: Some(alive),
        };
        (leadership, requests_rx, alive_rx)
    }

    /// What the runner updates after each write of this term.
    pub(crate) fn extensions_handle(&self) -> Arc<Mutex<BTreeMap<String, String>>> {
        self.term.extensions.clone()
    }

    /// When this term ends unless a renewal succeeds first (the start of its last successful
    /// renewal plus the renew deadline), as a handle that follows the renewals and that another
    /// thread may hold without keeping the term's work "running". The elector cancels the term
    /// at that instant by a timer on its runtime; a process that must not trust that runtime
    /// alone (the `leader` command kills COMMAND from a thread of its own) reads it here.
    pub fn deadline(&self) -> TermDeadline {
        self.term.deadline.clone()
    }

    /// A copy that does not keep the term's work running: the one the state channel holds.
    pub(crate) fn uncounted(&self) -> Self {
        Self {
            term: self.term.clone(),
            _alive: None,
        }
    }

    /// The fencing token of this term: strictly greater than that of every earlier acquisition of
    /// the same lock (S5).
    pub fn fencing_token(&self) -> u64 {
        self.term.fencing_token
    }

    /// The identity that leads.
    pub fn identity(&self) -> &str {
        &self.term.identity
    }

    /// The elector's name.
    pub fn name(&self) -> &str {
        &self.term.name
    }

    /// When this term began, on the monotonic clock: for measuring how long it has lasted
    /// (`acquired_at().elapsed()`), never to print.
    pub fn acquired_at(&self) -> Instant {
        self.term.acquired_at
    }

    /// When this term began, by the elector's wall clock
    /// ([`wall_clock`](crate::LeaderElectorBuilder::wall_clock)), to print or log ("leading
    /// since 12:00:03"). A wall clock may step: never decide anything by it (S1).
    pub fn began_at(&self) -> DateTime<Utc> {
        self.term.began
    }

    /// True once the term has ended. Check it before every action that must not happen twice.
    pub fn is_lost(&self) -> bool {
        self.term.cancel.is_cancelled()
    }

    /// Completes when the term ends.
    pub async fn lost(&self) {
        self.term.cancel.cancelled().await;
    }

    /// Hands the lease over to the candidate `to`: the term ends (this work is cancelled, and
    /// the elector waits for it as on a release), the lease is released with `to` named as the
    /// next holder, `to` takes it at once and the other candidates stand back for a lease
    /// duration (see [`request_handover`](crate::request_handover), which does the same from
    /// outside the election). This candidate runs for leadership again afterwards.
    ///
    /// # Errors
    /// The term has already ended, or a handover or step-down is already under way.
    pub fn hand_over(&self, to: impl Into<String>) -> Result<(), LeadershipLost> {
        self.request(TermRequest::HandOver(to.into()))
    }

    /// Gives up leadership: the term ends (this work is cancelled, and the elector waits for it
    /// as on a release), the lease is released so that another candidate takes over at once,
    /// and this candidate stands back for a retry period (with its jitter) before it runs for
    /// leadership again. For work that finds it cannot do its job here (a dependency missing on
    /// this host, say).
    ///
    /// # Errors
    /// The term has already ended, or a handover or step-down is already under way.
    pub fn step_down(&self) -> Result<(), LeadershipLost> {
        self.request(TermRequest::StepDown)
    }

    fn request(&self, request: TermRequest) -> Result<(), LeadershipLost> {
        let lost = LeadershipLost {
            fencing_token: self.fencing_token(),
        };
        if self.is_lost() {
            return Err(lost);
        }
        self.term.requests.try_send(request).map_err(|_| lost)
    }

    /// The record's [`extensions`](crate::LeaderElectionRecord::extensions) as this term last
    /// stored them (at its acquisition, and after each write). While the term lasts nobody
    /// else changes them, so this is what the store holds.
    pub fn extensions(&self) -> BTreeMap<String, String> {
        self.term
            .extensions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Sets extension `key` to `value` (`None` removes it); see
    /// [`set_extensions`](Self::set_extensions).
    ///
    /// # Errors
    /// As [`set_extensions`](Self::set_extensions).
    pub async fn set_extension(
        &self,
        key: impl Into<String>,
        value: Option<String>,
    ) -> Result<(), ExtensionError> {
        self.set_extensions([(key.into(), value)]).await
    }

    /// Writes `changes` (a value per key, `None` to remove it) into the lease record, with a
    /// compare-and-swap of the record this term last stored: the write succeeds only while the
    /// record is still this term's, so it is fenced by the term, and it renews the lease as a
    /// renewal would. The elector makes it at once, in place of the next renewal. When it
    /// returns `Ok`, the store holds the changes.
    ///
    /// # Errors
    /// [`ExtensionError::Lost`] when the term ended first; [`ExtensionError::Lock`] when the
    /// lock failed (the write may have reached the store).
    pub async fn set_extensions(
        &self,
        changes: impl IntoIterator<Item = (String, Option<String>)>,
    ) -> Result<(), ExtensionError> {
        let lost = LeadershipLost {
            fencing_token: self.fencing_token(),
        };
        if self.is_lost() {
            return Err(lost.into());
        }
        let (reply, answer) = oneshot::channel();
        let request = TermRequest::SetExtensions {
            changes: ExtensionChanges(changes.into_iter().collect()),
            reply,
        };
        tokio::select! {
            biased;
            () = self.lost() => return Err(lost.into()),
            sent = self.term.requests.send(request) => sent.map_err(|_| lost)?,
        }
        answer.await.unwrap_or(Err(ExtensionError::Lost(lost)))
    }

    /// A child token cancelled when the term ends, for APIs that take a [`CancellationToken`].
    /// Cancelling it does not end the term.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.term.cancel.child_token()
    }

    /// Runs `work` until it completes or the term ends, whichever comes first; on loss the future
    /// is dropped at once.
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, LeadershipLost> {
        tokio::select! {
            biased;
            () = self.lost() => Err(LeadershipLost { fencing_token: self.fencing_token() }),
            output = work => Ok(output),
        }
    }

    pub(crate) fn ptr_eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.term, &other.term)
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("name", &self.term.name)
            .field("identity", &self.term.identity)
            .field("fencing_token", &self.term.fencing_token)
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// What an elector knows about the election, published on its
/// [`subscribe`](crate::LeaderElector::subscribe) channel.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub enum LeaderState {
    /// Nothing observed yet.
    #[default]
    Unknown,
    /// Another candidate leads (`Some`), or the lease is free (`None`).
    Following {
        /// The identity of the current holder.
        leader: Option<String>,
    },
    /// This candidate leads.
    Leading(Leadership),
    /// The elector has shut down.
    Stopped,
}

impl LeaderState {
    /// True while this candidate leads.
    pub fn is_leading(&self) -> bool {
        self.leadership().is_some()
    }

    /// The current leadership, while this candidate leads. A term that has just ended (its
    /// token is cancelled an instant before the state changes) is not returned.
    pub fn leadership(&self) -> Option<&Leadership> {
        match self {
            Self::Leading(leadership) if !leadership.is_lost() => Some(leadership),
            _ => None,
        }
    }

    /// The identity of the leader as last observed, this candidate's own when it leads.
    pub fn leader(&self) -> Option<&str> {
        match self {
            Self::Leading(leadership) => Some(leadership.identity()),
            Self::Following { leader } => leader.as_deref(),
            Self::Unknown | Self::Stopped => None,
        }
    }

    pub(crate) fn same_as(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Unknown, Self::Unknown) | (Self::Stopped, Self::Stopped) => true,
            (Self::Following { leader: a }, Self::Following { leader: b }) => a == b,
            (Self::Leading(a), Self::Leading(b)) => a.ptr_eq(b),
            _ => false,
        }
    }
}

/// Why a term ended; passed to [`on_stopped_leading`](crate::LeaderElectorBuilder::on_stopped_leading).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StepDownReason {
    /// No renewal succeeded within the renew deadline.
    RenewDeadlineExceeded,
    /// The record shows another holder (or is gone): someone else took over.
    Lost,
    /// The elector was shut down.
    Shutdown,
    /// The lease was handed over to the candidate a handover request named.
    HandedOver,
    /// The term's work asked to step down ([`Leadership::step_down`]).
    SteppedDown,
    /// The term's work returned while the term went on ([`WorkExit::StepDown`](crate::WorkExit)).
    WorkEnded,
    /// The term's work panicked ([`WorkExit::StepDown`](crate::WorkExit)).
    WorkPanicked,
    /// The shard set was resized to fewer shards than this one's number: the shard is no
    /// longer part of it ([`resize_shard_set`](crate::resize_shard_set)).
    Resized,
}

impl StepDownReason {
    /// True for the ends a leader chose itself (a shutdown, a handover, a step-down, its work
    /// ending), after which it releases the lease; false for a lease lost or not renewed in time.
    pub fn is_voluntary(self) -> bool {
        !matches!(self, Self::RenewDeadlineExceeded | Self::Lost)
    }

    /// True for the ends after which the candidate stands back before running again, so that
    /// another takes the lease it gave up: a step-down, or its work ending.
    pub(crate) fn stands_back(self) -> bool {
        matches!(
            self,
            Self::SteppedDown | Self::WorkEnded | Self::WorkPanicked
        )
    }
}

/// The end of a term, as reported to [`on_stopped_leading`](crate::LeaderElectorBuilder::on_stopped_leading).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepDown {
    /// The fencing token of the term that ended.
    pub fencing_token: u64,
    /// Why it ended.
    pub reason: StepDownReason,
    /// True when the lease was released for others to take at once.
    pub released: bool,
}
