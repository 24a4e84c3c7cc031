//! The lease rules that the elector and a shard set's member both keep, written once: what a
//! candidate saw of a record and since when, on its own monotonic clock (S1, S2), and the
//! stand-back from a handover request that names another candidate (S10).

use tokio::time::Instant;

use crate::error::LockError;
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
/// then, never from when it first saw the version: it may have seen it a term ago.
#[derive(Clone, Debug)]
pub(crate) struct Sighting {
    version: Version,
    /// When the lease's clock started: the version first seen, or the store seen to stop
    /// keeping it.
    since: Instant,
    /// Whether the store said, last it was asked, that it keeps this version's lease alive.
    kept_by_store: bool,
    /// The pending handover request this candidate saw, if any.
    handover: Option<Request>,
}

/// The fencing token of the acquisition that takes over `record` (S5): one more than its
/// token. A token that cannot grow any more is an error, never a token given out again.
///
/// # Errors
/// [`LockError::InvalidRecord`] for a record whose token is `u64::MAX`.
pub(crate) fn next_token(record: &LeaderElectionRecord) -> Result<u64, LockError> {
    record.leader_transitions.checked_add(1).ok_or_else(|| {
        LockError::invalid_record(
            "lock",
            "the record's fencing token is the largest there is: no token above it can be \
             given out (was it written by hand?)",
        )
    })
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

/// A pending handover request as a candidate saw it: whom it names, when the candidate first
/// saw it, and until when it stands back: a lease from then, the longest lease that any record
/// carrying the request has shown since (a release that keeps the request writes a short
/// lease, which must not cut the stand-back short).
#[derive(Clone, Debug)]
struct Request {
    to: String,
    since: Instant,
    until: Instant,
}

impl Request {
    fn new(to: &str, now: Instant, record: &LeaderElectionRecord) -> Self {
        Self {
            to: to.to_owned(),
            since: now,
            until: now + record.lease_duration,
        }
    }
}

/// What a new sighting changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Changes {
    /// The version is new: the lease's clock started again.
    pub(crate) version: bool,
    /// A handover request (to another candidate than before) was seen for the first time.
    pub(crate) handover: bool,
}

impl Sighting {
    /// The first sighting of `observed`, at `now`.
    pub(crate) fn new(observed: &Observed, now: Instant) -> Self {
        Self {
            version: observed.version.clone(),
            since: now,
            kept_by_store: false,
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
        if self.version != observed.version {
            self.version.clone_from(&observed.version);
            self.since = now;
            self.kept_by_store = false;
            changes.version = true;
        }
        match (observed.record.handover_to(), &mut self.handover) {
            (Some(to), Some(seen)) if seen.to == to => {
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

    /// When the lease of `record` (the version last seen) runs out on this candidate's clock.
    pub(crate) fn lease_ends(&self, record: &LeaderElectionRecord) -> Instant {
        self.since + record.lease_duration
    }

    /// True when `observed` is the version last seen and has stayed so for its lease (S2).
    pub(crate) fn expired(&self, observed: &Observed, now: Instant) -> bool {
        self.version == observed.version && now >= self.lease_ends(&observed.record)
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
        (record.handover_to() == Some(seen.to.as_str()))
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

    use super::*;

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
}
