//! What a lock implementation needs and a service using the elector does not: the plumbing shared
//! by the backend crates (change notification, SQL columns of a record, batched shard-set
//! requests, key naming, back-off, the checks every lock URL and answer goes through).
//!
//! A service names [`ResourceLock`](crate::ResourceLock) and [`LockSet`](crate::LockSet) as
//! bounds and opens a backend's lock; it implements neither, and needs nothing from here.

use crate::{LockError, Observed, UrlError, Version};

pub use crate::backoff::{Backoff, Jitter};
pub use crate::hub::ChangeHub;
pub use crate::record::{RENEWAL_STEP, RecordColumns};
pub use crate::shards::{
    KeyedLocks, Known, Renewal, RenewedAndRead, Reread, common_prefix, member_key, roster_key,
    shard_key,
};

/// What a batched request makes of one failure: the same error for each record it covered.
pub trait LockErrorExt: Sized {
    /// The same failure again, of the same kind and saying the same (a driver's error becomes
    /// its message): what each record of a batch that failed as a whole reports
    /// ([`for_each`](Self::for_each)).
    #[must_use]
    fn duplicate(&self) -> Self;

    /// This error for each of `n` records: the results of a batch request that failed as a
    /// whole ([`LockSet::get_many`](crate::LockSet::get_many),
    /// [`LockSet::renew_many`](crate::LockSet::renew_many)), each of the same kind.
    fn for_each<T>(&self, n: usize) -> Vec<Result<T, Self>> {
        (0..n).map(|_| Err(self.duplicate())).collect()
    }
}

impl LockErrorExt for LockError {
    fn duplicate(&self) -> Self {
        self.duplicated()
    }
}

/// A [`LockError::Unmoved`] unless `stored` moved on from `sent`: what a lock whose store can
/// skip an identical write makes of the answer to an `operation` sent at version `sent`.
///
/// # Errors
/// The version did not move.
pub fn unless_moved(
    backend: &'static str,
    operation: &'static str,
    sent: &Version,
    stored: Observed,
) -> Result<Observed, LockError> {
    if stored.version == *sent {
        return Err(LockError::Unmoved {
            backend,
            operation,
            version: sent.as_str().to_owned(),
        });
    }
    Ok(stored)
}

/// Refuses `url` when an `@` follows the end of its authority (the first `/`, `?` or `#` after
/// `://`). A URL parser ends the user-info there, so such a URL holds one of those characters
/// unencoded in its password (read as the host, port, path or parameters, and shown as them),
/// or an `@` in its path or parameters, which cannot be told apart.
///
/// # Errors
/// Such a URL, with a message asking to percent-encode them.
pub fn check_user_info(url: &str) -> Result<(), UrlError> {
    UrlError::check_user_info(url)
}
