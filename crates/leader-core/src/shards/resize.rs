//! Changing a running set's shard count: the roster's count, written by compare-and-swap,
//! which every member follows on its next read.

use crate::WallClock;
use crate::error::LockError;

use super::{COUNT_EXTENSION, LockSet, MAX_SHARDS, ShardsError, roster_key};

/// Why a set could not be resized.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResizeError {
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

/// How many times [`resize_shard_set`] tries its compare-and-swap before it gives up.
const ATTEMPTS: u32 = 10;

/// Changes the shard count of set `name` to `count` while its members run (`leader shards
/// resize`), and returns the count it had.
///
/// The count lives in the set's roster record; this writes it by compare-and-swap (again, on
/// a conflict with a member joining or leaving). Each member follows on its next read of the
/// roster, within a retry period: the shards added are taken as any free shard, and the shards
/// removed (numbers from `count` on) have their work stopped and are released
/// ([`StepDownReason::Resized`](crate::StepDownReason::Resized)), and nobody that has seen
/// the new count takes them. Safety never rests on the members agreeing at once: each shard
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
) -> Result<u32, ResizeError> {
    if count == 0 || count > MAX_SHARDS {
        return Err(ResizeError::InvalidCount {
            count,
            max: MAX_SHARDS,
        });
    }
    let key = roster_key(name);
    let lock = set.lock(&key);
    let failed = |source| ResizeError::Lock {
        name: name.to_owned(),
        source,
    };
    for _ in 0..ATTEMPTS {
        let Some(roster) = lock.get().await.map_err(failed)? else {
            return Err(ResizeError::NoSuchSet {
                name: name.to_owned(),
                roster: key,
            });
        };
        let value = roster.record.extensions.get(COUNT_EXTENSION);
        let Some(stored) = value.and_then(|v| v.parse::<u32>().ok()).filter(|&c| c > 0) else {
            return Err(ResizeError::InvalidRoster(ShardsError::InvalidRoster {
                name: name.to_owned(),
                roster: key,
                value: value.cloned(),
            }));
        };
        if stored == count {
            return Ok(stored);
        }
        let mut record = roster.record.clone();
        record
            .extensions
            .insert(COUNT_EXTENSION.into(), count.to_string());
        record.renew_time = WallClock::system().now().max(record.renew_time);
        match lock.update(&roster.version, &record).await {
            Ok(_) => {
                tracing::info!(
                    shards = name,
                    from = stored,
                    to = count,
                    "resized the shard set"
                );
                return Ok(stored);
            }
            Err(err) if err.is_conflict() => {}
            Err(err) => return Err(failed(err)),
        }
    }
    Err(ResizeError::Contended {
        name: name.to_owned(),
        attempts: ATTEMPTS,
    })
}
