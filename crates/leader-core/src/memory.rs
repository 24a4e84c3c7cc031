//! An in-memory lock for tests and for electing among tasks of one process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::LockError;
use crate::lock::{Acquisition, ChangeStream, ResourceLock};
use crate::record::{LeaderElectionRecord, Observed, Version};

const BACKEND: &str = "memory";

/// Shared storage for [`MemoryLock`]s: locks made from one store with the same name contend for
/// the same record.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Objects>>,
}

#[derive(Debug, Default)]
struct Objects {
    /// Answer a write of what is stored with the version it had, writing nothing.
    skip_identical: bool,
    next_version: u64,
    objects: HashMap<String, Object>,
    changes: HashMap<String, watch::Sender<u64>>,
}

#[derive(Debug)]
struct Object {
    value: Value,
    version: u64,
    /// The store's own clock at the last write, for [`ResourceLock::try_acquire`].
    written_at: Instant,
}

#[derive(Debug, PartialEq)]
enum Value {
    Record(LeaderElectionRecord),
    Garbage(String),
}

impl Objects {
    /// Writes `value`; `keep_expiry` keeps the store's time of the last write (a write on the
    /// holder's behalf does not renew its lease).
    fn write(&mut self, name: &str, value: Value, keep_expiry: bool) -> Version {
        if let Some(stored) = self
            .objects
            .get(name)
            .filter(|o| self.skip_identical && o.value == value)
        {
            return Version::from(stored.version);
        }
        self.next_version += 1;
        let version = self.next_version;
        // Followers act on a release or a handover request (or on bad data, which their next
        // read reports), not on a renewal.
        let notify = match &value {
            Value::Record(record) => record.is_free() || record.handover_to().is_some(),
            Value::Garbage(_) => true,
        };
        let written_at = self
            .objects
            .get(name)
            .filter(|_| keep_expiry)
            .map_or_else(Instant::now, |o| o.written_at);
        self.objects.insert(
            name.to_owned(),
            Object {
                value,
                version,
                written_at,
            },
        );
        if notify {
            self.notify(name);
        }
        Version::from(version)
    }

    fn notify(&mut self, name: &str) {
        if let Some(tx) = self.changes.get(name) {
            tx.send_modify(|n| *n += 1);
        }
    }

    fn read(&self, name: &str) -> Result<Option<(&LeaderElectionRecord, &Object)>, LockError> {
        match self.objects.get(name) {
            None => Ok(None),
            Some(object) => match &object.value {
                Value::Record(record) => Ok(Some((record, object))),
                Value::Garbage(raw) => Err(LockError::invalid_record(
                    BACKEND,
                    format!("stored value {raw:?} is not a record"),
                )),
            },
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that skips a write of what it holds, answering it with the version it
    /// had, as kube-apiserver (`GuaranteedUpdate`) and Consul (`kvsSetTxn`) do; its locks
    /// refuse such an answer ([`LockError::Unmoved`]).
    pub fn skipping_identical_writes() -> Self {
        let store = Self::new();
        store.objects().skip_identical = true;
        store
    }

    /// A lock on election `name` in this store for candidate `identity`.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> MemoryLock {
        MemoryLock {
            store: self.clone(),
            name: name.into(),
            identity: identity.into(),
            store_clock: false,
            renew_in_store: false,
            notifications: true,
        }
    }

    /// Stores a value that is not a record under `name`, as a broken writer would.
    pub fn corrupt(&self, name: &str, raw: impl Into<String>) {
        self.objects()
            .write(name, Value::Garbage(raw.into()), false);
    }

    /// Deletes the object `name`, as an operator (or an expiry) would.
    pub fn delete(&self, name: &str) {
        let mut objects = self.objects();
        if objects.objects.remove(name).is_some() {
            objects.notify(name);
        }
    }

    fn objects(&self) -> MutexGuard<'_, Objects> {
        // No code path panics while holding the guard, but stay usable if a caller's did.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A [`ResourceLock`] kept in process memory, for tests and for electing one of several tasks.
///
/// ```
/// use leader_core::MemoryStore;
///
/// let store = MemoryStore::new();
/// let a = store.lock("jobs", "a");
/// let b = store.lock("jobs", "b"); // contends with `a`
/// # let _ = (a, b);
/// ```
#[derive(Clone, Debug)]
pub struct MemoryLock {
    store: MemoryStore,
    name: String,
    identity: String,
    store_clock: bool,
    renew_in_store: bool,
    notifications: bool,
}

impl MemoryLock {
    /// A lock on election `name` in a new store of its own.
    pub fn new(name: impl Into<String>, identity: impl Into<String>) -> Self {
        MemoryStore::new().lock(name, identity)
    }

    /// Makes [`try_acquire`](ResourceLock::try_acquire) decide expiry on the store's clock (the
    /// tokio clock at the last write), as server-side backends do. Off by default.
    #[must_use]
    pub fn with_store_clock(mut self, enabled: bool) -> Self {
        self.store_clock = enabled;
        self
    }

    /// Makes [`renew`](ResourceLock::renew) only extend the lease in the store (the store's time
    /// of the last write moves on; the record and its version stay), as backends with a TTL the
    /// holder extends do; [`try_acquire`](ResourceLock::try_acquire) then reports a held lease
    /// as `renewed_in_store`. Needs the store clock. Off by default.
    #[must_use]
    pub fn with_renewal_in_store(mut self, enabled: bool) -> Self {
        self.renew_in_store = enabled;
        self.store_clock |= enabled;
        self
    }

    /// Turns change notifications ([`watch`](ResourceLock::watch)) off or on, to test a
    /// backend without them. On by default.
    #[must_use]
    pub fn with_watch(mut self, enabled: bool) -> Self {
        self.notifications = enabled;
        self
    }

    /// The store this lock lives in.
    pub fn store(&self) -> &MemoryStore {
        &self.store
    }
}

#[async_trait]
impl ResourceLock for MemoryLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let objects = self.store.objects();
        Ok(objects.read(&self.name)?.map(|(record, object)| Observed {
            record: record.clone(),
            version: Version::from(object.version),
        }))
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let mut objects = self.store.objects();
        if objects.objects.contains_key(&self.name) {
            return Err(LockError::conflict(BACKEND));
        }
        let version = objects.write(&self.name, Value::Record(record.clone()), false);
        Ok(Observed {
            record: record.clone(),
            version,
        })
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let mut objects = self.store.objects();
        // An unreadable record is never overwritten, whatever version the caller names.
        match objects.read(&self.name)? {
            Some((_, object)) if Version::from(object.version) == *version => {}
            _ => return Err(LockError::conflict(BACKEND)),
        }
        // A write naming another holder (a handover request on its behalf) keeps its expiry.
        let foreign = !record.is_free() && record.holder_identity != self.identity;
        let written = objects.write(&self.name, Value::Record(record.clone()), foreign);
        let written = Observed {
            record: record.clone(),
            version: written,
        };
        crate::backend::unless_moved(BACKEND, "update", version, written)
    }

    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        if !self.renew_in_store {
            return self.update(version, record).await;
        }
        let mut objects = self.store.objects();
        let stored = match objects.read(&self.name)? {
            Some((stored, object)) if Version::from(object.version) == *version => stored.clone(),
            _ => return Err(LockError::conflict(BACKEND)),
        };
        if let Some(object) = objects.objects.get_mut(&self.name) {
            object.written_at = Instant::now();
        }
        Ok(Observed {
            record: stored,
            version: version.clone(),
        })
    }

    /// With the store clock: the holder's lease left since the last write or renewal.
    async fn time_left(&self) -> Result<Option<Duration>, LockError> {
        if !self.store_clock {
            return Ok(None);
        }
        let objects = self.store.objects();
        Ok(objects
            .read(&self.name)?
            .filter(|(record, _)| !record.is_free())
            .map(|(record, object)| {
                (object.written_at + record.lease_duration)
                    .saturating_duration_since(Instant::now())
            }))
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("memory:{}", self.name)
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        if !self.notifications {
            return Ok(None);
        }
        let rx = self
            .store
            .objects()
            .changes
            .entry(self.name.clone())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.changed().await.ok().map(|()| ((), rx))
        });
        Ok(Some(Box::pin(stream)))
    }

    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        if !self.store_clock {
            return Ok(None);
        }
        let mut objects = self.store.objects();
        let (previous, extensions) = match objects.read(&self.name)? {
            None => (0, Default::default()),
            Some((record, object)) => {
                let expired = object.written_at + record.lease_duration <= Instant::now();
                // A lease of this identity is no exception (S13).
                let takeable = record.is_free() || expired;
                if !takeable || record.reserved_for_other_than(&desired.holder_identity) {
                    return Ok(Some(Acquisition::Held {
                        renewed_in_store: !record.is_free() && self.renew_in_store,
                        observed: Observed {
                            record: record.clone(),
                            version: Version::from(object.version),
                        },
                        expires_in: (!record.is_free()).then(|| {
                            (object.written_at + record.lease_duration)
                                .saturating_duration_since(Instant::now())
                        }),
                    }));
                }
                (record.leader_transitions, record.extensions.clone())
            }
        };
        let mut record = desired.clone();
        record.leader_transitions = (previous + 1).max(desired.leader_transitions);
        // The stored extensions, not the candidate's (only a holder writes them).
        record.extensions = extensions;
        let version = objects.write(&self.name, Value::Record(record.clone()), false);
        Ok(Some(Acquisition::Acquired(Observed { record, version })))
    }
}
