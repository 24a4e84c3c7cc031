//! Changing a running set through its roster, by compare-and-swap, which every member follows
//! on its next read: the shard count ([`resize_shard_set`]) and the members drained
//! ([`drain_member`]).

use crate::WallClock;
use crate::error::LockError;

use super::{
    COUNT_EXTENSION, DRAIN_PREFIX, LockSet, MAX_SHARDS, ShardsError, member_key, roster_key,
    stored_count,
};
use crate::record::LeaderElectionRecord;

/// Why a set's roster could not be changed (a resize, a drain).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RosterError {
    /// The count asked for is out of range.
    #[error("a shard set holds 1 to {max} shards, not {count}")]
    InvalidCount {
        /// The count asked for.
        count: u32,
        /// The most a set may hold ([`MAX_SHARDS`]).
        max: u32,
    },
    /// The store holds no set of that name: no member ever ran (a new set takes the count its
    /// first member was started with).
    #[error("shard set {name:?}: the store holds no roster record {roster:?}: no member ever ran")]
    NoSuchSet {
        /// The set's name.
        name: String,
        /// The roster's key.
        roster: String,
    },
    /// The roster record holds no valid shard count: written by something else.
    #[error(transparent)]
    InvalidRoster(ShardsError),
    /// The roster kept changing under each attempt (members joining and leaving).
    #[error("shard set {name:?}: the roster record changed under each of {attempts} attempts")]
    Contended {
        /// The set's name.
        name: String,
        /// How many compare-and-swaps were tried.
        attempts: u32,
    },
    /// The store failed.
    #[error("shard set {name:?}: {source}")]
    Lock {
        /// The set's name.
        name: String,
        /// The store's answer.
        #[source]
        source: LockError,
    },
}

/// How many times a change of the roster tries its compare-and-swap before it gives up.
const ATTEMPTS: u32 = 10;

/// Changes the shard count of set `name` to `count` while its members run (`leader shards
/// resize`), and returns the count it had.
///
/// The count lives in the set's roster record; this writes it by compare-and-swap (again, on
/// a conflict with a member joining or leaving). Each member follows on its next read of the
/// roster, within a retry period: the shards added are taken as any free shard, and the shards
/// removed (numbers from `count` on) have their work stopped and are released
/// ([`StepDownReason::Resized`](crate::StepDownReason::Resized)), and nobody that has seen
/// the new count takes them; each member then tells its work the new count
/// ([`Shards::subscribe_count`](crate::Shards::subscribe_count)), whose keys it may split
/// otherwise. Safety never rests on the members agreeing at once: each shard
/// keeps its own lease, so a member that still follows the old count for a round may be slow
/// to let a removed shard go, never its second owner. The records of removed shards stay, so
/// that growing the set again goes on from their fencing tokens. A replica started afterwards
/// needs the new count (another is refused, [`ShardsError::CountMismatch`]).
///
/// # Errors
/// The count is out of range, the set does not exist or its roster is not a set's, the store
/// failed, or the roster changed under every attempt.
pub async fn resize_shard_set(
    set: &dyn LockSet,
    name: &str,
    count: u32,
) -> Result<u32, RosterError> {
    if count == 0 || count > MAX_SHARDS {
        return Err(RosterError::InvalidCount {
            count,
            max: MAX_SHARDS,
        });
    }
    let mut before = 0;
    update_roster(set, name, |record, stored| {
        before = stored;
        if stored == count {
            return false;
        }
        record
            .extensions
            .insert(COUNT_EXTENSION.into(), count.to_string());
        true
    })
    .await?;
    if before != count {
        tracing::info!(
            shards = name,
            from = before,
            to = count,
            "resized the shard set"
        );
    }
    Ok(before)
}

/// Drains member `identity` of set `name` (`leader shards drain`), or with `drain` false lets
/// it take shards again (`leader shards undrain`); returns whether it was drained before.
///
/// A drained member weighs 0 ([`ShardsBuilder::weight`](crate::ShardsBuilder::weight)): on
/// their next read every member computes the shares without it, and it hands each of its
/// shards to the member that should own it by planned handover (S10: the work stopped before
/// the release), then takes none, not even a shard left free for a lease. It stays a member,
/// renewing its record, so it can be drained before maintenance and undrained after without a
/// restart; the mark stays in the roster until undrained, across its restarts. An identity
/// that is not a member yet can be drained ahead of its start. A drain of every member is
/// ignored: the set is then shared as if none were drained.
///
/// # Errors
/// The set does not exist or its roster is not a set's, the store failed, or the roster
/// changed under every attempt.
pub async fn drain_member(
    set: &dyn LockSet,
    name: &str,
    identity: &str,
    drain: bool,
) -> Result<bool, RosterError> {
    let entry = format!("{DRAIN_PREFIX}{}", member_key(name, identity));
    let mut was = false;
    update_roster(set, name, |record, _| {
        was = record.extensions.contains_key(&entry);
        if was == drain {
            return false;
        }
        if drain {
            record.extensions.insert(entry.clone(), identity.to_owned());
        } else {
            record.extensions.remove(&entry);
        }
        true
    })
    .await?;
    if was != drain {
        let what = if drain { "drained" } else { "undrained" };
        tracing::info!(shards = name, member = identity, "{what} the member");
    }
    Ok(was)
}

/// Reads the roster of `name`, lets `change` edit it (given the stored count; it returns
/// whether it changed anything) and writes it back by compare-and-swap, again on a conflict.
async fn update_roster(
    set: &dyn LockSet,
    name: &str,
    mut change: impl FnMut(&mut LeaderElectionRecord, u32) -> bool,
) -> Result<(), RosterError> {
    let key = roster_key(name);
    let lock = set.lock(&key);
    let failed = |source| RosterError::Lock {
        name: name.to_owned(),
        source,
    };
    for _ in 0..ATTEMPTS {
        let Some(roster) = lock.get().await.map_err(failed)? else {
            return Err(RosterError::NoSuchSet {
                name: name.to_owned(),
                roster: key,
            });
        };
        let stored = stored_count(name, &roster.record).map_err(RosterError::InvalidRoster)?;
        let mut record = roster.record.clone();
        if !change(&mut record, stored) {
            return Ok(());
        }
        record.renew_time = WallClock::system().now().max(record.renew_time);
        match lock.update(&roster.version, &record).await {
            Ok(_) => return Ok(()),
            Err(err) if err.is_conflict() => {}
            Err(err) => return Err(failed(err)),
        }
    }
    Err(RosterError::Contended {
        name: name.to_owned(),
        attempts: ATTEMPTS,
    })
}
