//! The loop of a shard set's member: a round per retry period (renew everything it holds in one
//! batch, read the set in another, then take, give or leave shards), a timer per term (S3).
//! This file holds the member's shared state and the loop; the round's read and decisions are
//! in `runner/round.rs`, the renewals in `runner/renewals.rs`, the claims in
//! `runner/claims.rs`, ending and giving shards in `runner/handing.rs`, the roster and the
//! member records in `runner/members.rs`, a change of the count in `runner/resize.rs`. What
//! the member runs with (configuration, set, identity, callbacks, channels, the reports of
//! unreadable records) is its `Context`, as the elector's. The state they share is in objects
//! of its own: the terms held (`terms::Terms`), each shard's
//! record and what was seen of every record of the set (`table::ShardTable`), the roster as
//! read and the keys a read asks for (`roster::RosterRead`), the releases under way
//! (`handing::Releases`). State that one of them alone uses is its own: the pace of full reads
//! (`round::Pace`), what the member knows of its own record (`members::Membership`), the
//! work's give-ups and extension writes (`handing::WorkRequests`).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::locks::LockSet;
use super::{Callbacks, ShardsConfig, ShardsError, ShardsState, roster_key};
use crate::backoff::{Backoff, Jitter};
use crate::error::LockError;
use crate::leadership::{Leadership, StepDown, StepDownReason, TermDeadline, TermRequest};
use crate::lock::ResourceLock;
use crate::metrics as m;
use crate::record::Observed;
use crate::retry::{FailureLog, LogLine};
use crate::rules::Unanswered;

mod claims;
mod handing;
mod members;
mod renewals;
mod resize;
mod roster;
mod round;
mod table;
mod terms;

/// How many shards a member tries to take at once (each a request on its own record).
const CLAIMS_AT_ONCE: usize = 32;

/// How many release writes a member makes at once: a join at 10,000 shards hands about 900
/// over, a shrink releases every shard past the new count; their writes go out this many at
/// a time, not all at once (bounded load on the store), while the work of each stops at once.
pub(crate) const RELEASES_AT_ONCE: usize = 32;

/// The roster is no election: its `lease_duration` only tells stores that expire records (a
/// free Redis record expires after it) to keep it. Members write it again once a day.
const ROSTER_LEASE: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);
/// How old the roster's last write may grow before a member writes it again.
const ROSTER_REFRESH: chrono::TimeDelta = chrono::TimeDelta::days(1);

/// One term this member holds: a shard's, or its member record's.
struct Term {
    key: String,
    observed: Observed,
    /// When the term started.
    started: Instant,
    /// Moved on by each successful renewal; its timer ends the term when it passes (S3).
    deadline: watch::Sender<Instant>,
    /// The same deadline, for the leadership's readers on other threads.
    shared_deadline: TermDeadline,
    cancel: CancellationToken,
    /// The counted leadership of a shard's term (none for the member record).
    leadership: Option<Leadership>,
    requests: Option<mpsc::Receiver<TermRequest>>,
    alive: Option<mpsc::Receiver<()>>,
}

impl Term {
    fn token(&self) -> u64 {
        self.observed.record.leader_transitions
    }

    fn past_deadline(&self) -> bool {
        self.cancel.is_cancelled() || Instant::now() >= *self.deadline.borrow()
    }

    /// A renewal that started at `started` succeeded: the term lasts until `until` (or a
    /// later deadline that a renewal started after it set already).
    fn extend(&self, until: Instant) {
        let mut latest = until;
        self.deadline.send_if_modified(|deadline| {
            latest = (*deadline).max(until);
            let moved = latest != *deadline;
            *deadline = latest;
            moved
        });
        self.shared_deadline.set(latest.into_std());
    }
}

/// A term dropped without being ended ends (its timer would end it at its deadline anyway).
impl Drop for Term {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// One acquisition attempt: its result, and what it learnt on the way.
struct Claim {
    /// The record taken and when its term starts, or `None` when not taken.
    result: Result<Option<(Observed, Instant)>, LockError>,
    /// The record the store showed as held by another, and whether the store said it keeps
    /// that lease alive itself.
    held: Option<(Observed, bool)>,
    /// The store has no one-request acquisition.
    no_try_acquire: bool,
    /// A record the store showed that is neither taken nor held by another: one read before
    /// the acquisition, one assigned to nobody, or one handed to this member and not
    /// confirmed. Noted before what the store answered after it; its token is seen (S5).
    seen: Option<Observed>,
    /// The claim sent without its answer coming, which may have landed.
    unanswered: Option<Unanswered>,
}

/// The claims that a read of every shard called for, made over the rounds that follow while
/// the members stay as read: a round claims what its budget allows, and the next round goes
/// on from there without reading every shard again.
#[derive(Debug, Default)]
struct Plan {
    /// This member's own shards that it holds no term of, to take again whatever the room.
    lapsed: std::collections::VecDeque<u32>,
    /// The open shards, best first: taken until `room` are, a shard that another member took
    /// first making way for the next.
    candidates: std::collections::VecDeque<u32>,
    room: usize,
    /// This member takes no shard (drained, or of weight 0): its lapsed shards are released
    /// once their records are its own again, never taken up with a term and work.
    drained: bool,
}

impl Plan {
    fn done(&self) -> bool {
        self.lapsed.is_empty() && (self.candidates.is_empty() || self.room == 0)
    }
}

/// A record of the set that could not be read this round (garbage, a wrong-typed key, a
/// refusal): reported and left alone (S8).
#[derive(Clone, Copy, Debug)]
struct Unreadable;

/// One read of the set.
struct View {
    /// The roster, absent, or unreadable.
    roster: Result<Option<Observed>, Unreadable>,
    /// The members whose record was read (absent or not), by identity: an unreadable member
    /// record is in `unreadable_members` instead.
    members: HashMap<String, Option<Observed>>,
    /// The members whose record could not be read.
    unreadable_members: BTreeSet<String>,
    /// Whether every shard was read (into [`Runner::shard_records`]).
    shards: bool,
}

/// What a member learned of the store from its answers.
struct Learned {
    /// Whether the store takes a record in one request ([`ResourceLock::try_acquire`]): true
    /// until it says it does not.
    try_acquire: bool,
    /// Whether the store renews leases without a new version, learned from this member's own
    /// first renewal: then a member record's unchanged version says nothing of its age.
    renews_in_store: Option<bool>,
}

/// When the next read of the set goes out: at the next round after one that succeeded, after
/// a growing wait while they fail (S9).
struct Attempts {
    backoff: Backoff,
    next: Instant,
}

impl Attempts {
    /// Whether a read may go out now.
    fn due(&self) -> bool {
        Instant::now() >= self.next
    }

    /// A read succeeded: the next goes out at the next round.
    fn succeeded(&mut self) {
        self.backoff.succeeded();
        self.next = Instant::now();
    }

    /// A read failed: the next waits the back-off.
    fn failed(&mut self) {
        self.backoff.failed();
        self.next = Instant::now() + self.backoff.wait();
    }
}

/// A set's balance as a member last read it, for its state and its metrics.
#[derive(Clone, Copy, Default)]
struct Balance {
    /// The members alive.
    live: usize,
    /// The most shards a live member owns less the fewest.
    imbalance: usize,
}

/// What the member runs with: its configuration, its set and identity, the callbacks, the
/// channels it publishes on, and what it last reported of each unreadable record; as the
/// elector's runner keeps its context apart from its campaign and term.
struct Context {
    config: ShardsConfig,
    set: Arc<dyn LockSet>,
    /// This member's identity (the set's).
    me: String,
    callbacks: Callbacks,
    /// The state channel ([`Shards::subscribe`](super::Shards::subscribe)).
    state: watch::Sender<ShardsState>,
    /// The count this member follows, for the work ([`Shards::subscribe_count`](super::Shards::subscribe_count)).
    count: watch::Sender<u32>,
    /// The records that could not be read, with the error last reported of each: a record is
    /// reported when it turns unreadable (or its error changes) and when it is read again,
    /// not every round.
    unreadable: HashMap<String, String>,
    /// The failed requests of an outage, logged as the elector logs them (S9): when it starts
    /// or changes, in a summary every 10 s, and when it ends; not one line per request.
    failures: FailureLog,
}

impl Context {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.set.lock(key)
    }

    /// A batch that answered another number of keys than it was asked: not to be trusted.
    fn miscounted(&self) -> LockError {
        LockError::unavailable(
            "shards",
            format!(
                "{}: a batch read answered another number of keys",
                self.set.describe()
            ),
        )
    }

    /// A failed request: counted in the errors metric each time, logged as [`FailureLog`] says.
    fn report(&mut self, operation: &'static str, err: &LockError) {
        m::error(&self.config.name, operation, err.kind());
        let shards = &self.config.name;
        // One outage whatever the request: a round's renewals, reads and claims alternate,
        // and each change of operation would otherwise be logged as a new kind of failure.
        match self.failures.failed("shard set", err) {
            LogLine::Started => {
                tracing::warn!(shards, operation, error = %err, "shard set request failed");
            }
            LogLine::Changed => {
                tracing::warn!(shards, operation, error = %err, "shard set request failed differently");
            }
            LogLine::Summary { count, since } => tracing::warn!(
                shards,
                operation,
                failures = count,
                since = ?since,
                last_error = %err,
                "shard set requests still failing"
            ),
            LogLine::Quiet | LogLine::Recovered { .. } => {
                tracing::debug!(shards, operation, error = %err, "shard set request failed");
            }
        }
    }

    /// A read of the set the store answered: an outage, if any, is over.
    fn report_success(&mut self) {
        if let LogLine::Recovered { count, lasted } = self.failures.succeeded() {
            tracing::info!(shards = self.config.name, failures = count, lasted = ?lasted, "shard set requests succeed again");
        }
    }

    /// Record `key` could not be read (S8): counted in the errors metric each time, said in
    /// the log when it turns unreadable or its error changes. The record is left alone.
    fn report_unreadable(&mut self, key: &str, err: &LockError) {
        m::error(&self.config.name, "read", err.kind());
        let said = err.to_string();
        if self.unreadable.get(key) != Some(&said) {
            tracing::warn!(
                shards = self.config.name,
                key,
                error = %err,
                "a record of the set cannot be read: it is left alone, and the rest of the set goes on"
            );
            self.unreadable.insert(key.to_owned(), said);
        }
    }

    /// Record `key` was read: said in the log when it was unreadable before.
    fn note_readable(&mut self, key: &str) {
        if !self.unreadable.is_empty() && self.unreadable.remove(key).is_some() {
            tracing::info!(
                shards = self.config.name,
                key,
                "a record of the set that could not be read is readable again"
            );
        }
    }
}

pub(crate) struct Runner {
    /// What the member runs with (its configuration, set, identity, callbacks and channels).
    cx: Context,
    /// The member record's term and the shards' (`runner/terms.rs`).
    terms: terms::Terms,
    /// This member's own record and what it knows of the others' (`runner/members.rs`).
    membership: members::Membership,
    /// The roster as last read, and the keys a read asks for (`runner/roster.rs`).
    roster: roster::RosterRead,
    /// What this member learned of the store from its answers.
    learned: Learned,
    /// When the next read of the set goes out.
    attempts: Attempts,
    /// Why this member takes no shards, if it takes none for a reason (its state says so).
    problem: Option<ShardsError>,
    /// The set's balance as last read.
    balance: Balance,
    /// The releases under way (`runner/handing.rs`).
    releases: handing::Releases,
    /// Each shard's key and what this member knows of its record, and what it saw of the
    /// set's other records (`runner/table.rs`).
    table: table::ShardTable,
    /// When every shard is read again (`runner/round.rs`).
    pace: round::Pace,
    /// The claims left of the last read of every shard.
    plan: Option<Plan>,
    /// What the last round's renewals took: a round claims for half a retry period less it.
    renewals_took: std::time::Duration,
    /// What the shards' work asked for and waits on (`runner/handing.rs`).
    work_requests: handing::WorkRequests,
}

impl Runner {
    pub(crate) fn new(
        config: ShardsConfig,
        set: Arc<dyn LockSet>,
        callbacks: Callbacks,
        state: watch::Sender<ShardsState>,
        count: watch::Sender<u32>,
    ) -> Self {
        let me = set.identity().to_owned();
        let backoff = Backoff::new(config.lease.retry_period, config.lease.lease_duration)
            .jitter(Jitter::Spread(0.2));
        let table = table::ShardTable::new(&config.name, config.count);
        let roster = roster::RosterRead::new(&config.name, &table.keys);
        Self {
            cx: Context {
                config,
                set,
                me,
                callbacks,
                state,
                count,
                unreadable: HashMap::new(),
                failures: FailureLog::default(),
            },
            terms: terms::Terms::new(),
            membership: members::Membership::new(),
            roster,
            learned: Learned {
                try_acquire: true,
                renews_in_store: None,
            },
            attempts: Attempts {
                backoff,
                next: Instant::now(),
            },
            problem: None,
            balance: Balance::default(),
            releases: handing::Releases::new(),
            table,
            pace: round::Pace::new(),
            plan: None,
            renewals_took: std::time::Duration::ZERO,
            work_requests: handing::WorkRequests::default(),
        }
    }

    pub(crate) async fn run(mut self, shutdown: CancellationToken) -> Result<(), ShardsError> {
        let name = self.cx.config.name.clone();
        tracing::info!(
            shards = name,
            count = self.cx.config.count,
            identity = self.cx.me,
            "joining the shard set"
        );
        if self.cx.config.static_membership && super::looks_like_replica_set_pod(&self.cx.me) {
            tracing::warn!(
                shards = name,
                identity = self.cx.me,
                "static membership is on, but this identity looks like the name of a \
                 ReplicaSet's Pod (a Deployment's), which changes on every restart: static \
                 membership keeps nothing, and the shards of each restarted member stay idle \
                 for the window; run the set as a StatefulSet, whose Pod names stay, or turn \
                 static membership off"
            );
        }
        // A lease the store would not keep is refused before anything is written (as the
        // elector refuses it).
        let roster = self.cx.lock(&roster_key(&name));
        let lease = self.cx.config.lease.lease_duration;
        match tokio::time::timeout(
            self.cx.config.lease.request_timeout,
            roster.check_lease(lease),
        )
        .await
        {
            Ok(Err(err @ LockError::Misconfigured { .. })) => {
                let refused = ShardsError::LeaseNotKept {
                    name: name.clone(),
                    message: err.to_string(),
                };
                tracing::error!(shards = name, "{refused}");
                self.problem = Some(refused.clone());
                self.publish(true);
                return Err(refused);
            }
            Ok(Err(err)) => tracing::debug!(error = %err, "could not check the lease"),
            Ok(Ok(())) | Err(_) => {}
        }
        let mut result = Ok(());
        // Renewals keep their pace, a retry period apart; reads and acquisitions back off
        // while the store fails (S9).
        let mut round = tokio::time::interval(self.cx.config.lease.retry_period);
        round.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                _ = round.tick() => {}
            }
            self.serve_requests();
            if self.attempts.due() {
                let full = self.full_read_wanted();
                // A read of the roster and the members goes with the renewals, in one request
                // where the store allows it; a read of every shard only after them, so that
                // the renewals never wait for its answer (a round's terms are extended only
                // once its renewals' answer is in).
                if full {
                    self.renew().await;
                }
                let mut step = self.read_and_act(full, !full).await;
                // A change seen in a read of the members alone: read the shards at once, if
                // their pace allows.
                if matches!(step, Ok(true)) && !full && self.full_read_wanted() {
                    step = self.read_and_act(true, false).await;
                }
                if let Err(err) = step {
                    // The caller says so (the `leader` command in one line).
                    result = Err(err);
                    break;
                }
            } else {
                self.renew().await;
            }
            self.write_extensions().await;
            self.publish(false);
        }
        self.leave().await;
        self.publish(true);
        result
    }

    /// A read of the set (`full`: with every shard), after this round's renewals when `renew`
    /// says so, and what follows from it. False when the read failed (reported, and the next
    /// one backs off).
    async fn read_and_act(&mut self, full: bool, renew: bool) -> Result<bool, ShardsError> {
        match self.read(full, renew).await {
            Ok(view) => {
                self.attempts.succeeded();
                self.cx.report_success();
                self.act(view).await?;
                Ok(true)
            }
            Err(err) => {
                self.attempts.failed();
                self.cx.report("read", &err);
                Ok(false)
            }
        }
    }

    /// A request on record `key`, waiting no longer than the request timeout nor than the
    /// first deadline of the terms held: past it, the term it ends needs a renewal more than
    /// this request needs an answer.
    async fn request<T>(
        &self,
        operation: &'static str,
        key: &str,
        request: impl std::future::Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let started = Instant::now();
        let until = self.request_deadline();
        match tokio::time::timeout_at(until, request).await {
            Ok(result) => result,
            Err(_) => Err(LockError::Timeout {
                lock: format!("{} {key}", self.cx.set.describe()),
                operation,
                after: until.saturating_duration_since(started),
            }),
        }
    }

    /// When a request sent now must have been answered: a request timeout from now, or the
    /// first deadline of the terms held if sooner.
    fn request_deadline(&self) -> Instant {
        let until = Instant::now() + self.cx.config.lease.request_timeout;
        self.terms
            .first_deadline()
            .map_or(until, |first| until.min(first))
    }

    /// Publishes the state when it changed: a round that changed nothing wakes no subscriber
    /// and copies no list of shards.
    fn publish(&mut self, stopped: bool) {
        let members = self.balance.live;
        m::set_shards(
            &self.cx.config.name,
            self.terms.owned().len(),
            members,
            self.balance.imbalance,
        );
        let owned = self.terms.take_changed().then(|| {
            self.terms
                .owned()
                .iter()
                .filter_map(|(&s, t)| t.leadership.as_ref().map(|l| (s, l.uncounted())))
                .collect()
        });
        let problem = &self.problem;
        self.cx.state.send_if_modified(|state| {
            let changed = owned.is_some()
                || state.members != members
                || state.problem != *problem
                || state.stopped != stopped;
            if let Some(owned) = owned {
                state.owned = owned;
            }
            state.members = members;
            state.problem.clone_from(problem);
            state.stopped = stopped;
            changed
        });
    }
}

/// Tells the callback given to `on_shard_stopped`, if any, that a shard's term ended.
fn tell_stopped(
    callback: Option<&Arc<super::Stopped>>,
    shard: u32,
    fencing_token: u64,
    reason: StepDownReason,
    released: bool,
) {
    if let Some(stopped) = callback {
        stopped(
            shard,
            StepDown {
                fencing_token,
                reason,
                released,
            },
        );
    }
}

fn reason_label(reason: StepDownReason) -> &'static str {
    match reason {
        StepDownReason::Lost => "lost",
        StepDownReason::RenewDeadlineExceeded => "expired",
        StepDownReason::HandedOver => "handed_over",
        _ => "released",
    }
}

/// The timer of a term (S3): cancels it once its deadline passes without being moved on. It
/// wakes at the deadline it last read, not at each renewal: a renewal only moves the deadline
/// later, and a term dropped is cancelled by its drop.
fn end_at_deadline(cancel: CancellationToken, deadline: watch::Receiver<Instant>) {
    tokio::spawn(async move {
        loop {
            let until = *deadline.borrow();
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep_until(until) => {
                    if Instant::now() >= *deadline.borrow() {
                        cancel.cancel();
                        return;
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests;
