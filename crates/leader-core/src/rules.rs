//! The lease rules that the elector and a shard set's member both keep, written once: what a
//! candidate saw of a record and since when, on its own monotonic clock (S1, S2), the
//! stand-back from a handover request that names another candidate (S10), what an
//! acquisition and a release write (S5, S6, S16) and how a release is sent again after a
//! transient failure, whether a term is still its own (also one whose acquisition went
//! unanswered), a term of this identity that this process did not start (S13), and a record
//! found gone under a lease that still runs (S2).

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

use crate::config::LeaseConfig;
use crate::error::LockError;
use crate::lock::HolderCheck;
use crate::record::{LeaderElectionRecord, Observed, Version};

/// What a candidate saw of one record: the follower's clock for the holder's lease (S2) and
/// the stand-back clock for a pending handover request (S10).
///
/// A holder's lease runs for the record's `lease_duration` from when the candidate first saw
/// its version (after the read returned, not when it was sent), so a holder that renews by
/// writing is never taken over while it renews. A lease that the store kept alive itself (a
/// TTL, a session) is not counted at all while the store keeps it: the candidate waits for
/// the store. Should the store stop keeping it with the version unchanged (a Redis `PERSIST`
/// or `RESTORE` of the key, an operator's edit), the candidate counts a whole lease from
/// then, never from when it first saw the version: it may have seen it a term ago. A record
/// found gone is a state of its own, counted alike from the first read that found it
/// ([`Sighting::lease_ends_at`]).
#[derive(Clone, Debug)]
pub(crate) struct Sighting {
    version: Version,
    /// The holder of that version's record (empty when it is free), and its lease.
    holder: String,
    lease_duration: Duration,
    /// When the lease's clock started: the version first seen, or the store seen to stop
    /// keeping it.
    since: Instant,
    /// Whether the store said, last it was asked, that it keeps this version's lease alive.
    kept_by_store: bool,
    /// When a read first found the record gone (S2 for a record that is gone), while it
    /// stays gone.
    gone_since: Option<Instant>,
    /// The pending handover request this candidate saw, if any.
    handover: Option<Request>,
}

/// The fencing token of the acquisition that takes over `record` (S5): one more than its
/// token. A token that cannot grow any more is an error, never a token given out again.
///
/// # Errors
/// [`LockError::InvalidRecord`] for a record whose token is `u64::MAX`.
pub(crate) fn next_token(record: &LeaderElectionRecord) -> Result<u64, LockError> {
    record
        .leader_transitions
        .checked_add(1)
        .ok_or_else(tokens_run_out)
}

fn tokens_run_out() -> LockError {
    LockError::invalid_record(
        "lock",
        "the record's fencing token is the largest there is: no token above it can be given \
         out (was it written by hand?)",
    )
}

/// The largest fencing token a candidate saw in one record, read or written, for as long as
/// it runs (S5). Its acquisitions take a token above it, so a record deleted under the
/// election (by hand, by a bucket's lifecycle rule, by a cache's eviction) and written anew
/// does not give out the tokens it gave out before, to a candidate that saw them. One that
/// never saw them (started after the deletion, or whose last read came before the last
/// acquisition) cannot know them: the configured floor is for that.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TokensSeen {
    highest: u64,
}

impl TokensSeen {
    /// The larger of two: every token either saw.
    pub(crate) fn max(self, other: Self) -> Self {
        Self {
            highest: self.highest.max(other.highest),
        }
    }

    /// Takes note of the token of `record`, read or written. The largest token there is, no
    /// token can be above: a record written with it is refused as long as it stands (S8), and
    /// a floor made of it would refuse every record after it too.
    pub(crate) fn see(&mut self, record: &LeaderElectionRecord) {
        if record.leader_transitions < u64::MAX {
            self.highest = self.highest.max(record.leader_transitions);
        }
    }

    /// The token of an acquisition that creates the record, or the least a store that gives
    /// the next token itself is asked for: above every token seen. Never `u64::MAX` overflowed:
    /// [`see`](Self::see) passes that token over.
    pub(crate) fn floor(&self) -> u64 {
        self.highest.saturating_add(1)
    }

    /// The token of an acquisition that takes over `record`: above its token and above every
    /// token seen.
    ///
    /// # Errors
    /// [`LockError::InvalidRecord`] when `record`'s token is `u64::MAX`.
    pub(crate) fn next(&self, record: &LeaderElectionRecord) -> Result<u64, LockError> {
        Ok(next_token(record)?.max(self.floor()))
    }
}

/// The record that `me` writes to take a lease with token `token` (from [`next_token`], or
/// given by the store), raised to the configured floor (S5). It fulfils, or overrides, a
/// pending handover request (S10); it keeps the strategy and the extensions of `base`, the
/// record it replaces; and it is this release's record: fields of a later release belonged to
/// the term that wrote them (S16).
pub(crate) fn acquisition(
    me: &str,
    lease: &LeaseConfig,
    token: u64,
    base: Option<&LeaderElectionRecord>,
) -> LeaderElectionRecord {
    let now = lease.wall_clock.now();
    LeaderElectionRecord {
        holder_identity: me.to_owned(),
        lease_duration: lease.lease_duration,
        acquire_time: now,
        renew_time: now,
        leader_transitions: token.max(lease.fencing_token_floor),
        strategy: base.and_then(|r| r.strategy.clone()),
        preferred_holder: None,
        extensions: base.map(|r| r.extensions.clone()).unwrap_or_default(),
        unknown_fields: Default::default(),
    }
}

/// The record that renews the term of `held` (S3): the same record, renewed now by the wall
/// clock (never earlier than it was: [`LeaderElectionRecord::renewal_time`]).
pub(crate) fn renewal(held: &LeaderElectionRecord, lease: &LeaseConfig) -> LeaderElectionRecord {
    let mut record = held.clone();
    record.renew_time = record.renewal_time(lease.wall_clock.now());
    record
}

/// S3 for a lease handed over by a release ([`Acquisition::Handed`]), which the store last
/// confirmed alive at `alive_since`: whether a term counted from then still has more than a
/// retry period of its renew deadline at `now`. With less, a renewal confirms the lease before the
/// term starts, or its work would start only to be stopped before the first renewal.
///
/// [`Acquisition::Handed`]: crate::Acquisition::Handed
pub(crate) fn handed_term_left(lease: &LeaseConfig, alive_since: Instant, now: Instant) -> bool {
    now + lease.retry_period < alive_since + lease.renew_deadline
}

/// The record that ends the term of `held` at `now` (S6): no holder, and everything else kept:
/// the token, which the next acquisition raises (S5), a pending handover request, the
/// extensions, and fields this release does not know (S16). Written with a compare-and-swap
/// on the term's version, so a release never frees a lease that someone else holds.
pub(crate) fn released(held: &LeaderElectionRecord, now: DateTime<Utc>) -> LeaderElectionRecord {
    LeaderElectionRecord {
        holder_identity: String::new(),
        acquire_time: now,
        renew_time: now,
        ..held.clone()
    }
}

/// S2 for a record that may be gone: whether a candidate that last saw another holder's
/// lease ([`Sighting::counted_holder`]) reads the record before it acquires through a lock
/// whose one-request acquisition knows the holder as `check` says: yes where that acquisition
/// would take a record found gone ([`HolderCheck::Record`], [`HolderCheck::Process`]), whose
/// holder leads on until its next renewal meets the deletion. A record found gone is then
/// waited out ([`Sighting::lease_ends_at`]). A lock without such an acquisition reads anyway.
pub(crate) fn reads_first(check: HolderCheck) -> bool {
    matches!(check, HolderCheck::Record | HolderCheck::Process)
}

/// What that read decides for a record it found, `held` by another under a lease that runs on
/// this candidate's clock: `true` to wait, unless the store may know better, when the
/// acquisition is sent to ask (its clock, or what it knows of the holder, decides it):
/// * its holder may be gone although its lease runs ([`HolderCheck::Process`]: its process
///   ended);
/// * the read is `seen_late`: the first of this version after failed attempts, so the version
///   may have been written at any time while they failed, and a lease counted from this read
///   may end long after the store's (S2 by the store's clock, as a candidate that starts
///   asks). A shard set's member, whose reads of every shard are half a lease apart once
///   settled, sends every claim after a read that found the record.
pub(crate) fn waits_after_read(check: HolderCheck, held: bool, seen_late: bool) -> bool {
    held && check != HolderCheck::Process && !seen_late
}

/// An acquisition that a candidate sent without getting its answer (it timed out, or its
/// connection dropped): the store may have applied it. Without this, the candidate would read
/// its own term back as one this process did not start (S13), and wait out its lease as
/// another process's, with nobody leading.
#[derive(Clone, Debug)]
pub(crate) struct Unanswered {
    acquire_time: DateTime<Utc>,
    /// One lease after it was sent: a record that old is waited out as any other.
    until: Instant,
}

impl Unanswered {
    /// The acquisition of `sent`, whose answer did not come.
    pub(crate) fn new(sent: &LeaderElectionRecord) -> Self {
        Self {
            acquire_time: sent.acquire_time,
            until: Instant::now() + sent.lease_duration,
        }
    }

    /// Passes on `answer`, the answer to an acquisition of `sent`, noting it in `slot` when
    /// it did not come (a timeout, the store out of reach): it may hide one that landed.
    pub(crate) fn note<T>(
        slot: &mut Option<Self>,
        sent: &LeaderElectionRecord,
        answer: Result<T, LockError>,
    ) -> Result<T, LockError> {
        if let Err(err) = &answer
            && err.is_transient()
        {
            *slot = Some(Self::new(sent));
        }
        answer
    }

    /// Whether `record` is what that acquisition wrote: held by `me`, acquired at the instant
    /// it stated, to the microsecond (what the stores keep), never renewed since, and read
    /// within a lease of the sending. Only this process wrote that instant under this
    /// identity, unless another process of it (S13) acquired at the same microsecond by its
    /// own clock; the last two conditions leave such a twin's term no more than the moment
    /// before its first renewal, and a clock stepped back no second chance later. A store
    /// that writes its own clock's time instead never matches, and the term is waited out as
    /// before.
    pub(crate) fn wrote(&self, record: &LeaderElectionRecord, me: &str) -> bool {
        let micros = |t: DateTime<Utc>| t.timestamp_micros();
        record.is_held_by(me)
            && micros(record.acquire_time) == micros(self.acquire_time)
            && micros(record.renew_time) == micros(record.acquire_time)
            && Instant::now() < self.until
    }
}

/// The first wait before a release is sent again after a transient failure; each next one
/// doubles, up to [`RELEASE_RETRY_CAP`].
const RELEASE_RETRY_FIRST: Duration = Duration::from_millis(100);
/// The longest wait between two tries of a release.
const RELEASE_RETRY_CAP: Duration = Duration::from_secs(1);

/// Sends a release (S6) with `send`, and again after a passing failure (the store out of
/// reach, or throttling the request) for as long as `budget`, counted from the first try: a
/// release that does not land costs the others a whole lease before one of them leads, where
/// a second try a moment later (a new connection, a throttled request's `Retry-After`) would
/// have handed the lease on at once. A try sent again is cut short where the budget ends,
/// answered with the failure before it, so the whole stays within the longer of the first
/// try and the budget. A first try that ran out of time (with a `budget` of one request
/// timeout) is not sent again: a store that slow would not answer the next either. A release
/// sent again is as safe as the first: it is a compare-and-swap on the term's version, so one
/// that landed unanswered makes the next a conflict, never a second write. Any other answer
/// is final.
pub(crate) async fn release_with_retries<F, Fut>(
    budget: Duration,
    mut send: F,
) -> Result<Observed, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Observed, LockError>>,
{
    let until = Instant::now() + budget;
    let mut wait = RELEASE_RETRY_FIRST;
    let mut answer = send().await;
    loop {
        match answer {
            Err(err) if err.is_transient() && Instant::now() + wait < until => {
                tracing::debug!(error = %err, ?wait, "the release failed; sending it again");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(RELEASE_RETRY_CAP);
                answer = tokio::time::timeout_at(until, send())
                    .await
                    .unwrap_or(Err(err));
            }
            answer => return answer,
        }
    }
}

/// What [`release_term`] came to.
#[derive(Debug)]
pub(crate) struct Released {
    /// Whether the term's record is free now: written so by this release, or found so under
    /// the term's token, which only this term's release writes (a try whose answer was lost
    /// had landed).
    pub(crate) released: bool,
    /// What the read after a lost compare-and-swap found, for the candidate to note (S2, S5).
    pub(crate) read: Option<Observed>,
    /// What the store answered to the release that landed.
    pub(crate) stored: Option<Observed>,
    /// The failure that ended it unreleased; none where the record was found to be another
    /// term's (or gone), which is not this term's to release.
    pub(crate) error: Option<LockError>,
}

/// Releases the term `token` of `me` (S6), whose record was last seen as `last`: a
/// compare-and-swap of the record `release` makes of it over its version, sent again after a
/// passing failure ([`release_with_retries`]). That version can be stale without anyone else
/// having written: a renewal whose answer was lost (timed out, cut short by the shutdown) may
/// have landed. So a release that loses the compare-and-swap reads the record (`read`) and,
/// while it is still the term, is sent once more over the version read. `write` sends one
/// try; both are the caller's, with its timeouts. Every engine releases through it, so a term
/// is let go of the same way wherever it was held.
pub(crate) async fn release_term<W, WF, R, RF>(
    last: Option<Observed>,
    (me, token): (&str, u64),
    budget: Duration,
    release: impl Fn(&LeaderElectionRecord) -> LeaderElectionRecord,
    mut write: W,
    mut read: R,
) -> Released
where
    W: FnMut(Version, LeaderElectionRecord) -> WF,
    WF: Future<Output = Result<Observed, LockError>>,
    R: FnMut() -> RF,
    RF: Future<Output = Result<Option<Observed>, LockError>>,
{
    let mut ended = Released {
        released: false,
        read: None,
        stored: None,
        error: None,
    };
    let mut current = last;
    for attempt in 0..2 {
        let Some(ours) = current.filter(|o| is_term(&o.record, me, token)) else {
            return ended;
        };
        let record = release(&ours.record);
        let sent = release_with_retries(budget, || write(ours.version.clone(), record.clone()));
        match sent.await {
            Ok(stored) => {
                ended.released = true;
                ended.stored = Some(stored);
                return ended;
            }
            Err(err) if err.is_conflict() && attempt == 0 => match read().await {
                Ok(fresh) => {
                    ended.released = fresh.as_ref().is_some_and(|f| {
                        f.record.is_free() && f.record.leader_transitions == token
                    });
                    ended.read.clone_from(&fresh);
                    if ended.released {
                        return ended;
                    }
                    current = fresh;
                }
                Err(err) => {
                    ended.error = Some(err);
                    return ended;
                }
            },
            Err(err) => {
                ended.error = Some(err);
                return ended;
            }
        }
    }
    ended
}

/// Whether `record` is still the term that `me` took with `token`: its identity and its
/// token. A later acquisition under the same identity (another process, or this one again)
/// raised the token, so it is another term (S5, S13).
pub(crate) fn is_term(record: &LeaderElectionRecord, me: &str, token: u64) -> bool {
    record.is_held_by(me) && record.leader_transitions == token
}

/// S13: whether `record` is held under `me` by a term this process did not start (`own` is
/// the token of the term it took last, if any): another process's term under the same
/// identity, which the candidate treats as another holder's.
pub(crate) fn started_elsewhere(record: &LeaderElectionRecord, me: &str, own: Option<u64>) -> bool {
    record.is_held_by(me) && !own.is_some_and(|token| is_term(record, me, token))
}

/// S13: a term held under this candidate's identity that this process did not start, which
/// the candidate treats as another's (it waits for it as for any holder's) and reports once it
/// is seen alive: a shared identity is a misconfiguration, never two leaders.
#[derive(Clone, Debug)]
pub(crate) struct OtherTerm {
    fencing_token: u64,
    /// The version it was first seen at: a newer one under the same term is a renewal.
    version: Version,
    first_seen: Instant,
    /// When the store said, at first sight, that its lease runs out.
    first_expiry: Option<Instant>,
    reported: bool,
}

impl OtherTerm {
    /// The term of `observed`, first seen at `now`, with the lease end the store gave then.
    pub(crate) fn new(observed: &Observed, now: Instant, first_expiry: Option<Instant>) -> Self {
        Self {
            fencing_token: observed.record.leader_transitions,
            version: observed.version.clone(),
            first_seen: now,
            first_expiry,
            reported: false,
        }
    }

    /// Whether `observed` is still this term (its identity's record, under its token).
    pub(crate) fn is(&self, observed: &Observed) -> bool {
        observed.record.leader_transitions == self.fencing_token
    }

    /// True, once, when `observed` (this term, read at `now`) shows the term alive: renewed
    /// (a new version under its token), or, where the store may keep leases alive without a
    /// new version (`kept` not `Some(false)`: the store said so, or nobody can tell yet), still
    /// held past the lease end the store gave at first sight, else two leases after it was
    /// first seen, and a retry period more. A process of this identity that died holding the
    /// term is not alive: its lease runs out unrenewed.
    pub(crate) fn seen_alive(
        &mut self,
        observed: &Observed,
        kept: Option<bool>,
        retry_period: std::time::Duration,
        now: Instant,
    ) -> bool {
        if self.reported {
            return false;
        }
        let renewed = self.version != observed.version;
        let outlived = kept != Some(false)
            && now
                >= self
                    .first_expiry
                    .unwrap_or(self.first_seen + observed.record.lease_duration * 2)
                    + retry_period;
        self.reported = renewed || outlived;
        self.reported
    }

    /// Whether it was reported alive.
    pub(crate) fn reported(&self) -> bool {
        self.reported
    }
}

/// A pending handover request as a candidate saw it: whom it names, in which term, when the
/// candidate first saw it, and until when it stands back: a lease from then, the longest lease
/// that any record carrying the request has shown since (a release that keeps the request
/// writes a short lease, which must not cut the stand-back short).
///
/// A request belongs to the term whose record carries it (its fencing token): a release keeps
/// the token, and every acquisition, which clears the request, raises it. So a request naming
/// the same candidate under another token is a new one, made after the first was fulfilled
/// (a static member that shut down, came back and shut down again), even when the candidate
/// never saw the records in between: it gets a stand-back of its own.
#[derive(Clone, Debug)]
struct Request {
    to: String,
    fencing_token: u64,
    since: Instant,
    until: Instant,
}

impl Request {
    fn new(to: &str, now: Instant, record: &LeaderElectionRecord) -> Self {
        Self {
            to: to.to_owned(),
            fencing_token: record.leader_transitions,
            since: now,
            until: now + record.lease_duration,
        }
    }

    /// Whether `record`'s request (naming `to`) is this one.
    fn is(&self, to: &str, record: &LeaderElectionRecord) -> bool {
        self.to == to && self.fencing_token == record.leader_transitions
    }
}

/// What a new sighting changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Changes {
    /// The version is new: the lease's clock started again.
    pub(crate) version: bool,
    /// A handover request (to another candidate than before, or in another term) was seen
    /// for the first time.
    pub(crate) handover: bool,
}

impl Sighting {
    /// The first sighting of `observed`, at `now`.
    pub(crate) fn new(observed: &Observed, now: Instant) -> Self {
        Self {
            version: observed.version.clone(),
            holder: observed.record.holder_identity.clone(),
            lease_duration: observed.record.lease_duration,
            since: now,
            kept_by_store: false,
            gone_since: None,
            handover: observed
                .record
                .handover_to()
                .map(|to| Request::new(to, now, &observed.record)),
        }
    }

    /// Notes `observed`, read or written at `now`: a new version starts the lease's clock
    /// again, a new handover request the stand-back clock.
    pub(crate) fn see(&mut self, observed: &Observed, now: Instant) -> Changes {
        let mut changes = Changes::default();
        self.gone_since = None;
        if self.version != observed.version {
            self.version.clone_from(&observed.version);
            self.holder.clone_from(&observed.record.holder_identity);
            self.lease_duration = observed.record.lease_duration;
            self.since = now;
            self.kept_by_store = false;
            changes.version = true;
        }
        match (observed.record.handover_to(), &mut self.handover) {
            (Some(to), Some(seen)) if seen.is(to, &observed.record) => {
                seen.until = seen.until.max(seen.since + observed.record.lease_duration);
            }
            (Some(to), _) => {
                self.handover = Some(Request::new(to, now, &observed.record));
                changes.handover = true;
            }
            (None, _) => self.handover = None,
        }
        changes
    }

    /// Notes what the store said at `now` of the lease of the version last seen: whether it
    /// keeps it alive itself. A lease it stopped keeping is counted from `now`.
    pub(crate) fn store_keeps(&mut self, kept: bool, now: Instant) {
        if self.kept_by_store && !kept {
            self.since = now;
        }
        self.kept_by_store = kept;
    }

    /// True when the store last said it keeps alive the lease of `version`, which is the
    /// version last seen: an answer that it no longer does restarts the lease's clock, so a
    /// candidate must not take that lease on the strength of the clock as it stands.
    pub(crate) fn kept_by_store(&self, version: &Version) -> bool {
        self.kept_by_store && self.version == *version
    }

    /// True when `observed` is the version last seen and has stayed so for its lease (S2).
    pub(crate) fn expired(&self, observed: &Observed, now: Instant) -> bool {
        self.is(&observed.version) && now >= self.since + self.lease_duration
    }

    /// The holder of the version last seen, where the candidates count its lease: `None` for
    /// a free record, and for a lease the store keeps alive itself (an etcd lease, a Redis
    /// key's TTL), whose record the store deletes when the lease ends.
    pub(crate) fn counted_holder(&self) -> Option<&str> {
        self.holder().filter(|_| !self.kept_by_store)
    }

    /// The holder of the version last seen: `None` for a free record.
    pub(crate) fn holder(&self) -> Option<&str> {
        (!self.holder.is_empty()).then_some(self.holder.as_str())
    }

    /// Notes that a read at `now` found the record gone; the first such read starts the
    /// wait ([`lease_ends_at`](Self::lease_ends_at)).
    pub(crate) fn see_gone(&mut self, now: Instant) {
        self.gone_since.get_or_insert(now);
    }

    /// Whether `version` is the version last seen.
    pub(crate) fn is(&self, version: &Version) -> bool {
        self.version == *version
    }

    /// Whether a read found the record gone since it was last seen.
    pub(crate) fn is_gone(&self) -> bool {
        self.gone_since.is_some()
    }

    /// When the lease of the holder last seen ([`counted_holder`](Self::counted_holder)) runs
    /// out for this candidate: `since` its version was first seen plus its lease, or sooner
    /// where the store said of this version when the lease ends by its clock (`store_ends`,
    /// S1), as for any record; and for a record found gone, a whole lease from the first read
    /// that found it gone (S2 for a record that is gone). A record deleted under a live holder
    /// (by hand, a bucket's lifecycle rule, an operator's edit) leaves the holder leading until
    /// its next renewal meets the deletion, at most its renew deadline after its last renewal,
    /// which came before that read, though perhaps after the version this candidate saw: a
    /// candidate that took the election at once would lead beside it, and one that counted
    /// from the version it saw might too. Absence is a state of the record as a new version
    /// is, counted from when it was first seen.
    pub(crate) fn lease_ends_at(&self, store_ends: Option<Instant>) -> Instant {
        match self.gone_since {
            Some(gone) => gone + self.lease_duration,
            None => {
                let ends = self.since + self.lease_duration;
                store_ends.map_or(ends, |store| store.min(ends))
            }
        }
    }

    /// Until when a candidate `me` stands back from `record` (the version last seen), whose
    /// pending handover request names another candidate: one lease from when it first saw
    /// the request. `None` when no request names another candidate, or this one has not
    /// seen it yet.
    pub(crate) fn stand_back_until(
        &self,
        record: &LeaderElectionRecord,
        me: &str,
    ) -> Option<Instant> {
        if !record.reserved_for_other_than(me) {
            return None;
        }
        let seen = self.handover.as_ref()?;
        let to = record.handover_to()?;
        seen.is(to, record)
            .then(|| seen.until.max(seen.since + record.lease_duration))
    }

    /// True while `me` stands back at `now` from `record`, which may be newer than the
    /// version last seen: a request this candidate has not seen yet is stood back from too.
    pub(crate) fn standing_back(
        sighting: Option<&Self>,
        record: &LeaderElectionRecord,
        me: &str,
        now: Instant,
    ) -> bool {
        record.reserved_for_other_than(me)
            && sighting
                .and_then(|s| s.stand_back_until(record, me))
                .is_none_or(|until| now < until)
    }

    /// When the lease's clock started: the version first seen, or the store seen to stop
    /// keeping its lease.
    pub(crate) fn since(&self) -> Instant {
        self.since
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use chrono::Utc;
    use proptest::prelude::*;

    use super::*;
    use crate::config::LeaseSettings;

    fn observed(holder: &str, version: &str, handover: Option<&str>) -> Observed {
        let now = Utc::now();
        Observed {
            record: LeaderElectionRecord {
                holder_identity: holder.into(),
                lease_duration: Duration::from_secs(10),
                acquire_time: now,
                renew_time: now,
                leader_transitions: 1,
                strategy: None,
                preferred_holder: handover.map(str::to_owned),
                extensions: Default::default(),
                unknown_fields: Default::default(),
            },
            version: Version::new(version),
        }
    }

    /// S13: another process's term of this identity is reported once, when seen renewed, or
    /// where the store may keep it alive, when it outlives two leases and a retry period;
    /// a dead twin's term, which a store renewing by writes leaves unchanged, is not.
    #[tokio::test(start_paused = true)]
    async fn another_process_of_this_identity_is_reported_once_seen_alive() {
        let start = Instant::now();
        let retry = Duration::from_secs(2);
        let first = observed("a", "1", None);
        let mut twin = OtherTerm::new(&first, start, None);
        let later = start + Duration::from_secs(60);
        assert!(
            !twin.seen_alive(&first, Some(false), retry, later),
            "renews by writes"
        );
        let renewed = observed("a", "2", None);
        assert!(twin.seen_alive(&renewed, Some(false), retry, start));
        assert!(
            !twin.seen_alive(&renewed, Some(false), retry, start),
            "once"
        );
        // Kept alive by the store, or nobody can tell yet: alive once it outlives two leases.
        for kept in [Some(true), None] {
            let mut twin = OtherTerm::new(&first, start, None);
            let two_leases = start + Duration::from_secs(20);
            assert!(!twin.seen_alive(&first, kept, retry, two_leases));
            assert!(twin.seen_alive(&first, kept, retry, two_leases + retry));
            assert!(twin.reported() && twin.is(&first));
        }
        // The lease end the store gave is the bound instead.
        let mut twin = OtherTerm::new(&first, start, Some(start + Duration::from_secs(5)));
        assert!(twin.seen_alive(&first, Some(true), retry, start + Duration::from_secs(7)));
    }

    #[test]
    fn tokens_grow_and_never_repeat_at_the_top() {
        let mut record = observed("a", "1", None).record;
        record.leader_transitions = 41;
        assert_eq!(next_token(&record).ok(), Some(42));
        record.leader_transitions = u64::MAX;
        let err = next_token(&record).expect_err("no token above the largest");
        assert!(matches!(err, LockError::InvalidRecord { .. }), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_runs_from_when_its_version_was_first_seen() {
        let start = Instant::now();
        let first = observed("a", "1", None);
        let mut seen = Sighting::new(&first, start);
        let later = start + Duration::from_secs(9);
        assert_eq!(seen.see(&first, later), Changes::default());
        assert!(!seen.expired(&first, later));
        assert!(seen.expired(&first, start + Duration::from_secs(10)));
        // A renewal: a new version, a new lease.
        let renewed = observed("a", "2", None);
        assert!(seen.see(&renewed, later).version);
        assert!(!seen.expired(&renewed, start + Duration::from_secs(10)));
        assert!(
            !seen.expired(&first, start + Duration::from_secs(30)),
            "not the version seen"
        );
        assert!(seen.expired(&renewed, later + Duration::from_secs(10)));
    }

    /// S2 for a record that is gone: a whole lease from the first read that found it gone, not
    /// from when its last version was seen (the holder may have renewed since, unseen), nor by
    /// an older answer of the store's clock; nothing to wait for a free record or one the
    /// store kept alive; the record back ends the wait.
    #[tokio::test(start_paused = true)]
    async fn a_record_found_gone_is_waited_out_from_that_read() {
        let start = Instant::now();
        let held = observed("a", "1", None);
        let mut seen = Sighting::new(&held, start);
        assert_eq!(seen.counted_holder(), Some("a"));
        let store_ends = Some(start + Duration::from_secs(3));
        assert_eq!(
            seen.lease_ends_at(store_ends),
            start + Duration::from_secs(3)
        );
        let found = start + Duration::from_secs(8);
        seen.see_gone(found);
        seen.see_gone(found + Duration::from_secs(5));
        assert!(seen.is_gone());
        assert_eq!(
            seen.lease_ends_at(store_ends),
            found + Duration::from_secs(10)
        );
        seen.see(&held, found + Duration::from_secs(6));
        assert!(!seen.is_gone(), "the record is back");
        assert_eq!(seen.lease_ends_at(None), start + Duration::from_secs(10));
        let free = observed("", "2", None);
        assert_eq!(Sighting::new(&free, start).counted_holder(), None);
        seen.store_keeps(true, found);
        assert_eq!(seen.counted_holder(), None, "the store keeps the lease");
    }

    /// A store that kept the lease alive and stops (Redis `PERSIST`, `RESTORE`) with the
    /// version unchanged: the lease is counted from then, not from the term's start.
    #[tokio::test(start_paused = true)]
    async fn a_lease_the_store_stops_keeping_is_counted_from_then() {
        let start = Instant::now();
        let held = observed("a", "1", None);
        let mut seen = Sighting::new(&held, start);
        seen.store_keeps(true, start);
        assert!(seen.kept_by_store(&held.version));
        let stopped = start + Duration::from_secs(3600);
        seen.see(&held, stopped);
        seen.store_keeps(false, stopped);
        assert!(!seen.kept_by_store(&held.version));
        assert!(!seen.expired(&held, stopped + Duration::from_secs(9)));
        assert!(seen.expired(&held, stopped + Duration::from_secs(10)));
        // Never kept by the store (another client's record without a TTL): counted from the
        // first sighting, as before.
        let mut other = Sighting::new(&held, start);
        other.store_keeps(false, stopped);
        assert!(other.expired(&held, stopped));
        // A new version forgets what the store said of the old one.
        seen.store_keeps(true, stopped);
        let next = observed("a", "2", None);
        seen.see(&next, stopped);
        assert!(!seen.kept_by_store(&next.version));
    }

    #[tokio::test(start_paused = true)]
    async fn a_handover_request_is_stood_back_from_for_a_lease() {
        let start = Instant::now();
        let request = observed("a", "1", Some("b"));
        let mut seen = Sighting::new(&observed("a", "0", None), start);
        let at = start + Duration::from_secs(2);
        assert!(seen.see(&request, at).handover);
        assert_eq!(
            seen.stand_back_until(&request.record, "c"),
            Some(at + Duration::from_secs(10))
        );
        assert_eq!(
            seen.stand_back_until(&request.record, "b"),
            None,
            "the one named"
        );
        assert!(Sighting::standing_back(
            Some(&seen),
            &request.record,
            "c",
            at
        ));
        assert!(!Sighting::standing_back(
            Some(&seen),
            &request.record,
            "c",
            at + Duration::from_secs(10)
        ));
        // The same request again is not new; another candidate named is.
        assert!(!seen.see(&request, at).handover);
        let other = observed("a", "2", Some("d"));
        assert!(Sighting::standing_back(
            Some(&seen),
            &other.record,
            "c",
            at + Duration::from_secs(60)
        ));
        assert!(seen.see(&other, at).handover);
        // The holder releases, keeping the request, with a short lease (as client-go's release
        // writes 1 s): the stand-back still runs a lease of the request from when it was seen.
        let mut released = observed("", "3", Some("d"));
        released.record.lease_duration = Duration::from_secs(1);
        assert!(!seen.see(&released, at + Duration::from_secs(1)).handover);
        assert_eq!(
            seen.stand_back_until(&released.record, "c"),
            Some(at + Duration::from_secs(10))
        );
        // Not seen at all: stood back from.
        assert!(Sighting::standing_back(None, &other.record, "c", at));
        assert_eq!(
            seen.since(),
            at + Duration::from_secs(1),
            "a new version starts the clock"
        );
    }

    /// A request naming the same candidate again in a later term (taken by the candidate
    /// named, then released to it again) is a new request with a stand-back of its own, also
    /// when the records in between went unseen; within one term (held, then released) it is
    /// the same request.
    #[tokio::test(start_paused = true)]
    async fn a_request_made_again_in_a_later_term_is_stood_back_from_anew() {
        let start = Instant::now();
        let mut first = observed("", "1", Some("x"));
        first.record.leader_transitions = 4;
        let mut seen = Sighting::new(&first, start);
        let lease = Duration::from_secs(10);
        let later = start + Duration::from_secs(8);
        let mut again = observed("", "3", Some("x"));
        again.record.leader_transitions = 5;
        assert!(seen.see(&again, later).handover, "a new request");
        assert_eq!(
            seen.stand_back_until(&again.record, "c"),
            Some(later + lease)
        );
        assert!(Sighting::standing_back(
            Some(&seen),
            &again.record,
            "c",
            start + lease + Duration::from_secs(1)
        ));
        // Unseen yet, under its own token: stood back from until seen.
        let mut third = observed("", "5", Some("x"));
        third.record.leader_transitions = 6;
        assert_eq!(seen.stand_back_until(&third.record, "c"), None);
        assert!(Sighting::standing_back(
            Some(&seen),
            &third.record,
            "c",
            later + lease * 5
        ));
        // The same term's release keeps the request and its clock.
        let mut released = observed("", "4", Some("x"));
        released.record.leader_transitions = 5;
        assert!(!seen.see(&released, later + lease).handover);
        assert_eq!(
            seen.stand_back_until(&released.record, "c"),
            Some(later + lease)
        );
    }

    /// One step of the model of the rules below: what a candidate does, or time passing.
    #[derive(Clone, Debug)]
    enum Step {
        /// Time passes, in tenths of a second.
        Wait(u16),
        /// A candidate sends a read: the store's record now.
        Read(usize),
        /// The answer of that read arrives, late or not: the candidate notes it then.
        Answer(usize),
        /// A candidate takes the lease if the rules let it, on what it saw last.
        Take(usize),
        /// The holder renews (within its renew deadline).
        Renew(usize),
        /// The holder releases, handing over to a candidate or not.
        Release(usize, Option<usize>),
        /// The store drops a free record (a TTL's tidy-up): the tokens the candidates saw
        /// keep theirs up (S5).
        Delete,
    }

    fn step(candidates: usize) -> impl Strategy<Value = Step> {
        let who = 0..candidates;
        prop_oneof![
            3 => (0u16..200).prop_map(Step::Wait),
            3 => who.clone().prop_map(Step::Read),
            3 => who.clone().prop_map(Step::Answer),
            3 => who.clone().prop_map(Step::Take),
            2 => who.clone().prop_map(Step::Renew),
            1 => (who.clone(), proptest::option::of(who)).prop_map(|(c, to)| Step::Release(c, to)),
            1 => Just(Step::Delete),
        ]
    }

    /// A candidate of the model: what it saw, a read in flight, and its term.
    #[derive(Default)]
    struct Candidate {
        seen: Option<(Observed, Sighting)>,
        tokens: TokensSeen,
        in_flight: Option<Option<Observed>>,
        /// The token and end of the term it holds: the start of its last successful write
        /// plus the renew deadline (S3).
        term: Option<(u64, Instant)>,
    }

    /// A term of the model: its holder, token, start and end, and whether a record was
    /// deleted before it was taken by a candidate that had not seen every token written.
    #[derive(Debug)]
    struct ModelTerm {
        holder: usize,
        token: u64,
        start: Instant,
        end: Instant,
        blind: bool,
    }

    /// Runs `steps` against a store that keeps one record and compares versions, with
    /// candidates that follow the rules of this module: `Sighting` for expiry and stand-back,
    /// `TokensSeen`, `acquisition` and `released` for what they write, `is_term` for whether a
    /// term is still theirs. Returns each term taken.
    fn model(steps: &[Step], candidates: usize) -> Vec<ModelTerm> {
        let lease = LeaseSettings::default()
            .check()
            .expect("the default settings");
        let name = |c: usize| format!("candidate-{c}");
        let start = Instant::now();
        let mut now = start;
        let mut store: Option<Observed> = None;
        let mut writes = 0u64;
        // The largest token written, and whether a record was deleted: what a candidate
        // that never saw that token cannot know.
        let mut largest = 0u64;
        let mut deleted = false;
        let write =
            |store: &mut Option<Observed>, writes: &mut u64, record: LeaderElectionRecord| {
                *writes += 1;
                let stored = Observed {
                    record,
                    version: Version::new(writes.to_string()),
                };
                *store = Some(stored.clone());
                stored
            };
        let mut cs: Vec<Candidate> = (0..candidates).map(|_| Candidate::default()).collect();
        let mut terms = Vec::new();
        for step in steps {
            match *step {
                Step::Wait(tenths) => now += Duration::from_millis(u64::from(tenths) * 100),
                Step::Read(c) => cs[c].in_flight = Some(store.clone()),
                Step::Answer(c) => {
                    let Some(answer) = cs[c].in_flight.take() else {
                        continue;
                    };
                    if let Some(observed) = &answer {
                        cs[c].tokens.see(&observed.record);
                    }
                    cs[c].seen = answer.map(|observed| match cs[c].seen.take() {
                        Some((_, mut seen)) => {
                            seen.see(&observed, now);
                            (observed, seen)
                        }
                        None => {
                            let seen = Sighting::new(&observed, now);
                            (observed, seen)
                        }
                    });
                }
                Step::Take(c) => {
                    let me = name(c);
                    let (base, token) = match &cs[c].seen {
                        // Free, or its lease ran out on this candidate's clock, and no request
                        // names another.
                        Some((observed, seen))
                            if (observed.record.is_free() || seen.expired(observed, now))
                                && !Sighting::standing_back(
                                    Some(seen),
                                    &observed.record,
                                    &me,
                                    now,
                                ) =>
                        {
                            let Ok(token) = cs[c].tokens.next(&observed.record) else {
                                continue;
                            };
                            (Some(observed.clone()), token)
                        }
                        Some(_) => continue,
                        None => (None, cs[c].tokens.floor()),
                    };
                    // The compare-and-swap on the version read (a create when none was).
                    if store.as_ref().map(|o| &o.version) != base.as_ref().map(|o| &o.version) {
                        continue;
                    }
                    let record = acquisition(&me, &lease, token, base.as_ref().map(|o| &o.record));
                    let blind = deleted && cs[c].tokens.highest < largest;
                    let stored = write(&mut store, &mut writes, record);
                    let token = stored.record.leader_transitions;
                    largest = largest.max(token);
                    let end = now + lease.renew_deadline;
                    cs[c].term = Some((token, end));
                    cs[c].tokens.see(&stored.record);
                    cs[c].seen = Some((stored.clone(), Sighting::new(&stored, now)));
                    terms.push(ModelTerm {
                        holder: c,
                        token,
                        start: now,
                        end,
                        blind,
                    });
                }
                Step::Renew(c) => {
                    let Some((token, end)) = cs[c].term else {
                        continue;
                    };
                    let Some(current) = store.as_ref().filter(|o| {
                        now < end
                            && rules_term(o, &name(c), token)
                            && cs[c]
                                .seen
                                .as_ref()
                                .is_some_and(|(s, _)| s.version == o.version)
                    }) else {
                        cs[c].term = None;
                        continue;
                    };
                    let mut record = current.record.clone();
                    record.renew_time = record.renewal_time(lease.wall_clock.now());
                    let stored = write(&mut store, &mut writes, record);
                    let end = now + lease.renew_deadline;
                    cs[c].term = Some((token, end));
                    cs[c].seen = Some((stored.clone(), Sighting::new(&stored, now)));
                    terms.last_mut().expect("a term").end = end;
                }
                Step::Release(c, to) => {
                    let Some((token, _)) = cs[c].term.take() else {
                        continue;
                    };
                    let Some(current) = store.as_ref().filter(|o| rules_term(o, &name(c), token))
                    else {
                        continue;
                    };
                    let mut record = released(&current.record, lease.wall_clock.now());
                    record.preferred_holder = to.map(name);
                    write(&mut store, &mut writes, record);
                    terms.last_mut().expect("a term").end = now;
                }
                Step::Delete => {
                    if store.as_ref().is_some_and(|o| o.record.is_free()) {
                        store = None;
                        deleted = true;
                    }
                }
            }
            // A holder past its renew deadline has stopped leading.
            for c in &mut cs {
                if c.term.is_some_and(|(_, end)| now >= end) {
                    c.term = None;
                }
            }
        }
        terms
    }

    fn rules_term(observed: &Observed, me: &str, token: u64) -> bool {
        is_term(&observed.record, me, token)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

        /// Whatever the order of reads, late answers, takes, renewals, releases, deletions and
        /// clock readings: no two terms overlap, and every term's token is above every earlier
        /// one's, also after the record was deleted, unless the candidate that took it never
        /// saw the largest token (only a floor kept outside the record can know that one).
        #[test]
        fn no_two_terms_overlap_and_tokens_never_go_back(
            candidates in 2usize..4,
            steps in proptest::collection::vec(step(3), 1..120),
        ) {
            let steps: Vec<Step> = steps
                .into_iter()
                .filter(|s| match *s {
                    Step::Read(c) | Step::Answer(c) | Step::Take(c) | Step::Renew(c) => c < candidates,
                    Step::Release(c, to) => c < candidates && to.is_none_or(|t| t < candidates),
                    _ => true,
                })
                .collect();
            let terms = model(&steps, candidates);
            for (i, a) in terms.iter().enumerate() {
                for b in &terms[i + 1..] {
                    prop_assert!(b.start >= a.end, "term {b:?} starts before {a:?} ends");
                    prop_assert!(b.token > a.token || b.blind, "token {} after {}", b.token, a.token);
                }
            }
        }
    }

    /// The model's candidates take a held lease only once it ran out on their clock.
    #[tokio::test(start_paused = true)]
    async fn in_the_model_a_held_lease_is_taken_after_a_whole_lease() {
        let steps = [
            Step::Take(0),
            Step::Read(1),
            Step::Answer(1),
            Step::Wait(150),
            Step::Take(1),
        ];
        let terms = model(&steps, 2);
        assert_eq!(terms.len(), 2, "b takes after a whole lease: {terms:?}");
        assert!(terms[1].start >= terms[0].end);
        assert_eq!(terms[1].holder, 1);
        // Without the wait, the rules refuse b.
        let steps = [Step::Take(0), Step::Read(1), Step::Answer(1), Step::Take(1)];
        assert_eq!(model(&steps, 2).len(), 1);
    }

    /// A record with the largest token there is cannot be taken over, and once it is fixed
    /// or gone the candidate takes tokens again: it is no floor.
    #[test]
    fn the_largest_token_blocks_its_record_only() {
        let mut tokens = TokensSeen::default();
        let mut record = observed("a", "1", None).record;
        record.leader_transitions = 7;
        tokens.see(&record);
        record.leader_transitions = u64::MAX;
        tokens.see(&record);
        assert!(tokens.next(&record).is_err());
        assert_eq!(tokens.floor(), 8);
        record.leader_transitions = 3;
        assert_eq!(tokens.next(&record).ok(), Some(8));
    }

    /// A record deleted and written anew keeps the tokens up for a candidate that saw them,
    /// and only for one that did.
    #[tokio::test(start_paused = true)]
    async fn in_the_model_a_deleted_record_gives_no_token_again_to_who_saw_it() {
        let freed = [Step::Take(0), Step::Release(0, None)];
        let saw = [
            Step::Read(1),
            Step::Answer(1),
            Step::Delete,
            Step::Read(1),
            Step::Answer(1),
            Step::Take(1),
        ];
        let terms = model(&[&freed[..], &saw[..]].concat(), 2);
        assert_eq!(terms.len(), 2, "{terms:?}");
        assert_eq!((terms[1].token, terms[1].blind), (2, false));
        let did_not_see = [Step::Delete, Step::Take(1)];
        let terms = model(&[&freed[..], &did_not_see[..]].concat(), 2);
        assert_eq!((terms[1].token, terms[1].blind), (1, true));
    }

    /// S13 with a lost answer: the record an unanswered acquisition wrote is known as this
    /// process's, to the microsecond, and only while it is unrenewed and within a lease of
    /// the sending; another identity's, another instant's, a renewed one and a late one are
    /// not.
    #[tokio::test(start_paused = true)]
    async fn an_unanswered_acquisition_knows_only_the_record_it_wrote() {
        let sent = observed("a", "1", None).record;
        let mut slot = None;
        let answer: Result<(), LockError> = Err(LockError::unavailable("test", "reset"));
        assert!(Unanswered::note(&mut slot, &sent, answer).is_err());
        let unanswered = slot.expect("noted");
        assert!(unanswered.wrote(&sent, "a"));
        assert!(!unanswered.wrote(&sent, "b"));
        let mut other = sent.clone();
        other.acquire_time += chrono::Duration::microseconds(1);
        other.renew_time = other.acquire_time;
        assert!(!unanswered.wrote(&other, "a"));
        let mut renewed = sent.clone();
        renewed.renew_time += chrono::Duration::seconds(2);
        assert!(!unanswered.wrote(&renewed, "a"));
        tokio::time::advance(sent.lease_duration).await;
        assert!(!unanswered.wrote(&sent, "a"), "a lease after the sending");

        // A conflict is an answer: nothing is noted.
        let mut slot = None;
        let answer: Result<(), LockError> = Err(LockError::conflict("test"));
        assert!(Unanswered::note(&mut slot, &sent, answer).is_err());
        assert!(slot.is_none());
    }
}
