//! What the records a shard set's member holds share: one etcd lease (per lease duration),
//! kept alive by one keep-alive per round whatever the number of records on it, and one watch
//! of the set's keys, which tells a renewal whether anyone else wrote a record since its
//! holder last did. A member that goes away without releasing leaves its lease to run out
//! (its records go with it then): revoking it early could let another member start a shard's
//! work while this member's still runs.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use etcd_client::{Client, EventType, KeyValue, WatchOptions};
use leader_core::LockError;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::error::map;
use crate::lease::{KeptLease, ttl};
use crate::store::EtcdStore;
use crate::watch::{Ended, Reconnects, member_check, next_message};

/// The etcd leases and the watch a shard set's member shares between its records.
pub(crate) struct SetShared {
    store: EtcdStore,
    /// The member's leases by TTL (one, as every record of a set has the set's lease
    /// duration), granted at the first acquisition and replaced once found gone.
    leases: Mutex<HashMap<i64, KeptLease>>,
    watch: SetWatch,
}

impl std::fmt::Debug for SetShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SetShared")
            .field("prefix", &self.watch.prefix)
            .finish_non_exhaustive()
    }
}

impl SetShared {
    /// Shared state for the records under `prefix` (the full key prefix of the set's keys).
    pub(crate) fn new(store: EtcdStore, prefix: String) -> Self {
        Self {
            store,
            leases: Mutex::default(),
            watch: SetWatch::new(prefix),
        }
    }

    fn context(&self) -> String {
        format!("{} keys {}*", self.store.inner.endpoints, self.watch.prefix)
    }

    /// The full key prefix of the set's keys.
    pub(crate) fn prefix(&self) -> &str {
        &self.watch.prefix
    }

    /// The lease for a term that starts at `started` and lasts `lease_duration`: one etcd
    /// confirmed alive by a keep-alive sent at or after `started` (so that it outlasts the
    /// term's renew deadline, S3), or granted now. Acquisitions made at once wait for one
    /// keep-alive between them.
    pub(crate) async fn lease_since(
        &self,
        lease_duration: Duration,
        started: Instant,
    ) -> Result<i64, LockError> {
        let ttl = ttl(lease_duration);
        let mut leases = self.leases.lock().await;
        if let Some(lease) = leases.get_mut(&ttl) {
            if lease.alive_since >= started {
                return Ok(lease.id);
            }
            match lease.keep_alive(&self.store).await {
                Ok(true) => return Ok(lease.id),
                // Gone (it ran out while this member was stopped, say), and its keys with it.
                Ok(false) => {
                    leases.remove(&ttl);
                }
                Err(err) => return Err(map(&self.context(), err)),
            }
        }
        let lease = KeptLease::grant(&self.store, lease_duration)
            .await
            .map_err(|err| map(&self.context(), err))?;
        let id = lease.id;
        leases.insert(ttl, lease);
        Ok(id)
    }

    /// Whether etcd lease `id` is one of this member's (as far as it knows, alive).
    pub(crate) async fn owns(&self, id: i64) -> bool {
        id != 0
            && self
                .leases
                .lock()
                .await
                .values()
                .any(|lease| lease.id == id)
    }

    /// One keep-alive of each lease this member holds records on (one, in practice): whether
    /// each is still alive, by id. A lease found gone is forgotten.
    pub(crate) async fn keep_all_alive(&self) -> HashMap<i64, Result<bool, LockError>> {
        let mut leases = self.leases.lock().await;
        let mut kept = HashMap::with_capacity(leases.len());
        let mut gone = Vec::new();
        for (&ttl, lease) in leases.iter_mut() {
            let alive = lease
                .keep_alive(&self.store)
                .await
                .map_err(|err| map(&self.context(), err));
            if matches!(alive, Ok(false)) {
                gone.push(ttl);
            }
            kept.insert(lease.id, alive);
        }
        for ttl in gone {
            leases.remove(&ttl);
        }
        kept
    }

    /// One keep-alive of lease `id`: `false` when it is gone (or no longer this member's).
    pub(crate) async fn keep_alive(&self, id: i64) -> Result<bool, LockError> {
        let mut leases = self.leases.lock().await;
        let Some((&ttl, lease)) = leases.iter_mut().find(|(_, lease)| lease.id == id) else {
            return Ok(false);
        };
        let alive = lease
            .keep_alive(&self.store)
            .await
            .map_err(|err| map(&self.context(), err))?;
        if !alive {
            leases.remove(&ttl);
        }
        Ok(alive)
    }

    /// Watches the set's keys from the revision after `revision` (a term's first write), if
    /// the watch does not run yet.
    pub(crate) fn watch_from(&self, revision: i64) {
        self.watch.start(&self.store, revision);
    }

    /// Whether the watch runs, covers the revisions after `written`, and has seen no write of
    /// `key` after it.
    pub(crate) fn clean(&self, key: &str, written: i64) -> bool {
        self.watch.clean(key, written)
    }

    /// Notes this member's write at `revision` of a key under the set's prefix: the set's
    /// keys are answered from the watch only once it has reported that write.
    pub(crate) fn wrote(&self, revision: i64) {
        self.watch.need.fetch_max(revision, Ordering::AcqRel);
    }

    /// Answers `read` over the set's keys as the watch knows them, without asking etcd, when
    /// every key of `keys` (named without the store's prefix) is under the set's prefix, the
    /// watch runs, and it has reported every write since a range read of the whole prefix and
    /// this member's own last write.
    pub(crate) fn read_watched<T>(
        &self,
        keys: &[String],
        read: impl FnOnce(&HashMap<Vec<u8>, KeyValue>) -> T,
    ) -> Option<T> {
        let set_prefix = self
            .watch
            .prefix
            .strip_prefix(self.store.inner.prefix.as_str())?;
        if !keys.iter().all(|key| key.starts_with(set_prefix))
            || !self.watch.healthy.load(Ordering::Acquire)
        {
            return None;
        }
        let state = self.watch.state.lock().unwrap_or_else(|p| p.into_inner());
        (state.seeded && state.progress >= self.watch.need.load(Ordering::Acquire))
            .then(|| read(&state.values))
    }

    /// Takes a range read of the whole prefix at `revision` (`kvs`) as the start of the
    /// watch's copy of the keys, and starts the watch after it if it does not run yet.
    pub(crate) fn seed(&self, kvs: &[KeyValue], revision: i64) {
        self.watch.start(&self.store, revision);
        let mut state = self.watch.state.lock().unwrap_or_else(|p| p.into_inner());
        // The copy is whole only if the watch reports every write after the read.
        if state.from > revision + 1 || revision <= 0 {
            return;
        }
        let Coverage {
            latest,
            values,
            seeded,
            seeded_at,
            ..
        } = &mut *state;
        *seeded_at = (*seeded_at).max(revision);
        // A key the watch saw written (or deleted) after the read is as the watch saw it;
        // one it saw written before the read and that the read does not have was deleted by
        // then (the watch reports that too, if it has not yet).
        let read: HashSet<&[u8]> = kvs.iter().map(KeyValue::key).collect();
        values.retain(|key, kv| kv.mod_revision() > revision || read.contains(key.as_slice()));
        for kv in kvs {
            if latest.get(kv.key()).is_none_or(|&seen| seen <= revision) {
                values.insert(kv.key().to_vec(), kv.clone());
            }
        }
        *seeded = true;
    }
}

/// One watch of every key under a prefix, in the background: the highest revision of each
/// key's last write seen, from which revision on it saw every write, whether it runs, and
/// (once a range read of the prefix gave it a start) a copy of the keys.
struct SetWatch {
    prefix: String,
    state: Arc<SyncMutex<Coverage>>,
    healthy: Arc<AtomicBool>,
    /// The revision of this member's last write under the prefix.
    need: AtomicI64,
    task: SyncMutex<Option<tokio::task::AbortHandle>>,
}

#[derive(Default)]
struct Coverage {
    /// The watch has reported every write from this revision on (0: not started).
    from: i64,
    /// The revision of the last write of each key it reported.
    latest: HashMap<Vec<u8>, i64>,
    /// The highest revision of any write it reported: it resumes after it.
    progress: i64,
    /// The keys it saw written and not deleted since; once `seeded`, with those of a range
    /// read of the prefix: the keys as of `progress`.
    values: HashMap<Vec<u8>, KeyValue>,
    /// Whether `values` holds every key: a range read seeded it, and no write went unreported
    /// since (revisions compacted before the watch saw them).
    seeded: bool,
    /// The revision of the last range read that seeded `values`: what a write at or before it
    /// did is in `values` already. A watch behind it (started again from an earlier revision)
    /// reports such writes again, which would take `values` back.
    seeded_at: i64,
}

impl SetWatch {
    fn new(prefix: String) -> Self {
        Self {
            prefix,
            state: Arc::default(),
            healthy: Arc::default(),
            need: AtomicI64::default(),
            task: SyncMutex::default(),
        }
    }

    fn clean(&self, key: &str, written: i64) -> bool {
        // A key outside the watched prefix is never known clean.
        if !key.starts_with(&self.prefix) || !self.healthy.load(Ordering::Acquire) {
            return false;
        }
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.from > 0
            && state.from <= written + 1
            && state
                .latest
                .get(key.as_bytes())
                .is_none_or(|&latest| latest <= written)
    }

    /// Starts the watch from `revision + 1` unless it runs. When the stream fails, or the
    /// store moved to another member (this one did not answer in time: it may be frozen and
    /// its watch silent), it starts again on the member the store talks to now, from the
    /// revision after the last write it reported; when those revisions were compacted, from
    /// the oldest one left, and the records written before it are not clean until written
    /// again.
    fn start(&self, store: &EtcdStore, revision: i64) {
        let mut task = self.task.lock().unwrap_or_else(|p| p.into_inner());
        if task.is_some() {
            return;
        }
        {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.from = revision + 1;
            state.progress = revision;
        }
        let (store, prefix) = (store.clone(), self.prefix.clone());
        let (state, healthy) = (self.state.clone(), self.healthy.clone());
        *task = Some(
            tokio::spawn(async move {
                let members = &store.inner.members;
                let mut reconnects = Reconnects::new(members.member_timeout());
                loop {
                    let index = members.current();
                    let started = Instant::now();
                    let outcome = match members.client(index).await {
                        Ok(client) => {
                            members.note_sent();
                            watch_set(client, &prefix, &state, &healthy, || {
                                members.current() != index
                            })
                            .await
                        }
                        Err(_) => Ended::Failed,
                    };
                    let came_up = healthy.swap(false, Ordering::AcqRel);
                    match outcome {
                        Ended::Compacted(oldest) => {
                            let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
                            state.from = state.from.max(oldest);
                            state.progress = state.progress.max(oldest - 1);
                            state.seeded = false;
                        }
                        Ended::Failed => {
                            members.skip(index);
                            tokio::time::sleep(reconnects.failed(started, came_up)).await;
                        }
                        Ended::Moved => {}
                    }
                }
            })
            .abort_handle(),
        );
    }
}

impl Drop for SetWatch {
    fn drop(&mut self) {
        if let Some(task) = self
            .task
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// One watch of the keys under `prefix` on `client`'s member, from the revision after the
/// last write reported, until it fails or `moved` says the store talks to another member now
/// (checked every half second).
async fn watch_set(
    client: Client,
    prefix: &str,
    state: &SyncMutex<Coverage>,
    healthy: &AtomicBool,
    moved: impl Fn() -> bool,
) -> Ended {
    let from = state.lock().unwrap_or_else(|p| p.into_inner()).progress + 1;
    let options = WatchOptions::new().with_prefix().with_start_revision(from);
    let Ok(mut stream) = crate::watch::watch_client(&client)
        .watch(prefix, Some(options))
        .await
    else {
        return Ended::Failed;
    };
    healthy.store(true, Ordering::Release);
    let mut check = member_check();
    loop {
        let message = match next_message(&mut stream, &mut check, &moved).await {
            Ok(message) => message,
            Err(ended) => return ended,
        };
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        for event in message.events() {
            let Some(kv) = event.kv() else { continue };
            let revision = kv.mod_revision();
            let latest = state.latest.entry(kv.key().to_vec()).or_default();
            *latest = (*latest).max(revision);
            state.progress = state.progress.max(revision);
            if revision <= state.seeded_at {
                // In the range read that seeded the copy, or before it.
                continue;
            }
            match event.event_type() {
                EventType::Put => {
                    state.values.insert(kv.key().to_vec(), kv.clone());
                }
                EventType::Delete => {
                    state.values.remove(kv.key());
                }
            }
        }
    }
}
