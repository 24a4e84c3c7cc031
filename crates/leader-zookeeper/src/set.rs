//! A shard set's records on one session: reads and renewals of many elections in one request
//! each (`multiRead`, `multi`).

use std::sync::Arc;

use async_trait::async_trait;
use leader_core::backend::{LockCache, LockErrorExt, Renewal};
use leader_core::{LockError, LockSet, Observed, ResourceLock};
use zookeeper_client as zk;

use crate::error::{BACKEND, map};
use crate::lock::{Stored, ZooKeeperLock, set_data_version};
use crate::store::ZooKeeperStore;

/// Elections a request reads or renews at most: two operations each.
const BATCH: usize = 250;

/// The most record bytes one renewal request carries, a quarter of the servers' request limit
/// (`jute.maxbuffer`, 1 MiB by default): records of a few hundred bytes fill a batch by
/// [`BATCH`], records with kilobytes of extensions by this.
const BATCH_BYTES: usize = 256 * 1024;

/// The records of a shard set on one session: a [`ZooKeeperLock`] per record, read many at a
/// time with one `multiRead` and renewed many at a time with one `multi`. A `multi` is all or
/// nothing: when one renewal of it fails its compare-and-set, the ensemble names it, it is
/// answered with that failure, and the others are sent again without it.
#[derive(Debug)]
pub struct ZooKeeperSet {
    store: ZooKeeperStore,
    identity: String,
    locks: LockCache<ZooKeeperLock>,
}

impl ZooKeeperStore {
    /// The locks of a shard set for member `identity`: an election znode per record, on this
    /// store's session, read and renewed in batches.
    pub fn lock_set(&self, identity: impl Into<String>) -> ZooKeeperSet {
        ZooKeeperSet {
            store: self.clone(),
            identity: identity.into(),
            locks: LockCache::new(),
        }
    }
}

/// A renewal of a batch: its place in the request, its lock, what it renews, and its record
/// encoded once (a batch that lost one renewal is sent again without encoding the others
/// anew).
#[derive(Debug)]
struct Pending {
    index: usize,
    lock: Arc<ZooKeeperLock>,
    stored: Stored,
    json: Vec<u8>,
}

impl ZooKeeperSet {
    /// The lock on record `key`, made once and kept (it remembers the tokens it saw).
    fn zk_lock(&self, key: &str) -> Arc<ZooKeeperLock> {
        self.locks.get_or_make(key, || {
            Arc::new(self.store.lock(key, self.identity.as_str()))
        })
    }

    fn context(&self) -> String {
        format!("{}{}", self.store.describe(), self.store.prefix())
    }

    /// Renews `batch` (indexes into `renewals`, each renewing its own term on this session)
    /// in `multi`s, answering each in `answers`. A `multi` that fails names its first failed
    /// operation alone, and costs the ensemble a transaction all the same: after
    /// [`RESENDS`] of them the renewals left are answered as conflicts, which the set reads
    /// again, instead of one `multi` per renewal (a batch whose earlier answer was lost is
    /// stale whole).
    async fn renew_batch(
        &self,
        client: &zk::Client,
        renewals: &[Renewal],
        mut batch: Vec<Pending>,
        answers: &mut [Option<Result<Observed, LockError>>],
    ) {
        let mut failed_multis = 0;
        while !batch.is_empty() {
            if failed_multis > RESENDS {
                for pending in &batch {
                    answers[pending.index].get_or_insert_with(|| Err(LockError::conflict(BACKEND)));
                }
                return;
            }
            let mut writer = client.new_multi_writer();
            let refused = batch.iter().position(|pending| {
                pending
                    .lock
                    .add_renewal(&mut writer, pending.stored, &pending.json)
                    .map_err(|err| answers[pending.index] = Some(Err(err)))
                    .is_err()
            });
            if let Some(refused) = refused {
                batch.remove(refused);
                continue;
            }
            match writer.commit().await {
                Ok(results) => {
                    for (n, pending) in batch.iter().enumerate() {
                        let answer =
                            set_data_version(&self.context(), &results, 2 * n + 1).map(|written| {
                                let record = &renewals[pending.index].record;
                                pending.lock.renewed(record, pending.stored, written)
                            });
                        answers[pending.index].get_or_insert(answer);
                    }
                    return;
                }
                // The renewal whose operation failed is answered so; the rest go again.
                Err(zk::MultiWriteError::OperationFailed { index, source }) => {
                    failed_multis += 1;
                    let failed = batch.remove((index / 2).min(batch.len() - 1));
                    answers[failed.index] = Some(Err(map(&failed.lock.describe(), source)));
                }
                Err(zk::MultiWriteError::RequestFailed { source }) => {
                    let err = self.store.fail(client, &self.context(), source).await;
                    for pending in &batch {
                        answers[pending.index].get_or_insert_with(|| Err(err.duplicate()));
                    }
                    return;
                }
            }
        }
    }
}

/// How many times a batch of renewals is sent again after a `multi` failed on one of them.
const RESENDS: usize = 2;

#[async_trait]
impl LockSet for ZooKeeperSet {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.zk_lock(key)
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("zookeeper:{}", self.context())
    }

    /// One `multiRead` per 250 records.
    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        let client = match self.store.client().await {
            Ok(client) => client,
            Err(err) => return err.for_each(keys.len()),
        };
        let mut answers = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(BATCH) {
            let locks: Vec<Arc<ZooKeeperLock>> =
                chunk.iter().map(|key| self.zk_lock(key)).collect();
            let mut reader = client.new_multi_reader();
            if let Some(err) = locks
                .iter()
                .find_map(|lock| lock.add_reads(&mut reader).err())
            {
                answers.extend(err.for_each(chunk.len()));
                continue;
            }
            match reader.commit().await {
                Ok(results) => {
                    let mut results = results.into_iter();
                    for lock in &locks {
                        answers.push(
                            lock.take_read(&mut results)
                                .and_then(|read| lock.observed_of(read)),
                        );
                    }
                }
                Err(err) => {
                    let err = self.store.fail(&client, &self.context(), err).await;
                    answers.extend(err.for_each(chunk.len()));
                }
            }
        }
        answers
    }

    /// One `multi` per 250 renewals (or 256 KiB of records) of this session's own terms; anything else (a term
    /// whose record znode another session owns, a version this set never gave out) as its
    /// lock's [`renew`](ResourceLock::renew) answers it.
    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        let client = match self.store.client().await {
            Ok(client) => client,
            Err(err) => return err.for_each(renewals.len()),
        };
        let mut answers: Vec<Option<Result<Observed, LockError>>> = std::iter::repeat_with(|| None)
            .take(renewals.len())
            .collect();
        let mut batched = Vec::new();
        for (index, renewal) in renewals.iter().enumerate() {
            let lock = self.zk_lock(&renewal.key);
            match Stored::parse(&renewal.version) {
                Some(stored) if lock.renews(&client, stored, &renewal.record) => {
                    match lock.check_held_lease(&client, &renewal.record) {
                        Ok(()) => batched.push(Pending {
                            index,
                            lock,
                            stored,
                            json: renewal.record.to_json(),
                        }),
                        Err(err) => answers[index] = Some(Err(err)),
                    }
                }
                _ => answers[index] = Some(lock.renew(&renewal.version, &renewal.record).await),
            }
        }
        let mut batch = Vec::new();
        let mut bytes = 0;
        for renewal in batched {
            let size = renewal.json.len();
            if !batch.is_empty() && (batch.len() == BATCH || bytes + size > BATCH_BYTES) {
                let full = std::mem::take(&mut batch);
                self.renew_batch(&client, renewals, full, &mut answers)
                    .await;
                bytes = 0;
            }
            bytes += size;
            batch.push(renewal);
        }
        if !batch.is_empty() {
            self.renew_batch(&client, renewals, batch, &mut answers)
                .await;
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| Err(LockError::conflict(BACKEND))))
            .collect()
    }
}
