//! A view of a whole shard set, read from the store without taking part in it: the count, the
//! members, and each shard's owner, fencing token and since when.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::stream::{self, StreamExt};
use serde::Serialize;

use super::locks::LockSet;
use super::{
    MEMBER_PREFIX, ShardsError, drained, roster_key, shard_key, stored_count, weight_in, windows,
};
use crate::WallClock;
use crate::error::LockError;
use crate::record::Observed;

/// How many records a view asks the store's clock about at once (see [`RecordView::expires_in`]).
const CLOCK_READS_AT_ONCE: usize = 16;

/// Why a shard set cannot be viewed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardSetViewError {
    /// The roster could not be read (the store is down, refuses, or holds bytes that are no
    /// record): without it neither the count nor the members are known.
    #[error("shard set {name:?}: cannot read the roster record {roster:?}: {source}")]
    Roster {
        /// The set's name.
        name: String,
        /// The roster's key.
        roster: String,
        /// The store's answer.
        #[source]
        source: LockError,
    },
    /// The roster record holds no valid shard count: written by something else
    /// ([`ShardsError::InvalidRoster`]).
    #[error(transparent)]
    InvalidRoster(ShardsError),
}

/// Where a record of the set stands, as the reader sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub enum RecordState {
    /// Held, its lease running.
    Held,
    /// Names a holder whose lease ran out (by the store's clock where it keeps one, else by
    /// the reader's wall clock): the holder stopped renewing, and the record is anyone's to
    /// take.
    Expired,
    /// Released: nobody holds it.
    Free,
    /// No record: never taken, or deleted (a store that deletes a record whose lease ran out,
    /// as etcd does, shows an expired record so).
    Absent,
    /// The record could not be read; [`RecordView::error`] says why.
    Unreadable,
}

/// One record of a shard set (a shard's or a member's), as read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct RecordView {
    /// The record's key.
    pub key: String,
    /// Where it stands.
    pub state: RecordState,
    /// The identity the record names as holder: the owner while [`RecordState::Held`], the
    /// last owner while [`RecordState::Expired`].
    pub holder: Option<String>,
    /// The fencing token of the record's latest term (its `leader_transitions`), when read.
    pub fencing_token: Option<u64>,
    /// When the holder's term began (the holder's wall clock, for people).
    pub acquire_time: Option<DateTime<Utc>>,
    /// When the holder last renewed, as the record says (a store that renews leases itself,
    /// as Redis and etcd do, leaves it behind: see [`expires_in`](Self::expires_in)).
    pub renew_time: Option<DateTime<Utc>>,
    /// The holder's lease.
    #[serde(rename = "leaseDurationMillis", with = "opt_millis")]
    pub lease_duration: Option<Duration>,
    /// How long the lease has left by the store's own clock, where the store keeps one and
    /// the record's times alone would call the lease run out.
    #[serde(rename = "expiresInMillis", with = "opt_millis")]
    pub expires_in: Option<Duration>,
    /// A pending handover request: the identity asked to take the record next.
    pub handover_to: Option<String>,
    /// Why the record could not be read.
    pub error: Option<String>,
}

impl RecordView {
    /// The holder while the record is held, else `None`.
    pub fn owner(&self) -> Option<&str> {
        match self.state {
            RecordState::Held => self.holder.as_deref(),
            _ => None,
        }
    }

    /// The view of one answer for `key`, judged at `now` (the store's clock asked later).
    fn of(key: String, answer: Result<Option<Observed>, LockError>, now: DateTime<Utc>) -> Self {
        let mut view = Self {
            key,
            state: RecordState::Absent,
            holder: None,
            fencing_token: None,
            acquire_time: None,
            renew_time: None,
            lease_duration: None,
            expires_in: None,
            handover_to: None,
            error: None,
        };
        let observed = match answer {
            Ok(Some(observed)) => observed,
            Ok(None) => return view,
            Err(err) => {
                view.state = RecordState::Unreadable;
                view.error = Some(err.to_string());
                return view;
            }
        };
        let record = observed.record;
        view.fencing_token = Some(record.leader_transitions);
        view.lease_duration = Some(record.lease_duration);
        view.handover_to = record.handover_to().map(str::to_owned);
        if record.is_free() {
            view.state = RecordState::Free;
            return view;
        }
        let lease =
            chrono::Duration::from_std(record.lease_duration).unwrap_or(chrono::Duration::MAX);
        let ran_out = record
            .renew_time
            .checked_add_signed(lease)
            .is_some_and(|end| end < now);
        view.state = if ran_out {
            RecordState::Expired
        } else {
            RecordState::Held
        };
        view.holder = Some(record.holder_identity);
        view.acquire_time = Some(record.acquire_time);
        view.renew_time = Some(record.renew_time);
        view
    }
}

/// A shard of the set, as read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct ShardView {
    /// The shard's number, from 0 to the count less one.
    pub shard: u32,
    /// Its record: the owner ([`RecordView::owner`]), the fencing token and since when
    /// ([`RecordView::acquire_time`]).
    #[serde(flatten)]
    pub record: RecordView,
}

/// A member named by the set's roster, as read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct MemberView {
    /// The member's identity.
    pub identity: String,
    /// Whether it holds its member record: alive, as far as the record shows.
    pub alive: bool,
    /// The shards it owns.
    pub shards: Vec<u32>,
    /// Its weight, as its record says ([`ShardsBuilder::weight`](crate::ShardsBuilder::weight)).
    pub weight: u32,
    /// Whether the roster drains it ([`drain_member`](crate::drain_member)): it takes no shard.
    pub drained: bool,
    /// Its static membership window, when it runs with static membership
    /// ([`ShardsBuilder::static_membership_window`](crate::ShardsBuilder::static_membership_window)):
    /// gone without leaving (a crash), its shards are kept for it that long after its lease
    /// ran out.
    #[serde(rename = "staticMembershipWindowMillis", with = "opt_millis")]
    pub static_membership_window: Option<Duration>,
    /// Its member record: its last renewal ([`RecordView::renew_time`]) and since when it
    /// takes part ([`RecordView::acquire_time`]).
    #[serde(flatten)]
    pub record: RecordView,
}

/// A whole shard set as its records stand: the count, the members with their last renewals,
/// each shard's owner, fencing token and since when, and the shards nobody owns; what
/// `kafka-consumer-groups --describe` shows of a consumer group. It is read through the set's
/// locks without taking part: the reader writes nothing, and its [`LockSet`]'s identity
/// matters to no one.
///
/// Expiry is judged by the store's clock where it keeps one, else by the reader's wall clock,
/// for people to read: the members decide on their own monotonic clocks (S1), so a record
/// shown expired may still be renewed by a member whose clock runs behind. It serialises to
/// the JSON that `leader status --json` prints for a set.
///
/// ```
/// use std::sync::Arc;
/// use leader_core::backend::KeyedLocks;
/// use leader_core::{MemoryStore, ShardSetView};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let reader = KeyedLocks::new("status", "memory", move |key, identity| {
///     Arc::new(store.lock(key, identity))
/// });
/// // No member ever ran: no roster, no set.
/// assert!(ShardSetView::read(&reader, "tenants").await?.is_none());
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct ShardSetView {
    /// The set's name.
    pub name: String,
    /// The store ([`LockSet::describe`]).
    pub store: String,
    /// The shard count, as the roster holds it.
    pub count: u32,
    /// When the set was read (the reader's wall clock), the instant expiry is judged at.
    pub read_at: DateTime<Utc>,
    /// The members the roster names, by identity.
    pub members: Vec<MemberView>,
    /// Every shard, in order.
    pub shards: Vec<ShardView>,
    /// The shards nobody owns: absent, free, expired or unreadable.
    pub unowned: Vec<u32>,
}

impl ShardSetView {
    /// Reads shard set `name` through `set`: its roster in one request, then its members'
    /// records and every shard in one batch ([`LockSet::get_many`]), then, where the store
    /// keeps its own clock, asks it about the records whose times say their lease ran out.
    /// `Ok(None)` when the store holds no roster of that name (no member ever ran).
    ///
    /// A member's or a shard's record that cannot be read is shown so
    /// ([`RecordState::Unreadable`]), the rest of the view stands.
    ///
    /// # Errors
    /// The roster could not be read, or holds no valid count.
    pub async fn read(set: &dyn LockSet, name: &str) -> Result<Option<Self>, ShardSetViewError> {
        Self::read_with_clock(set, name, &WallClock::system()).await
    }

    /// As [`read`](Self::read), judging expiry by `clock` where the store keeps no clock.
    ///
    /// # Errors
    /// As [`read`](Self::read).
    pub async fn read_with_clock(
        set: &dyn LockSet,
        name: &str,
        clock: &WallClock,
    ) -> Result<Option<Self>, ShardSetViewError> {
        let roster_key = roster_key(name);
        let roster =
            set.lock(&roster_key)
                .get()
                .await
                .map_err(|source| ShardSetViewError::Roster {
                    name: name.to_owned(),
                    roster: roster_key.clone(),
                    source,
                })?;
        let Some(roster) = roster else {
            return Ok(None);
        };
        let count = stored_count(name, &roster.record).map_err(ShardSetViewError::InvalidRoster)?;
        // The members by identity; an entry whose key is not its identity's is still shown,
        // under the key the roster gives.
        let identities: Vec<(String, String)> = roster
            .record
            .extensions
            .iter()
            .filter_map(|(k, identity)| {
                let key = k.strip_prefix(MEMBER_PREFIX)?;
                Some((identity.clone(), key.to_owned()))
            })
            .collect();
        let mut keys: Vec<String> = identities.iter().map(|(_, key)| key.clone()).collect();
        keys.extend((0..count).map(|shard| shard_key(name, shard)));
        let mut answers = set.get_many(&keys).await;
        // A store that answers fewer than asked leaves the rest unread.
        answers.resize_with(keys.len(), || {
            Err(LockError::unavailable(
                "lock set",
                "the store answered fewer records than asked",
            ))
        });
        // Each member's weight, from its record, before the records become views.
        let weights: Vec<u32> = answers[..identities.len()]
            .iter()
            .map(|answer| {
                answer
                    .as_ref()
                    .ok()
                    .and_then(Option::as_ref)
                    .map_or(1, |o| weight_in(&o.record))
            })
            .collect();
        let drained = drained(&roster.record);
        let windows = windows(&roster.record);
        let now = clock.now();
        let mut records: Vec<RecordView> = keys
            .into_iter()
            .zip(answers)
            .map(|(key, answer)| RecordView::of(key, answer, now))
            .collect();
        ask_store_clocks(set, &mut records).await;
        let shard_records = records.split_off(identities.len());
        let shards: Vec<ShardView> = (0..count)
            .zip(shard_records)
            .map(|(shard, record)| ShardView { shard, record })
            .collect();
        let mut owned: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for shard in &shards {
            if let Some(owner) = shard.record.owner() {
                owned.entry(owner).or_default().push(shard.shard);
            }
        }
        let mut members: Vec<MemberView> = identities
            .into_iter()
            .zip(records)
            .zip(weights)
            .map(|(((identity, key), record), weight)| MemberView {
                static_membership_window: windows.get(key.as_str()).copied(),
                alive: record.owner() == Some(identity.as_str()),
                shards: owned.get(identity.as_str()).cloned().unwrap_or_default(),
                weight,
                drained: drained.contains(identity.as_str()),
                identity,
                record,
            })
            .collect();
        members.sort_by(|a, b| a.identity.cmp(&b.identity));
        let unowned = shards
            .iter()
            .filter(|s| s.record.owner().is_none())
            .map(|s| s.shard)
            .collect();
        Ok(Some(Self {
            name: name.to_owned(),
            store: set.describe(),
            count,
            read_at: now,
            members,
            shards,
            unowned,
        }))
    }

    /// The shard's view, if `shard` is below the count.
    pub fn shard(&self, shard: u32) -> Option<&ShardView> {
        self.shards.get(usize::try_from(shard).ok()?)
    }

    /// The member of `identity`, if the roster names it.
    pub fn member(&self, identity: &str) -> Option<&MemberView> {
        self.members.iter().find(|m| m.identity == identity)
    }
}

/// Where the store keeps its own clock (it renews leases itself, or decides expiry there), the
/// records whose times say the lease ran out are asked about: a lease the store still runs is
/// held, with the time it has left.
async fn ask_store_clocks(set: &dyn LockSet, records: &mut [RecordView]) {
    let expired: Vec<usize> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.state == RecordState::Expired)
        .map(|(i, _)| i)
        .collect();
    let answers: Vec<(usize, Result<Option<Duration>, LockError>)> = stream::iter(expired)
        .map(|i| {
            let lock = set.lock(&records[i].key);
            async move { (i, lock.time_left().await) }
        })
        .buffered(CLOCK_READS_AT_ONCE)
        .collect()
        .await;
    for (i, answer) in answers {
        // No clock (the default), or no answer: the record's times stand.
        if let Ok(Some(left)) = answer
            && !left.is_zero()
        {
            records[i].state = RecordState::Held;
            records[i].expires_in = Some(left);
        }
    }
}

mod opt_millis {
    use std::time::Duration;

    use serde::Serializer;

    pub(super) fn serialize<S: Serializer>(
        value: &Option<Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            None => s.serialize_none(),
        }
    }
}
