//! Planned handover: asking the leader to hand its lease to a named candidate.

use crate::error::LockError;
use crate::lock::ResourceLock;
use crate::record::{LeaderElectionRecord, Observed};

/// How often [`request_handover`] reads and writes again when the leader's renewals keep
/// changing the record under it.
const TRIES: usize = 10;

/// Why a handover request could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandoverError {
    /// The identity to hand over to is empty.
    #[error("the identity to hand over to is empty")]
    EmptyIdentity,
    /// There is no election under this name yet: nobody has ever run for it.
    #[error("{lock}: no election to hand over (nobody has run for it yet)")]
    NoElection {
        /// The lock's description.
        lock: String,
    },
    /// The record changed under every attempt (a leader renewing very often, or other writers).
    #[error("{lock}: the record changed under each of {tries} attempts to write the request")]
    Contended {
        /// The lock's description.
        lock: String,
        /// How many read-and-write attempts were made.
        tries: usize,
    },
    /// The lock failed.
    #[error(transparent)]
    Lock(#[from] LockError),
}

/// Asks the election behind `lock` to hand leadership to the candidate `to`, without taking part
/// in it: writes `to` as the record's [`preferred_holder`](crate::LeaderElectionRecord::preferred_holder)
/// with a compare-and-swap (read again and retried when a renewal got there first).
///
/// The leader sees the request at its next renewal at the latest (at once where the backend
/// notifies), stops its work as on a release (waiting for it, up to its stop grace), and releases
/// the lease with the request kept. `to` takes it at once; every other candidate stands back for
/// one lease duration from when it saw the request, so `to` wins without a race, and after that
/// anyone may take it (a named candidate that is gone does not stall the election). The
/// acquisition clears the request. Fencing tokens keep growing, and the terms never overlap.
///
/// A request naming the current holder is left as it is (it already leads); a free lease is
/// reserved for `to` the same way. Returns the record as written.
///
/// # Errors
/// [`HandoverError::NoElection`] when nobody has run for the election yet; lock errors as the
/// lock reports them (an unreadable record is never overwritten).
pub async fn request_handover(
    lock: &dyn ResourceLock,
    to: &str,
) -> Result<Observed, HandoverError> {
    if to.is_empty() {
        return Err(HandoverError::EmptyIdentity);
    }
    edit_record::<HandoverError>(lock, TRIES, |current| {
        let current = current.ok_or_else(|| no_election(lock))?;
        if current.record.is_held_by(to) || current.record.handover_to() == Some(to) {
            return Ok(None);
        }
        let mut record = current.record.clone();
        record.preferred_holder = Some(to.to_owned());
        Ok(Some(record))
    })
    .await?
    .ok_or_else(|| contended(lock))
}

/// Withdraws a pending handover request from the election behind `lock`, with a
/// compare-and-swap (read again and retried when a renewal got there first): the leader, if it
/// has not acted on it yet, goes on leading; a free lease reserved for the named candidate is
/// free for all again. For a request that will never be acted on: one left for a holder that is
/// not this toolkit's (client-go, kubert), or naming a replica that is gone. Returns the record
/// as written, or as read when no request was pending.
///
/// # Errors
/// [`HandoverError::NoElection`] when nobody has run for the election yet; lock errors as the
/// lock reports them.
pub async fn withdraw_handover(lock: &dyn ResourceLock) -> Result<Observed, HandoverError> {
    edit_record::<HandoverError>(lock, TRIES, |current| {
        let current = current.ok_or_else(|| no_election(lock))?;
        if current.record.handover_to().is_none() {
            return Ok(None);
        }
        let mut record = current.record.clone();
        record.preferred_holder = None;
        Ok(Some(record))
    })
    .await?
    .ok_or_else(|| contended(lock))
}

fn no_election(lock: &dyn ResourceLock) -> HandoverError {
    HandoverError::NoElection {
        lock: lock.describe(),
    }
}

fn contended(lock: &dyn ResourceLock) -> HandoverError {
    HandoverError::Contended {
        lock: lock.describe(),
        tries: TRIES,
    }
}

/// A write into a record by someone who does not hold it (an operator's request): reads the
/// record and writes what `edit` makes of it with a compare-and-swap, read again and tried again,
/// up to `tries` times, when the record changed in between (a leader's renewal got there first).
/// `edit` gets the record as read (`None`: there is none, and what it answers is created) and
/// answers the record to write, `None` to write nothing, or its own error. Returns the record as written (or as read when nothing
/// was written), or `None` when the record changed under every try.
///
/// # Errors
/// `edit`'s errors, and the lock's.
pub async fn edit_record<E: From<LockError>>(
    lock: &dyn ResourceLock,
    tries: usize,
    mut edit: impl FnMut(Option<&Observed>) -> Result<Option<LeaderElectionRecord>, E>,
) -> Result<Option<Observed>, E> {
    for _ in 0..tries {
        let current = lock.get().await?;
        let Some(record) = edit(current.as_ref())? else {
            return Ok(current);
        };
        let Some(current) = current else {
            match lock.create(&record).await {
                Ok(written) => return Ok(Some(written)),
                Err(err) if err.is_conflict() => continue,
                Err(err) => return Err(err.into()),
            }
        };
        match lock.update(&current.version, &record).await {
            Ok(written) => return Ok(Some(written)),
            Err(err) if err.is_conflict() => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(None)
}
