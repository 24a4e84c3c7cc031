//! Ending and giving shards: a term ended, a shard handed to the member that should own it,
//! releases reaped, the work's requests served, the back-off of a shard whose work keeps
//! ending, and the extensions a shard's work writes.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use futures_util::future::join_all;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{CLAIMS_AT_ONCE, RELEASES_AT_ONCE, Runner, Term, reason_label, tell_stopped};
use crate::backoff::{Backoff, Jitter};
use crate::error::LockError;
use crate::leadership::{
    ExtensionChanges, ExtensionError, LeadershipLost, StepDownReason, TermRequest,
};
use crate::lock::{ResourceLock, within};
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed, Version};
use crate::rules;

/// How long a shard's work must have run for its next give-up to count as a first one again
/// (Kubernetes's CrashLoopBackOff resets after as long).
const GIVE_UP_RESET: std::time::Duration = std::time::Duration::from_secs(600);
/// The longest a member waits before taking again a shard whose work gave it up (as
/// CrashLoopBackOff's cap).
const GIVE_UP_CAP: std::time::Duration = std::time::Duration::from_secs(300);

/// The releases under way: the shards given up whose release is under way, or whose term
/// ended while its work still runs, each with the task that waits for it. Their shards are
/// neither this member's nor to take again until the task ends, though their records still
/// name this member.
pub(super) struct Releases {
    tasks: JoinSet<u32>,
    /// The release writes that may be under way at once ([`RELEASES_AT_ONCE`]).
    writes: Arc<Semaphore>,
    under_way: BTreeMap<u32, tokio::task::Id>,
}

impl Releases {
    pub(super) fn new() -> Self {
        Self {
            tasks: JoinSet::new(),
            writes: Arc::new(Semaphore::new(RELEASES_AT_ONCE)),
            under_way: BTreeMap::new(),
        }
    }

    /// Runs `release` of `shard` in the background; the shard is under way until it ends.
    fn spawn(&mut self, shard: u32, release: impl Future<Output = ()> + Send + 'static) {
        let task = self.tasks.spawn(async move {
            release.await;
            shard
        });
        self.under_way.insert(shard, task.id());
    }

    /// Whether a release of `shard` is under way.
    pub(super) fn contains(&self, shard: u32) -> bool {
        self.under_way.contains_key(&shard)
    }

    /// Whether no release is under way.
    pub(super) fn is_empty(&self) -> bool {
        self.under_way.is_empty()
    }

    /// Forgets the releases that ended: their shards are read as anyone's again.
    pub(super) fn reap(&mut self) {
        while let Some(ended) = self.tasks.try_join_next() {
            match ended {
                Ok(shard) => {
                    self.under_way.remove(&shard);
                }
                Err(err) => self.under_way.retain(|_, task| *task != err.id()),
            }
        }
    }

    /// Waits for the releases under way, `bound` at the most, and abandons those left.
    pub(super) async fn finish(&mut self, bound: std::time::Duration) {
        let _ = tokio::time::timeout(bound, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        self.tasks.abort_all();
    }
}

/// What the shards' work asked for and waits on: the shards it gave up, which this member
/// takes again only after a back-off, and the extensions it asked to write.
#[derive(Default)]
pub(super) struct WorkRequests {
    /// The shards whose work gave them up, while this member waits before taking them again.
    gave_up: BTreeMap<u32, GaveUp>,
    /// The extensions the shards' work asked to write, made after the round's renewals.
    extension_writes: VecDeque<ExtensionWrite>,
}

/// A shard whose work gave it up on this member: not taken again by this member before
/// `until` (S9 for work: a crashing work is not restarted at once, every time).
struct GaveUp {
    /// Consecutive give-ups of terms that ended soon after they started.
    backoff: Backoff,
    /// When the last give-up was.
    at: Instant,
    until: Instant,
}

/// An extensions write a shard's work asked for, and where its answer goes.
type ExtensionWrite = (
    u32,
    ExtensionChanges,
    oneshot::Sender<Result<(), ExtensionError>>,
);

impl WorkRequests {
    /// Forgets the give-ups that no longer count: those before [`GIVE_UP_RESET`] from `now`.
    pub(super) fn forget_old_give_ups(&mut self, now: Instant) {
        self.gave_up.retain(|_, g| now < g.at + GIVE_UP_RESET);
    }

    /// Forgets the give-ups of the shards from `count` on (removed by a resize).
    pub(super) fn forget_give_ups_from(&mut self, count: u32) {
        self.gave_up.retain(|&shard, _| shard < count);
    }

    /// Whether this member waits at `now` before taking a shard again.
    pub(super) fn any_backing_off(&self, now: Instant) -> bool {
        self.gave_up.values().any(|g| now < g.until)
    }
}

impl Runner {
    /// Ends the term of `shard` without releasing it. Until its work has stopped, the shard is
    /// kept out as a release under way is: its record may still name this member (on a store
    /// whose leases outlive a term, such as a member's one etcd lease, for as long as the
    /// member lives), and taking it again then would start its work a second time beside the
    /// first.
    pub(super) fn end(&mut self, shard: u32, reason: StepDownReason) {
        if let Some(mut term) = self.terms.remove(shard) {
            self.unsettle();
            term.cancel.cancel();
            m::shard_moved(&self.cx.config.name, reason_label(reason));
            let stopped = self.cx.callbacks.stopped.as_ref();
            tell_stopped(stopped, shard, term.token(), reason, false);
            if let Some(mut alive) = term.alive.take() {
                drop(term);
                self.releases.spawn(shard, async move {
                    let _ = alive.recv().await;
                });
            }
        }
    }

    /// Ends the term of `shard` and releases it once its work has stopped (S6), naming `to` as
    /// the next owner when given (S10); in the background, so renewals keep their pace.
    pub(super) fn give(&mut self, shard: u32, to: Option<&str>, reason: StepDownReason) {
        self.release(shard, to, None, reason);
    }

    /// Ends the term of `shard` at shutdown and releases it reserved for this member's own
    /// identity (static membership) for the window: the released record carries the window
    /// as its lease, which every member reading it stands back for (S10), so that a process
    /// started again with this identity within it takes the shard back.
    pub(super) fn reserve(&mut self, shard: u32) {
        let me = self.cx.me.clone();
        let window = self.cx.config.static_membership_window;
        self.release(shard, Some(&me), Some(window), StepDownReason::Shutdown);
    }

    /// Ends the term of `shard` and releases it, naming `to` (S10), with `hold` as the
    /// released record's lease when given (how long the others stand back from `to`'s
    /// request).
    fn release(
        &mut self,
        shard: u32,
        to: Option<&str>,
        hold: Option<std::time::Duration>,
        reason: StepDownReason,
    ) {
        let Some(mut term) = self.terms.remove(shard) else {
            return;
        };
        self.unsettle();
        term.cancel.cancel();
        let lock = self.cx.lock(&term.key);
        let grace = self.cx.config.lease.stop_grace;
        let timeout = self.cx.config.lease.request_timeout;
        let stopped = self.cx.callbacks.stopped.clone();
        let to = to.map(str::to_owned);
        let name = self.cx.config.name.clone();
        let clock = self.cx.config.lease.wall_clock.clone();
        let writes = self.releases.writes.clone();
        let me = self.cx.me.clone();
        m::shard_moved(&name, reason_label(reason));
        tracing::info!(shards = name, shard, to, "releasing the shard");
        self.releases.spawn(shard, async move {
            let fencing_token = term.token();
            drop(term.leadership.take());
            let work_stopped = match term.alive.as_mut() {
                Some(alive) => tokio::time::timeout(grace, alive.recv()).await.is_ok(),
                None => true,
            };
            let mut released = false;
            if work_stopped {
                // A release that names no one clears a pending request too: the set's
                // assignment, not a request, says who takes the shard next.
                let release = |held: &LeaderElectionRecord| {
                    let free = rules::released(held, clock.now());
                    LeaderElectionRecord {
                        preferred_holder: to.clone(),
                        lease_duration: hold.unwrap_or(free.lease_duration),
                        ..free
                    }
                };
                let term_of = (me.as_str(), fencing_token);
                released = write_release(
                    &writes,
                    &*lock,
                    term.observed.clone(),
                    term_of,
                    release,
                    timeout,
                )
                .await;
            } else {
                tracing::warn!(
                    shards = name,
                    shard,
                    "the shard's work did not stop in time: leaving the shard to expire"
                );
            }
            tell_stopped(stopped.as_ref(), shard, fencing_token, reason, released);
            // This member takes the shard again only once the work has stopped.
            if let Some(alive) = term.alive.as_mut().filter(|_| !work_stopped) {
                let _ = alive.recv().await;
            }
        });
    }

    /// Releases `shard`, whose record this drained member took back (`observed`) without
    /// starting a term or work: in the background, the shard kept out as a release under way
    /// is until it ends. The release names no one: the members under their share take it.
    pub(super) fn free(&mut self, shard: u32, observed: Observed) {
        let Some(key) = self.table.keys.get(shard as usize) else {
            return;
        };
        let lock = self.cx.lock(key);
        let timeout = self.cx.config.lease.request_timeout;
        let clock = self.cx.config.lease.wall_clock.clone();
        let me = self.cx.me.clone();
        self.unsettle();
        tracing::info!(
            shards = self.cx.config.name,
            shard,
            "this member is drained: releasing a shard whose term had lapsed, without taking it up"
        );
        let writes = self.releases.writes.clone();
        self.releases.spawn(shard, async move {
            let release = |held: &LeaderElectionRecord| LeaderElectionRecord {
                preferred_holder: None,
                ..rules::released(held, clock.now())
            };
            let term_of = (me.as_str(), observed.record.leader_transitions);
            write_release(&writes, &*lock, observed, term_of, release, timeout).await;
        });
    }

    /// The requests of shards' work: a step-down, a handover, extensions to write. Writes of
    /// extensions wait for [`write_extensions`](Self::write_extensions), after the round's
    /// renewals.
    pub(super) fn serve_requests(&mut self) {
        let mut asked = Vec::new();
        for (shard, term) in self.terms.owned_mut() {
            if let Some(requests) = term.requests.as_mut() {
                while let Ok(request) = requests.try_recv() {
                    asked.push((shard, request));
                }
            }
        }
        for (shard, request) in asked {
            match request {
                TermRequest::StepDown => {
                    self.back_off(shard);
                    self.give(shard, None, StepDownReason::SteppedDown);
                }
                TermRequest::HandOver(to) => {
                    self.give(shard, Some(&to), StepDownReason::HandedOver)
                }
                TermRequest::SetExtensions { changes, reply } => {
                    self.work_requests
                        .extension_writes
                        .push_back((shard, changes, reply));
                }
            }
        }
    }

    /// The work of `shard` gave it up: this member takes it again only after a back-off, the
    /// jittered retry period at first, doubling with each give-up that follows the last one
    /// within [`GIVE_UP_RESET`] (unless the term ran that long), up to [`GIVE_UP_CAP`].
    pub(super) fn back_off(&mut self, shard: u32) {
        let Some(term) = self.terms.owned().get(&shard) else {
            return;
        };
        let now = Instant::now();
        let ran = now - term.started;
        let retry = self.cx.config.lease.retry_period;
        let gave_up = self
            .work_requests
            .gave_up
            .entry(shard)
            .or_insert_with(|| GaveUp {
                backoff: Backoff::new(retry, GIVE_UP_CAP).jitter(Jitter::Spread(0.2)),
                at: now,
                until: now,
            });
        if ran >= GIVE_UP_RESET || now >= gave_up.at + GIVE_UP_RESET {
            gave_up.backoff.succeeded();
        }
        let wait = gave_up.backoff.failed();
        gave_up.at = now;
        gave_up.until = now + wait;
        tracing::warn!(
            shards = self.cx.config.name,
            shard,
            times = gave_up.backoff.failures(),
            ran = ?ran,
            after = ?wait,
            "the shard's work gave it up: taking it again after a back-off"
        );
    }

    /// True while this member waits before taking `shard` again (see [`Runner::back_off`]).
    pub(super) fn backing_off(&self, shard: u32) -> bool {
        self.work_requests
            .gave_up
            .get(&shard)
            .is_some_and(|g| Instant::now() < g.until)
    }

    /// Writes the extensions the shards' work asked for since the last round, after this
    /// round's renewals so that none waits for them: up to [`CLAIMS_AT_ONCE`] at a time (one
    /// per shard at a time, each on its own record), each waiting no longer than its term's
    /// deadline. Each write is a compare-and-swap of the record its term last stored, and
    /// renews the term as a renewal would.
    ///
    /// A write that loses its compare-and-swap reads the record first, as a renewal does
    /// ([`reread`](Self::reread)): a renewal whose answer was lost may have moved the record
    /// on under this very term. While it is still the term's, the write is sent once more over
    /// the version read; otherwise the term is lost (or handed over, as the record asks).
    pub(super) async fn write_extensions(&mut self) {
        // The shards whose write was read back and sent again: a second conflict is final.
        let mut sent_again = BTreeSet::new();
        while !self.work_requests.extension_writes.is_empty() {
            let mut batch = Vec::new();
            let mut later = VecDeque::new();
            let mut shards = BTreeSet::new();
            while let Some((shard, changes, reply)) =
                self.work_requests.extension_writes.pop_front()
            {
                if batch.len() < CLAIMS_AT_ONCE && shards.insert(shard) {
                    batch.push((shard, changes, reply));
                } else {
                    later.push_back((shard, changes, reply));
                }
            }
            self.work_requests.extension_writes = later;
            let mut writes = Vec::with_capacity(batch.len());
            for (shard, changes, reply) in batch {
                let Some(term) = self
                    .terms
                    .owned()
                    .get(&shard)
                    .filter(|t| !t.past_deadline())
                else {
                    let token = self.terms.owned().get(&shard).map_or(0, Term::token);
                    let lost = LeadershipLost {
                        fencing_token: token,
                    };
                    let _ = reply.send(Err(ExtensionError::Lost(lost)));
                    continue;
                };
                let mut record = rules::renewal(&term.observed.record, &self.cx.config.lease);
                changes.apply(&mut record.extensions);
                let until = (Instant::now() + self.cx.config.lease.request_timeout)
                    .min(*term.deadline.borrow());
                let write = (
                    term.key.clone(),
                    term.observed.version.clone(),
                    record,
                    until,
                );
                writes.push((shard, term.token(), reply, write, changes));
            }
            let started = Instant::now();
            let describe = self.cx.set.describe();
            let answers = join_all(writes.iter().map(
                |(_, _, _, (key, version, record, until), _)| {
                    let lock = self.cx.lock(key);
                    let describe = &describe;
                    async move {
                        match tokio::time::timeout_at(*until, lock.update(version, record)).await {
                            Ok(result) => result,
                            Err(_) => Err(LockError::Timeout {
                                lock: format!("{describe} {key}"),
                                operation: "update",
                                after: until.saturating_duration_since(started),
                            }),
                        }
                    }
                },
            ))
            .await;
            let mut conflicts = Vec::new();
            for ((shard, token, reply, (_, version, _, _), changes), result) in
                writes.into_iter().zip(answers)
            {
                match result {
                    Err(err) if err.is_conflict() && sent_again.insert(shard) => {
                        conflicts.push((shard, token, version, err, (changes, reply)));
                    }
                    result => {
                        let answer =
                            self.extensions_written(shard, token, &version, result, started);
                        let _ = reply.send(answer);
                    }
                }
            }
            if !conflicts.is_empty() {
                // The terms still this member's adopt the version read, and their writes go
                // first; the renewals it offers are not needed: each write renews.
                let whose = conflicts.iter().map(|c| Some(c.0)).collect();
                let mut unread = self.reread(whose).await.unread;
                for (shard, token, version, err, (changes, reply)) in conflicts.into_iter().rev() {
                    let term = (self.terms.owned().get(&shard))
                        .filter(|t| t.token() == token && !t.past_deadline());
                    let read_error = unread
                        .iter()
                        .position(|(whose, _)| *whose == Some(shard))
                        .map(|at| unread.swap_remove(at).1);
                    match (term, read_error) {
                        // The read failed: the term goes on until a renewal succeeds or its
                        // deadline passes (S3), and the work hears why.
                        (Some(_), Some(read_error)) => {
                            let _ = reply.send(Err(ExtensionError::Lock(read_error)));
                        }
                        (Some(term), None) if term.observed.version != version => {
                            self.work_requests
                                .extension_writes
                                .push_front((shard, changes, reply));
                        }
                        // Read back at the version written: the conflict stands as the answer.
                        (Some(_), None) => {
                            let _ = reply.send(Err(ExtensionError::Lock(Arc::new(err))));
                        }
                        (None, _) => {
                            let lost = LeadershipLost {
                                fencing_token: token,
                            };
                            let _ = reply.send(Err(lost.into()));
                        }
                    }
                }
            }
        }
    }

    /// Takes the answer of an extensions write of `shard`'s term `token`, sent at `started`
    /// on the record at `version`.
    fn extensions_written(
        &mut self,
        shard: u32,
        token: u64,
        version: &Version,
        result: Result<Observed, LockError>,
        started: Instant,
    ) -> Result<(), ExtensionError> {
        let lost = LeadershipLost {
            fencing_token: token,
        };
        let Some(term) = self
            .terms
            .get_mut(Some(shard))
            .filter(|t| !t.past_deadline() && t.token() == token)
        else {
            return Err(lost.into());
        };
        match result {
            Ok(stored) => {
                if let Some(leadership) = &term.leadership {
                    *leadership
                        .extensions_handle()
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = stored.record.extensions.clone();
                }
                // A renewal of this term answered meanwhile moved it on: this write, on the
                // version before, extends nothing it did not.
                if term.observed.version == *version {
                    term.observed = stored;
                    term.extend(started + self.cx.config.lease.renew_deadline);
                }
                Ok(())
            }
            Err(err) if err.is_conflict() => {
                self.end(shard, StepDownReason::Lost);
                Err(lost.into())
            }
            Err(err) => Err(ExtensionError::Lock(Arc::new(err))),
        }
    }
}

/// Releases the term `term_of` (identity, fencing token) whose record was last seen as `last`
/// ([`rules::release_term`]), each request within `timeout`, once one of the release writes
/// that may be under way at once (`writes`, [`RELEASES_AT_ONCE`](super::RELEASES_AT_ONCE)) is
/// free. True when the record is free.
async fn write_release(
    writes: &tokio::sync::Semaphore,
    lock: &dyn ResourceLock,
    last: Observed,
    term_of: (&str, u64),
    release: impl Fn(&LeaderElectionRecord) -> LeaderElectionRecord,
    timeout: std::time::Duration,
) -> bool {
    // The semaphore is never closed: a permit always comes. It is held a request at a time,
    // not through the waits between tries, which other shards' releases may use; the budget
    // counts from the first try, not from the wait for its permit.
    let first = std::sync::Mutex::new(Some(writes.acquire().await));
    let permit = || async {
        let held = first.lock().unwrap_or_else(|p| p.into_inner()).take();
        match held {
            Some(permit) => permit,
            None => writes.acquire().await,
        }
    };
    let ended = rules::release_term(
        Some(last),
        term_of,
        timeout,
        release,
        |version, record| async move {
            let _write = permit().await;
            within(lock, "release", timeout, lock.update(&version, &record)).await
        },
        || async {
            let _read = permit().await;
            within(lock, "get", timeout, lock.get()).await
        },
    )
    .await;
    ended.released
}
