//! The leader election record and the versioned view of it that locks return.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};

use crate::error::LockError;

/// What a lock stores about the current leader, after client-go's `LeaderElectionRecord`.
///
/// Timestamps are wall-clock and informational: they are shown to people and never used for a
/// safety decision on another machine's clock. Expiry is decided with the monotonic clock of the
/// reader (or the store's own clock, see [`ResourceLock::try_acquire`](crate::ResourceLock::try_acquire)).
///
/// # Compatibility (S16)
///
/// Replicas of two adjacent releases share one election during a rolling upgrade, so each
/// reads what the other writes:
/// - Fields this release does not know are read into [`unknown_fields`](Self::unknown_fields),
///   never refused, and written back by every write within the term that wrote them
///   (renewals, releases, handover requests, [`extensions`](Self::extensions)). An
///   acquisition writes the acquiring release's own record. What a release keeps with the
///   election across terms goes in `extensions`, which every write keeps.
/// - What is not a record is still refused ([`LockError::InvalidRecord`], S8): a missing or
///   mistyped field of this release's, values out of range.
/// - The struct is `#[non_exhaustive]`: build one with [`new`](Self::new) and set its public
///   fields, so that a field added later breaks no lock implementation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct LeaderElectionRecord {
    /// Identity of the holder; empty when the lease is free (released).
    pub holder_identity: String,
    /// How long the holder's lease lasts after each renewal, as the holder configured it.
    /// Followers wait this long, not their own setting (kubernetes#47671).
    #[serde(rename = "leaseDurationMillis", with = "duration_millis")]
    pub lease_duration: Duration,
    /// When the current holder acquired the lease.
    pub acquire_time: DateTime<Utc>,
    /// When the current holder last renewed the lease.
    pub renew_time: DateTime<Utc>,
    /// How many times the lease has been acquired. It grows on every acquisition, also when the same
    /// identity acquires again, and is the fencing token of the acquisition that wrote it.
    pub leader_transitions: u64,
    /// client-go's coordinated leader election strategy, kept as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    /// A planned handover: the identity asked to lead next (client-go's `preferredHolder`).
    /// The leader stops its work and releases the lease; the named candidate takes it at once,
    /// and every other candidate stands back for one lease duration from when it saw the
    /// request, after which anyone may take it. An acquisition clears it. See
    /// [`request_handover`](crate::request_handover).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_holder: Option<String>,
    /// What features built on the election keep with it (a schedule's last firing, a shard
    /// set's size), by key. Only a holder writes them, with a compare-and-swap of the record,
    /// so a write is fenced by its term ([`Leadership::set_extension`](crate::Leadership::set_extension));
    /// every other write keeps them: renewals, releases, handover requests, and acquisitions,
    /// which keep what is stored whatever the candidate asked for (see
    /// [`ResourceLock`](crate::ResourceLock)'s contract).
    ///
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extensions: BTreeMap<String, String>,
    /// The fields of the stored record that this release does not know (written by a later
    /// one), as they were: kept by every write within their term (see "Compatibility").
    #[serde(flatten)]
    pub unknown_fields: BTreeMap<String, serde_json::Value>,
}

/// How much later than the stored `renew_time` a renewal writes at least: a step every store
/// keeps (they all keep at least milliseconds), so no renewal repeats the stored bytes.
pub const RENEWAL_STEP: TimeDelta = TimeDelta::milliseconds(1);

impl LeaderElectionRecord {
    /// A record held by `holder_identity` (empty: free) with fencing token
    /// `leader_transitions`, acquired and renewed at `now`, with no handover request,
    /// strategy, extensions or unknown fields: set the public fields for the rest.
    #[must_use]
    pub fn new(
        holder_identity: impl Into<String>,
        lease_duration: Duration,
        now: DateTime<Utc>,
        leader_transitions: u64,
    ) -> Self {
        Self {
            holder_identity: holder_identity.into(),
            lease_duration,
            acquire_time: now,
            renew_time: now,
            leader_transitions,
            ..Self::default()
        }
    }

    /// The `renew_time` a renewal of this record (as stored) writes when the wall clock reads
    /// `now`: `now`, but at least [`RENEWAL_STEP`] after both the stored `renew_time` and
    /// `acquire_time` (S14). A wall clock stepped back behind them would otherwise make every
    /// renewal write the bytes already stored, which kube-apiserver and Consul skip without
    /// moving the version: no renewal at all, while the holder believed it renewed. So after a
    /// step back, the record's `renew_time` holds where it was (one step more per renewal)
    /// until the holder's clock catches up; after a step forward it shows the holder's clock.
    #[must_use]
    pub fn renewal_time(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        now.max(self.renew_time.max(self.acquire_time) + RENEWAL_STEP)
    }

    /// True when no one holds the lease (it was released or never taken).
    pub fn is_free(&self) -> bool {
        self.holder_identity.is_empty()
    }

    /// True when `identity` holds the lease.
    pub fn is_held_by(&self, identity: &str) -> bool {
        !self.is_free() && self.holder_identity == identity
    }

    /// The candidate a pending handover names, if any: [`preferred_holder`](Self::preferred_holder)
    /// when set and not empty.
    pub fn handover_to(&self) -> Option<&str> {
        self.preferred_holder.as_deref().filter(|p| !p.is_empty())
    }

    /// True when a pending handover names a candidate other than `identity`: `identity` must not
    /// take the lease by the store's clock, and stands back for one lease duration from when
    /// it saw the request (the elector's rule).
    pub fn reserved_for_other_than(&self, identity: &str) -> bool {
        self.handover_to().is_some_and(|to| to != identity)
    }

    /// Encodes the record as the JSON that the file, Redis and etcd locks store.
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising plain strings, integers and timestamps cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes a record stored by [`to_json`](Self::to_json).
    ///
    /// JSON with missing, mistyped or out-of-range fields is [`LockError::InvalidRecord`]: a
    /// record that cannot be read is never overwritten (S8). Fields this release does not know
    /// are kept in [`unknown_fields`](Self::unknown_fields) (S16). Odd values that decode are read as they are
    /// (S8): a zero lease duration is a lease that has run out, and the times, which are only
    /// informational, may be in any order.
    ///
    /// `context` (the server and key, say) leads the error's reason, so that the message names
    /// the backend and what is invalid once.
    pub fn from_json(
        backend: &'static str,
        context: impl std::fmt::Display,
        bytes: &[u8],
    ) -> Result<Self, LockError> {
        serde_json::from_slice(bytes).map_err(|err| {
            LockError::invalid_record(
                backend,
                format!("{context}: not a leader election record: {err}"),
            )
        })
    }
}

/// An opaque version of a stored record, compared for equality in compare-and-swap.
///
/// Each backend picks its own form: a counter, a row version, a `resourceVersion`, a mod revision.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Version(String);

impl Version {
    /// Wraps a backend's version string.
    pub fn new(version: impl Into<String>) -> Self {
        Self(version.into())
    }

    /// The backend's version string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<u64> for Version {
    fn from(version: u64) -> Self {
        Self(version.to_string())
    }
}

impl From<i64> for Version {
    fn from(version: i64) -> Self {
        Self(version.to_string())
    }
}

impl fmt::Debug for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Version({})", self.0)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A record as a lock stored it, with the version to use for the next compare-and-swap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// The stored record.
    pub record: LeaderElectionRecord,
    /// The version of the stored record.
    pub version: Version,
}

/// A record as the columns of a SQL lock table hold it: signed 64-bit integers for the lease
/// (milliseconds) and the transitions, the extensions as JSON text (`None` when there are none).
/// The codec every SQL backend shares, both ways, with the checks the column types cannot make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordColumns {
    /// `holder_identity`: empty when free.
    pub holder: String,
    /// `lease_duration_ms`.
    pub lease_ms: i64,
    /// `acquire_time`.
    pub acquire: DateTime<Utc>,
    /// `renew_time`.
    pub renew: DateTime<Utc>,
    /// `leader_transitions`.
    pub transitions: i64,
    /// `strategy`.
    pub strategy: Option<String>,
    /// `preferred_holder`.
    pub preferred: Option<String>,
    /// `extensions`: a JSON object of strings, `None` when there are none.
    pub extensions: Option<String>,
}

impl RecordColumns {
    /// The columns of `record`.
    ///
    /// # Errors
    /// [`LockError::InvalidRecord`] when the lease or the transitions do not fit a signed
    /// 64-bit column.
    pub fn new(record: &LeaderElectionRecord, backend: &'static str) -> Result<Self, LockError> {
        let out_of_range = |what: &str| {
            LockError::invalid_record(backend, format!("{what} is too large to store"))
        };
        Ok(Self {
            holder: record.holder_identity.clone(),
            lease_ms: i64::try_from(record.lease_duration.as_millis())
                .map_err(|_| out_of_range("lease duration"))?,
            acquire: record.acquire_time,
            renew: record.renew_time,
            transitions: i64::try_from(record.leader_transitions)
                .map_err(|_| out_of_range("leader transitions"))?,
            strategy: record.strategy.clone(),
            preferred: record.preferred_holder.clone(),
            extensions: (!record.extensions.is_empty())
                .then(|| serde_json::to_string(&record.extensions).unwrap_or_default()),
        })
    }

    /// The record these columns hold.
    ///
    /// # Errors
    /// [`LockError::InvalidRecord`], naming `context` (the table and election), for a negative
    /// lease or transitions count, or extensions that are not a JSON object of strings.
    /// `context` is formatted only for an error: a reader of many rows may pass
    /// [`format_args!`] at no cost.
    pub fn into_record(
        self,
        backend: &'static str,
        context: impl fmt::Display,
    ) -> Result<LeaderElectionRecord, LockError> {
        let bad =
            |reason: String| LockError::invalid_record(backend, format!("{context}: {reason}"));
        Ok(LeaderElectionRecord {
            holder_identity: self.holder,
            lease_duration: Duration::from_millis(
                u64::try_from(self.lease_ms)
                    .map_err(|_| bad(format!("negative lease duration {} ms", self.lease_ms)))?,
            ),
            acquire_time: self.acquire,
            renew_time: self.renew,
            leader_transitions: u64::try_from(self.transitions)
                .map_err(|_| bad(format!("negative leader transitions {}", self.transitions)))?,
            strategy: self.strategy,
            preferred_holder: self.preferred,
            extensions: match self.extensions {
                Some(json) => serde_json::from_str(&json).map_err(|err| {
                    bad(format!(
                        "column extensions: not a JSON object of strings: {err}"
                    ))
                })?,
                None => BTreeMap::new(),
            },
            // A later release's field is a column this release neither reads nor writes.
            unknown_fields: BTreeMap::new(),
        })
    }
}

mod duration_millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(value: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(value.as_millis()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> LeaderElectionRecord {
        let now = Utc::now();
        LeaderElectionRecord {
            holder_identity: "a".into(),
            lease_duration: Duration::from_millis(15_500),
            acquire_time: now,
            renew_time: now,
            leader_transitions: 3,
            strategy: None,
            preferred_holder: Some("b".into()),
            extensions: BTreeMap::from([("cron/nightly".into(), "{\"at\":1}".into())]),
            unknown_fields: BTreeMap::new(),
        }
    }

    /// S16: a record a later release wrote, with fields this one does not know, is read, and
    /// written back with them; a field this release knows, mistyped, is still refused.
    #[test]
    fn fields_of_a_later_release_are_kept() {
        let later = br#"{"holderIdentity":"a","leaseDurationMillis":5000,"acquireTime":"2024-01-01T00:00:00Z","renewTime":"2024-01-01T00:00:01Z","leaderTransitions":3,"holderRelease":"0.2.0","lease":{"kind":"session","id":7}}"#;
        let record = LeaderElectionRecord::from_json("test", "key", later).expect("readable");
        assert_eq!(record.holder_identity, "a");
        assert_eq!(record.unknown_fields.len(), 2, "{record:?}");
        let mut renewed = record.clone();
        renewed.renew_time = renewed.renewal_time(Utc::now());
        let written: serde_json::Value = serde_json::from_slice(&renewed.to_json()).expect("JSON");
        assert_eq!(written["holderRelease"], "0.2.0");
        assert_eq!(written["lease"]["id"], 7);
        assert_eq!(
            LeaderElectionRecord::from_json("test", "key", &renewed.to_json()).ok(),
            Some(renewed)
        );
        let mistyped = br#"{"holderIdentity":"a","leaseDurationMillis":"5s","acquireTime":"2024-01-01T00:00:00Z","renewTime":"2024-01-01T00:00:01Z","leaderTransitions":3,"holderRelease":"0.2.0"}"#;
        assert!(LeaderElectionRecord::from_json("test", "key", mistyped).is_err());
    }

    #[test]
    fn json_round_trip_keeps_every_field() {
        let r = record();
        assert_eq!(
            LeaderElectionRecord::from_json("test", "key", &r.to_json()).ok(),
            Some(r)
        );
    }

    #[test]
    fn garbage_is_an_invalid_record_error() {
        for bad in [
            &b"not json"[..],
            b"{}",
            b"[1,2]",
            br#"{"holderIdentity":"a","leaseDurationMillis":-1,"acquireTime":"2024-01-01T00:00:00Z","renewTime":"2024-01-01T00:00:00Z","leaderTransitions":0}"#,
            br#"{"holderIdentity":"a","leaseDurationMillis":5,"acquireTime":"yesterday","renewTime":"2024-01-01T00:00:00Z","leaderTransitions":0}"#,
            br#"{"holderIdentity":"a","leaseDurationMillis":5,"acquireTime":"2024-01-01T00:00:00Z","renewTime":"2024-01-01T00:00:00Z","leaderTransitions":-2}"#,
        ] {
            let err =
                LeaderElectionRecord::from_json("test", "key", bad).expect_err("must reject");
            assert!(matches!(err, LockError::InvalidRecord { .. }), "{err}");
            let message = err.to_string();
            assert!(message.starts_with("test: invalid lock record: key: "), "{message}");
            assert_eq!(message.matches("invalid lock record").count(), 1, "{message}");
        }
    }

    /// S8: values another client may write (a holder whose clock stepped back, a zero
    /// duration) are read as they are, so the election goes on after the lease.
    #[test]
    fn odd_values_that_decode_are_read_as_written() {
        for odd in [
            br#"{"holderIdentity":"a","leaseDurationMillis":0,"acquireTime":"2024-01-01T00:00:00Z","renewTime":"2024-01-01T00:00:00Z","leaderTransitions":0}"#,
            br#"{"holderIdentity":"a","leaseDurationMillis":5,"acquireTime":"2024-01-02T00:00:00Z","renewTime":"2024-01-01T00:00:00Z","leaderTransitions":0}"#,
        ] {
            let record = LeaderElectionRecord::from_json("test", "key", odd).expect("decodes");
            assert_eq!(record.holder_identity, "a");
        }
    }
}
