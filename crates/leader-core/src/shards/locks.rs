//! The records of a shard set: one lock per key in one store, read and renewed in batches.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures_util::future::join_all;

use crate::error::LockError;
use crate::lock::ResourceLock;
use crate::record::{LeaderElectionRecord, Observed, Version};

/// The longest prefix every key of `keys` begins with (a shard set's keys share its name and a
/// dash), on a character boundary: what a backend reads the set under with one prefix read.
///
/// ```
/// let keys = ["jobs-members", "jobs-shard-0", "jobs-member-ab"].map(String::from);
/// assert_eq!(leader_core::backend::common_prefix(&keys), "jobs-");
/// assert_eq!(leader_core::backend::common_prefix(&["only".to_owned()]), "only");
/// assert_eq!(leader_core::backend::common_prefix(&[]), "");
/// ```
pub fn common_prefix(keys: &[String]) -> &str {
    let Some(first) = keys.first() else {
        return "";
    };
    let mut end = first.len();
    for key in &keys[1..] {
        end = first
            .bytes()
            .zip(key.bytes())
            .take(end)
            .take_while(|(a, b)| a == b)
            .count();
    }
    while !first.is_char_boundary(end) {
        end -= 1;
    }
    &first[..end]
}

/// One renewal in a batch: the holder's record as it last stored it, with a newer
/// `renew_time`, and the version it read.
#[derive(Clone, Debug)]
pub struct Renewal {
    /// The record's key in the set.
    pub key: String,
    /// The version the holder last stored.
    pub version: Version,
    /// The record to store.
    pub record: LeaderElectionRecord,
}

/// Many records of one store, each a [`ResourceLock`] of its own, for [`Shards`](super::Shards):
/// a shard set keeps a record per shard, one per member and a roster.
///
/// # Contract
///
/// * [`lock`](Self::lock) gives the lock on the record `key` for this set's candidate
///   [`identity`](Self::identity); the same key always names the same record, and each lock
///   keeps the [`ResourceLock`] contract on its own.
/// * [`get_many`](Self::get_many) and [`renew_many`](Self::renew_many) answer one result per
///   key, in order, each exactly as [`get`](ResourceLock::get) or
///   [`renew`](ResourceLock::renew) of that key's lock would. The defaults make one request
///   per key, at once; a backend that can read or write many records in one request (one SQL
///   statement, one Redis script, one etcd transaction) overrides them, so that a replica's
///   cost per retry period does not grow with the number of shards. A batch may fail as a
///   whole (every result the same error), never half-applied without saying which.
/// * [`renew_and_read`](Self::renew_and_read) answers as `renew_many` then `get_changed`
///   would, one after the other; a backend that can do both in one request overrides it, so
///   that a member's round (its renewals and its read of the set) is one request.
#[async_trait]
pub trait LockSet: Send + Sync + fmt::Debug {
    /// The lock on record `key`.
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock>;

    /// The identity this set's locks write as holder.
    fn identity(&self) -> &str;

    /// The store, for logs and errors; never with credentials.
    fn describe(&self) -> String;

    /// Reads the records of `keys`.
    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        join_all(keys.iter().map(|key| {
            let lock = self.lock(key);
            async move { lock.get().await }
        }))
        .await
    }

    /// Reads the records of `keys` for a reader that already holds `known[i]` of record `i`
    /// (one entry per key): a record still as the reader holds it (at that version, or still
    /// absent) may be answered [`Reread::Same`] instead of being sent and decoded again, so
    /// that a read of many records that mostly did not change costs the store and the reader
    /// little. Any other answer is [`get_many`](Self::get_many)'s. The default reads them all
    /// with `get_many`.
    async fn get_changed(
        &self,
        keys: &[String],
        known: &[Known<'_>],
    ) -> Vec<Result<Reread, LockError>> {
        debug_assert_eq!(keys.len(), known.len(), "one known state per key");
        self.get_many(keys)
            .await
            .into_iter()
            .map(|answer| answer.map(Reread::Now))
            .collect()
    }

    /// Whether a record whose lease ran out is gone from the next read of the set (the store
    /// deletes it, as etcd does with the keys on an expired etcd lease). Then the members never
    /// ask the store about each other's records once per lease, which they otherwise do where
    /// the store renews leases itself ([`Acquisition::Held`](crate::Acquisition::Held)'s
    /// `renewed_in_store`), since only the store knows whether such a lease ran out. The
    /// default is `false`.
    fn reads_show_expiry(&self) -> bool {
        false
    }

    /// Renews each record of `renewals` as its holder.
    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        join_all(renewals.iter().map(|renewal| {
            let lock = self.lock(&renewal.key);
            async move { lock.renew(&renewal.version, &renewal.record).await }
        }))
        .await
    }

    /// Renews `renewals`, then reads `keys` for a reader holding `known` (as
    /// [`get_changed`](Self::get_changed)): the answers of both, each in order. The read sees
    /// the renewals: a record renewed here is read as renewed. The default sends
    /// [`renew_many`](Self::renew_many), then `get_changed` once it answered; a backend
    /// overrides it where one request can do both (one SQL statement, one Redis script), or
    /// where it knows the records without asking (etcd, from its watch of the set).
    async fn renew_and_read(
        &self,
        renewals: &[Renewal],
        keys: &[String],
        known: &[Known<'_>],
    ) -> RenewedAndRead {
        let renewed = self.renew_many(renewals).await;
        let read = self.get_changed(keys, known).await;
        RenewedAndRead { renewed, read }
    }
}

/// The answers of [`LockSet::renew_and_read`].
#[derive(Debug)]
pub struct RenewedAndRead {
    /// One per renewal, as [`LockSet::renew_many`] answers.
    pub renewed: Vec<Result<Observed, LockError>>,
    /// One per key read, as [`LockSet::get_changed`] answers.
    pub read: Vec<Result<Reread, LockError>>,
}

/// What a reader holds of a record, for [`LockSet::get_changed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Known<'a> {
    /// Nothing: the record was never read.
    Nothing,
    /// The record was absent when last read.
    Absent,
    /// The record at this version.
    Version(&'a Version),
}

/// One answer of [`LockSet::get_changed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reread {
    /// The record is still as the reader holds it: at its version, or absent.
    Same,
    /// The record as it is now, or `None` when there is none.
    Now(Option<Observed>),
}

/// The locks of a set's keys, each made once and kept: a lock remembers what it saw of its
/// record (the highest token, a version), which a lock made again for the same key would not
/// know. Clones share the locks.
pub struct LockCache<L: ?Sized> {
    made: Arc<Mutex<HashMap<String, Arc<L>>>>,
}

impl<L: ?Sized> LockCache<L> {
    /// No lock made yet.
    #[must_use]
    pub fn new() -> Self {
        Self {
            made: Arc::default(),
        }
    }

    /// The lock of `key`: the one made before, or the one `make` makes now, kept from then on.
    /// `make` runs with the cache locked, so that a key's lock is made once: it must not use
    /// this cache (nor the set that holds it).
    pub fn get_or_make(&self, key: &str, make: impl FnOnce() -> Arc<L>) -> Arc<L> {
        let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(lock) = made.get(key) {
            return lock.clone();
        }
        let lock = make();
        made.insert(key.to_owned(), lock.clone());
        lock
    }
}

impl<L: ?Sized> Clone for LockCache<L> {
    fn clone(&self) -> Self {
        Self {
            made: self.made.clone(),
        }
    }
}

impl<L: ?Sized> Default for LockCache<L> {
    fn default() -> Self {
        Self::new()
    }
}

impl<L: ?Sized> fmt::Debug for LockCache<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let made = self.made.lock().unwrap_or_else(|p| p.into_inner()).len();
        f.debug_struct("LockCache").field("made", &made).finish()
    }
}

type MakeLock = dyn Fn(&str, &str) -> Arc<dyn ResourceLock> + Send + Sync;

/// A [`LockSet`] over any backend: a function that makes the lock of a key (once per key: the
/// set keeps it), with the default one request per key. Make the locks share the backend's
/// connection (its store, pool or client), since a set may hold thousands of them.
///
/// ```
/// use std::sync::Arc;
/// use leader_core::MemoryStore;
/// use leader_core::backend::KeyedLocks;
///
/// let store = MemoryStore::new();
/// let locks = KeyedLocks::new("replica-1", "memory", move |key, identity| {
///     Arc::new(store.lock(key, identity))
/// });
/// # let _ = locks;
/// ```
#[derive(Clone)]
pub struct KeyedLocks {
    identity: String,
    describe: String,
    make: Arc<MakeLock>,
    made: LockCache<dyn ResourceLock>,
}

impl KeyedLocks {
    /// Locks made by `make(key, identity)` for candidate `identity`, in the store `describe`
    /// names (for logs). `make` runs while the set's locks are locked (each key's lock is made
    /// once): it must not use this set.
    pub fn new(
        identity: impl Into<String>,
        describe: impl Into<String>,
        make: impl Fn(&str, &str) -> Arc<dyn ResourceLock> + Send + Sync + 'static,
    ) -> Self {
        Self {
            identity: identity.into(),
            describe: describe.into(),
            make: Arc::new(make),
            made: LockCache::new(),
        }
    }
}

impl fmt::Debug for KeyedLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedLocks")
            .field("identity", &self.identity)
            .field("store", &self.describe)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl LockSet for KeyedLocks {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.made
            .get_or_make(key, || (self.make)(key, &self.identity))
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

macro_rules! forward_set {
    ($ptr:ident) => {
        #[async_trait]
        impl<S: LockSet + ?Sized> LockSet for $ptr<S> {
            fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
                (**self).lock(key)
            }
            fn identity(&self) -> &str {
                (**self).identity()
            }
            fn describe(&self) -> String {
                (**self).describe()
            }
            async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
                (**self).get_many(keys).await
            }
            async fn get_changed(
                &self,
                keys: &[String],
                known: &[Known<'_>],
            ) -> Vec<Result<Reread, LockError>> {
                (**self).get_changed(keys, known).await
            }
            fn reads_show_expiry(&self) -> bool {
                (**self).reads_show_expiry()
            }
            async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
                (**self).renew_many(renewals).await
            }
            async fn renew_and_read(
                &self,
                renewals: &[Renewal],
                keys: &[String],
                known: &[Known<'_>],
            ) -> RenewedAndRead {
                (**self).renew_and_read(renewals, keys, known).await
            }
        }
    };
}

forward_set!(Arc);
forward_set!(Box);
