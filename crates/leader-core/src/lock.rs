//! The contract every lock backend implements.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_core::Stream;

use crate::error::LockError;
use crate::record::{LeaderElectionRecord, Observed, Version};

/// A stream that yields whenever the stored record may have changed (a release, a takeover, an
/// expiry, a deletion). It ends when the backend's subscription is lost; the elector subscribes
/// again on its next attempt.
pub type ChangeStream = Pin<Box<dyn Stream<Item = ()> + Send + 'static>>;

/// Something worth telling the backend's event facility about.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaderEvent {
    /// This candidate acquired the lease.
    BecameLeader {
        /// The fencing token of the acquisition.
        fencing_token: u64,
    },
    /// This candidate stopped leading (lost, released or shut down).
    StoppedLeading {
        /// The fencing token of the term that ended.
        fencing_token: u64,
    },
}

/// The outcome of [`ResourceLock::try_acquire`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquisition {
    /// The lease was free, expired or ours, and is now ours as stored.
    Acquired(Observed),
    /// A release handed the lease to this candidate, and it is ours as stored, on a lease the
    /// store last confirmed alive at `alive_since`, an instant before this attempt began (a
    /// lease the backend prepared and kept alive while the candidate waited), for at least the
    /// stored lease duration from then. Taking it needed no request: the elector counts the
    /// term from `alive_since` instead of from the attempt (S3), and renews first when too
    /// little of the term would be left.
    Handed {
        /// The stored record.
        observed: Observed,
        /// When the store last confirmed the lease alive (the sending of that request).
        alive_since: tokio::time::Instant,
    },
    /// Someone else holds an unexpired lease.
    Held {
        /// The stored record.
        observed: Observed,
        /// How long the holder's lease had left by the store's clock when the store answered,
        /// if the store tells: followers wake right when it runs out instead of counting a
        /// whole lease from when they noticed the holder's last renewal. `None`: unknown.
        expires_in: Option<Duration>,
        /// True when the store itself keeps the holder's lease alive, renewed by the holder
        /// without changing the record ([`ResourceLock::renew`]): the record stays the same
        /// for as long as the holder lives, so candidates wait for the store (its expiry, a
        /// release, a notification) and never take the lease over on their own clock. False
        /// for a record the store would never expire (written without a TTL by another
        /// client), which candidates take over on their own clock (S2, S8).
        renewed_in_store: bool,
    },
    /// The store assigns the lease itself and has not assigned it to this candidate: a
    /// coordinator elects the holder (Kubernetes' coordinated leader election), and candidates
    /// only take up a lease it gave them. The candidate waits for a notification or its next
    /// attempt and never takes the lease on its own clock. The stored record, if there is one.
    Unassigned(Option<Observed>),
}

impl Acquisition {
    /// The record as stored when the lease is now this candidate's (acquired or handed to it),
    /// `None` when someone else holds it.
    pub fn acquired(&self) -> Option<&Observed> {
        match self {
            Self::Acquired(observed) | Self::Handed { observed, .. } => Some(observed),
            Self::Held { .. } | Self::Unassigned(_) => None,
        }
    }
}

/// What a lock's one-request acquisition ([`ResourceLock::try_acquire`]) knows of the holder
/// besides its record: how a candidate that saw another holder's lease running asks it, since
/// the record may be gone (deleted under a live holder, by hand or by a bucket's rule) and the
/// holder leads on until its next renewal meets the deletion (S2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HolderCheck {
    /// The record alone (the default): the acquisition would take a record found gone at
    /// once. A candidate that saw another holder's lease running reads the record instead
    /// until that lease ends.
    Record,
    /// Also something the holder's process keeps while it runs and its end frees, which a
    /// record written anew does not need (the file lock's term `flock`): a dead holder's lease
    /// is taken at once. A candidate that saw another holder's lease running reads the record
    /// first, and sends the acquisition only when the record is there.
    Process,
    /// Something of the holder's that every acquisition must get too, and that a deletion of
    /// the record does not free (a session's advisory lock, MySQL's `GET_LOCK`): no lease is
    /// taken while the holder's session lives, record or not. Candidates send the acquisition
    /// at every attempt.
    Session,
    /// The store assigns leases itself (Kubernetes' coordinated leader election): the
    /// acquisition takes up only a lease given to this candidate, never a record found gone
    /// ([`Acquisition::Unassigned`]). Candidates send it at every attempt.
    Assigned,
}

/// A lock record in some shared store, with compare-and-swap: client-go's `resourcelock.Interface`.
///
/// The trait is object safe; the elector holds it as `Arc<dyn ResourceLock>`.
///
/// # Contract
///
/// * [`get`](Self::get) returns the stored record and its opaque [`Version`], or `None` when there is
///   no object.
/// * [`create`](Self::create) stores a new object and fails with [`LockError::Conflict`] when one
///   exists, whatever its content (also when it is not a valid record).
/// * [`update`](Self::update) replaces the record only if the stored version still equals `version`;
///   otherwise, or when the object is gone, it fails with [`LockError::Conflict`]. It never reads and
///   then writes blindly: the comparison and the write are one atomic step in the store.
/// * Every field of the record round-trips, [`extensions`](LeaderElectionRecord::extensions)
///   included (keys and values of any text, up to a few kilobytes in all).
/// * Every `update` that succeeds moves the version, also when the record is the one stored:
///   a store that skips a write of what it holds (kube-apiserver, Consul) answers with the
///   version it had, which the lock must refuse ([`LockError::Unmoved`]), since a follower's
///   compare-and-swap on that version would still succeed (S14). The elector never sends one:
///   a renewal's `renew_time` is always later than the stored one
///   ([`LeaderElectionRecord::renewal_time`]).
/// * `create` and `update` return the record as stored, with its new version. A backend may raise
///   `leader_transitions` when it writes (to keep fencing tokens growing when its objects can
///   vanish, for example on expiry) but never lowers it.
/// * [`renew`](Self::renew) extends the holder's lease. By default it is an [`update`](Self::update)
///   of the record with a newer `renew_time`. A backend whose store expires the lease by itself
///   (a TTL, an etcd lease) may instead only extend the lease in the store, in one request,
///   leaving the record, its `renew_time` and its version as stored; it must still fail with
///   [`LockError::Conflict`] once it has learned (from its own watch of the store, and at the
///   latest once the change stream it returned has reported the write) that the stored record
///   is no longer the one `version` names, so that a handover request or a takeover is noticed.
///   Nobody can take a lease the store keeps alive, so a write it has not heard of yet only
///   waits for a later renewal. Its [`try_acquire`](Self::try_acquire) then
///   reports `renewed_in_store` for a lease held that way: candidates wait for the store, since
///   the version no longer changes with renewals.
/// * A release (an update whose record has no holder) may instead hand the lease straight to a
///   candidate waiting in the store, when the backend keeps such a queue (the etcd lock does, to
///   the longest-waiting candidate, or to the one a handover request names, and to no other
///   while a request is pending): the stored record then names that candidate with the next
///   fencing token, and the returned record says so. That candidate's next
///   [`try_acquire`](Self::try_acquire) acquires it without writing.
/// * A write that names a holder other than this lock's identity (a handover request written on
///   the holder's behalf, see [`request_handover`](crate::request_handover)) keeps the holder's
///   lease as the store counts it: the same expiry, TTL or store lease.
/// * A value that cannot be decoded is [`LockError::InvalidRecord`]: it is reported, and the lock
///   never overwrites it on its own.
/// * Outages are [`LockError::Unavailable`] or [`LockError::Timeout`], missing rights
///   [`LockError::Forbidden`], missing storage [`LockError::Misconfigured`]. Errors never contain
///   credentials.
/// * Requests may be cancelled (dropped) at any await point without leaving the lock inconsistent.
///
/// The `conformance` module (feature `testing`) checks these rules against a real store.
#[async_trait]
pub trait ResourceLock: Send + Sync + fmt::Debug {
    /// Reads the current record, or `None` when no object exists.
    async fn get(&self) -> Result<Option<Observed>, LockError>;

    /// Creates the object holding `record`; [`LockError::Conflict`] if it exists.
    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError>;

    /// Replaces the record if the stored version equals `version`; [`LockError::Conflict`]
    /// otherwise.
    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError>;

    /// Extends the holder's lease: called only by the holder, with `record` as it last stored
    /// it (same holder, token and lease duration) and a newer `renew_time`. Returns the record
    /// and its version, which may be unchanged (see the contract above; a renewal in the store
    /// returns `record` as given, though the stored `renew_time` stays older);
    /// [`LockError::Conflict`] when the stored version is not `version`.
    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        self.update(version, record).await
    }

    /// Reports a leadership event in the backend's own event facility. Best effort: it never fails
    /// the election. The default writes a `tracing` event.
    async fn record_event(&self, event: &LeaderEvent) {
        tracing::info!(lock = %self.describe(), identity = self.identity(), ?event, "leader event");
    }

    /// The identity this lock writes as holder: unique per candidate, never empty.
    fn identity(&self) -> &str;

    /// A description of the lock for logs and errors, such as `file:/run/app.lock` or
    /// `postgres:public.leader_election/app`. It never contains credentials.
    fn describe(&self) -> String;

    /// The election's name as the caller gave it (`billing`, for `store.lock("billing", ..)`
    /// or `leader::open(url, "billing", ..)`), without the store, table, prefix or path
    /// [`describe`](Self::describe) adds: the name an elector built without
    /// [`name`](crate::LeaderElectorBuilder::name) reports in its status, its `/leader` view,
    /// its logs and its metric labels. `None` (the default) when the lock knows no such name;
    /// the elector then falls back to [`describe`](Self::describe).
    fn election_name(&self) -> Option<&str> {
        None
    }

    /// Subscribes to changes of the record, so that followers act on a release at once instead of
    /// on their next retry. `Ok(None)` (the default) means the backend has no notifications.
    /// A stream must fire when the record is released (freed or removed) and when a write sets
    /// a handover request ([`preferred_holder`](LeaderElectionRecord::preferred_holder)), which
    /// the leader acts on; it should not fire for renewals, since every follower makes a
    /// request for each item.
    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        Ok(None)
    }

    /// How long the holder's lease has left by the store's own clock, for people to read
    /// (`leader status`): a backend whose holder renews in the store leaves the record's
    /// `renew_time` behind, so this is where the lease stands. `Ok(None)` (the default) when
    /// the store keeps no such clock, or nobody holds the lease.
    async fn time_left(&self) -> Result<Option<Duration>, LockError> {
        Ok(None)
    }

    /// Checks that the store lets this lock hold a lease of `lease_duration` safely, where the
    /// store bounds it: a ZooKeeper session the ensemble would expire (deleting the holder's
    /// record) before the holder's renew deadline, say. The elector and shard sets call it
    /// before they run (and the `leader` command at start), so that such a lease is one error
    /// (and an exit code) instead of a lock that refuses every write. The default accepts every
    /// lease. A wrapper of a lock must forward it (as every other method).
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] naming the bound; an outage while finding it out.
    async fn check_lease(&self, lease_duration: Duration) -> Result<(), LockError> {
        let _ = lease_duration;
        Ok(())
    }

    /// Called once when the elector stops using this lock (after its release, if any): a
    /// backend lets go of what it keeps for the candidate, such as a lease granted in advance
    /// or a registration as a waiting candidate, so that nobody hands it the lease after it is
    /// gone. Best effort; the default does nothing.
    async fn close(&self) {}

    /// Called once when the elector shuts down while leading, before it releases: a backend
    /// withdraws a candidacy it announced elsewhere, so that whoever assigns the lease does not
    /// give it back to a candidate that is leaving. Best effort; the default does nothing.
    async fn withdraw(&self) {}

    /// A one-round-trip acquisition that decides expiry with the store's own clock (S1, S2).
    ///
    /// Stores `desired` in one atomic step if the object is absent, the lease is free, or it has
    /// expired by the store's clock (the store's time of the last write plus the stored lease
    /// duration has passed), unless the stored record names a handover to another candidate
    /// ([`LeaderElectionRecord::reserved_for_other_than`]): that one is left to the elector,
    /// which lets others take it only after standing back. Returns [`Acquisition::Held`] with
    /// the stored record when another holder's lease is still running or the lease is reserved
    /// for another candidate.
    ///
    /// An unexpired lease held by `desired.holder_identity` is [`Held`](Acquisition::Held) too
    /// (S13): a store cannot tell this process from another process given the same identity,
    /// and taking such a lease would give two leaders. Only a lease the store ties to this very
    /// lock object (its own session, say, which no other process can have) may be taken again.
    /// The elector takes a term it started itself again with [`update`](Self::update).
    /// Likewise [`Acquisition::Handed`] is only for a lease handed to this very lock object,
    /// never to its identity alone.
    ///
    /// The stored `leader_transitions` becomes one more than before (at least 1), and at least
    /// `desired.leader_transitions`: a floor the elector may ask for (see
    /// [`fencing_token_floor`](crate::LeaderElectorBuilder::fencing_token_floor)). The stored
    /// [`extensions`](LeaderElectionRecord::extensions) stay as they are (none for an object
    /// that was absent), whatever `desired` says: a candidate's copy may be stale.
    ///
    /// The default returns `Ok(None)`: the backend has no such path, and the elector reads the
    /// record and waits out the holder's lease on its own monotonic clock instead.
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let _ = desired;
        Ok(None)
    }

    /// What [`try_acquire`](Self::try_acquire) knows of the holder besides its record
    /// ([`HolderCheck`]), which decides whether candidates that saw a holder's lease running
    /// send it. The default, [`HolderCheck::Record`], is right for an acquisition that decides
    /// on the record alone.
    fn holder_check(&self) -> HolderCheck {
        HolderCheck::Record
    }
}

// Every method forwarded, the optional ones included (a lint keeps it so): one left out would
// fall back to the default and hide the lock's own.
macro_rules! forward_lock {
    ($ptr:ident) => {
        #[warn(clippy::missing_trait_methods)]
        #[async_trait]
        impl<L: ResourceLock + ?Sized> ResourceLock for $ptr<L> {
            async fn get(&self) -> Result<Option<Observed>, LockError> {
                (**self).get().await
            }
            async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
                (**self).create(record).await
            }
            async fn update(
                &self,
                version: &Version,
                record: &LeaderElectionRecord,
            ) -> Result<Observed, LockError> {
                (**self).update(version, record).await
            }
            async fn renew(
                &self,
                version: &Version,
                record: &LeaderElectionRecord,
            ) -> Result<Observed, LockError> {
                (**self).renew(version, record).await
            }
            async fn record_event(&self, event: &LeaderEvent) {
                (**self).record_event(event).await
            }
            fn identity(&self) -> &str {
                (**self).identity()
            }
            fn describe(&self) -> String {
                (**self).describe()
            }
            fn election_name(&self) -> Option<&str> {
                (**self).election_name()
            }
            async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
                (**self).watch().await
            }
            async fn time_left(&self) -> Result<Option<Duration>, LockError> {
                (**self).time_left().await
            }
            async fn check_lease(&self, lease_duration: Duration) -> Result<(), LockError> {
                (**self).check_lease(lease_duration).await
            }
            async fn close(&self) {
                (**self).close().await
            }
            async fn withdraw(&self) {
                (**self).withdraw().await
            }
            async fn try_acquire(
                &self,
                desired: &LeaderElectionRecord,
            ) -> Result<Option<Acquisition>, LockError> {
                (**self).try_acquire(desired).await
            }
            fn holder_check(&self) -> HolderCheck {
                (**self).holder_check()
            }
        }
    };
}

forward_lock!(Arc);
forward_lock!(Box);

/// `request` of `lock`, answered within `after` or failed as [`LockError::Timeout`] (S4).
pub(crate) async fn within<T>(
    lock: &dyn ResourceLock,
    operation: &'static str,
    after: std::time::Duration,
    request: impl std::future::Future<Output = Result<T, LockError>>,
) -> Result<T, LockError> {
    tokio::time::timeout(after, request)
        .await
        .unwrap_or_else(|_| {
            Err(LockError::Timeout {
                lock: lock.describe(),
                operation,
                after,
            })
        })
}
