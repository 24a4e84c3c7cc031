//! Who leads, as one replica sees it: the view that `/leader` endpoints, leader-only request
//! layers and programs show (as JSON) or route by.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::leadership::LeaderState;
use crate::record::LeaderElectionRecord;

/// Who leads an election, as one replica sees it: whether this replica leads, the leader's
/// identity, its term's fencing token, and since when. Get it with
/// [`ElectorStatus::view`](crate::ElectorStatus::view); it serialises to the JSON that the
/// `leader` command's `/leader` endpoint answers:
///
/// ```json
/// {"name":"billing","identity":"billing-1","leading":false,"leader":"billing-0",
///  "fencingToken":7,"since":"2025-06-01T12:00:00.123Z","elapsedSeconds":42.5}
/// ```
///
/// The wall-clock times are for people, never for a decision (S1): `since` is the record's
/// acquire time as the leader wrote it (the same on every replica), and `elapsedSeconds` is how
/// long ago, by the leader's monotonic clock on the leader and by this replica's wall clock on
/// the others. A follower's view is the record as last observed: it names a leader that died
/// until the lease runs out and another takes over, as `leader status` does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct LeaderView {
    /// The election's name.
    pub name: String,
    /// This replica's identity.
    pub identity: String,
    /// True while this replica leads.
    pub leading: bool,
    /// The leader's identity (this replica's own while it leads); `None` while nobody leads,
    /// before the first observation and once the elector stopped.
    pub leader: Option<String>,
    /// The fencing token of the leader's term, when known.
    pub fencing_token: Option<u64>,
    /// When the leader's term began (wall clock, for people), when known.
    pub since: Option<DateTime<Utc>>,
    /// How long ago the leader's term began, when known.
    #[serde(rename = "elapsedSeconds", with = "seconds")]
    pub elapsed: Option<Duration>,
}

/// The leader's term as a replica last observed it in the record.
#[derive(Clone, Debug)]
pub(crate) struct ObservedTerm {
    pub(crate) holder: String,
    pub(crate) fencing_token: u64,
    pub(crate) acquire_time: DateTime<Utc>,
}

impl ObservedTerm {
    /// The term `record` holds, `None` for a free lease.
    pub(crate) fn of(record: &LeaderElectionRecord) -> Option<Self> {
        (!record.is_free()).then(|| Self {
            holder: record.holder_identity.clone(),
            fencing_token: record.leader_transitions,
            acquire_time: record.acquire_time,
        })
    }
}

impl LeaderView {
    /// The view of `state`, with what the record last said of the leader's term (`observed`).
    pub(crate) fn new(
        name: &str,
        identity: &str,
        state: &LeaderState,
        observed: Option<&ObservedTerm>,
    ) -> Self {
        let mut view = Self {
            name: name.to_owned(),
            identity: identity.to_owned(),
            leading: false,
            leader: None,
            fencing_token: None,
            since: None,
            elapsed: None,
        };
        if let Some(leadership) = state.leadership() {
            let token = leadership.fencing_token();
            let elapsed = leadership.acquired_at().elapsed();
            // The record's time when it is this term's, so that every replica shows one time.
            let since = observed
                .filter(|t| t.holder == leadership.identity() && t.fencing_token == token)
                .map_or_else(|| wall_clock_ago(elapsed), |t| t.acquire_time);
            view.leading = true;
            view.leader = Some(leadership.identity().to_owned());
            view.fencing_token = Some(token);
            view.since = Some(since);
            view.elapsed = Some(elapsed);
        } else if let LeaderState::Following {
            leader: Some(leader),
        } = state
        {
            view.leader = Some(leader.clone());
            if let Some(term) = observed.filter(|t| t.holder == *leader) {
                view.fencing_token = Some(term.fencing_token);
                view.since = Some(term.acquire_time);
                view.elapsed = Some(
                    (Utc::now() - term.acquire_time)
                        .to_std()
                        .unwrap_or_default(),
                );
            }
        }
        view
    }
}

fn wall_clock_ago(elapsed: Duration) -> DateTime<Utc> {
    let now = Utc::now();
    chrono::Duration::from_std(elapsed)
        .ok()
        .and_then(|ago| now.checked_sub_signed(ago))
        .unwrap_or(now)
}

/// An optional duration as fractional seconds.
mod seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(
        value: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(duration) => serializer.serialize_some(&duration.as_secs_f64()),
            None => serializer.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        let seconds = Option::<f64>::deserialize(deserializer)?;
        seconds
            .map(|s| Duration::try_from_secs_f64(s).map_err(serde::de::Error::custom))
            .transpose()
    }
}
