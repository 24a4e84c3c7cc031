//! The record writes a test makes by hand on a lock, as a candidate makes them: taking the
//! lock in its first term, renewing and releasing it.

use leader_core::{LeaderElectionRecord, Observed, ResourceLock, conformance};

/// `lock` taken by a create of its own record (its identity, token 1).
///
/// # Panics
/// The create failed.
pub async fn created<L: ResourceLock + ?Sized>(lock: &L) -> Observed {
    lock.create(&conformance::record(lock.identity(), 1))
        .await
        .expect("create")
}

/// `held`, the record `lock` holds, released: written again with no holder.
///
/// # Panics
/// The update failed.
pub async fn released<L: ResourceLock + ?Sized>(lock: &L, held: &Observed) -> Observed {
    let mut released = held.record.clone();
    released.holder_identity.clear();
    lock.update(&held.version, &released)
        .await
        .expect("release")
}

/// The record a renewal of `held` writes now: the same term, renewed at the current time.
pub fn renewal(held: &LeaderElectionRecord) -> LeaderElectionRecord {
    let mut record = held.clone();
    record.renew_time = held.renewal_time(chrono::Utc::now());
    record
}
