//! A shard set's records on etcd: one range read finds them all, and a member's records
//! share one etcd lease, kept alive by one keep-alive per round.

use std::collections::HashMap;
use std::sync::Arc;

use etcd_client::{GetOptions, KeyValue};
use futures_util::future::join_all;
use leader_core::backend::{Known, LockCache, LockErrorExt, Renewal, Reread, common_prefix};
use leader_core::{LockError, LockSet, Observed, ResourceLock, async_trait};

use crate::error::map;
use crate::lock::EtcdLock;
use crate::shared::SetShared;
use crate::store::EtcdStore;

/// The records of a shard set on etcd ([`EtcdStore::lock_set`]): an [`EtcdLock`] per key, whose
/// cost does not grow with the number of records a member holds.
///
/// - [`get_many`](LockSet::get_many) is one range read over the set's keys (every key of a
///   set begins with its name and a dash), whatever the number of records; once that read
///   started the member's watch of the set's keys, none: the watch keeps a copy of them.
///   [`get_changed`](LockSet::get_changed) answers a record still at the revision the reader
///   holds unchanged, without decoding it again (a record renewed through the member's etcd
///   lease keeps its revision), and a record's value is decoded once per revision.
/// - Every record this member takes goes on one etcd lease of the member's (granted at its
///   first acquisition, or again once it ran out), not on a lease of its own: when the member
///   dies, etcd expires the lease and all its records with it, on etcd's clock. An acquisition
///   uses the lease only once a keep-alive sent after the acquisition began confirmed it
///   (acquisitions at once share that keep-alive), so that the lease outlasts the term's
///   renew deadline.
/// - [`renew_many`](LockSet::renew_many) is one keep-alive of that lease, whatever the number
///   of records: a record is renewed by it alone while one watch of the set's keys (the
///   member's, one stream) has seen no write of it since this member's; otherwise (after
///   someone else's write, or while that watch does not run) by a transaction that rewrites
///   it only if its version and its lease are still this term's, as a single lock's full
///   renewal.
/// - No waiting candidates: members take what is released or expired by reading the set, and
///   a release names its receiver in the record.
///
/// Not `Clone`: the lease is this member's alone, and a record on it is taken again only by
/// the member (the runner) that holds the set.
#[derive(Debug)]
pub struct EtcdLockSet {
    store: EtcdStore,
    identity: String,
    shared: Arc<SetShared>,
    locks: LockCache<EtcdLock>,
}

impl EtcdStore {
    /// The records of shard set `name`, as member `identity`.
    pub fn lock_set(&self, name: &str, identity: impl Into<String>) -> EtcdLockSet {
        let prefix = format!("{}{name}-", self.inner.prefix);
        EtcdLockSet {
            store: self.clone(),
            identity: identity.into(),
            shared: Arc::new(SetShared::new(self.clone(), prefix)),
            locks: LockCache::new(),
        }
    }
}

impl EtcdLockSet {
    fn etcd_lock(&self, key: &str) -> Arc<EtcdLock> {
        self.locks.get_or_make(key, || {
            let lock = self.store.lock(key, self.identity.clone());
            Arc::new(lock.in_set(self.shared.clone()))
        })
    }

    /// One range read of the set's keys, which also gives the watch its start.
    async fn range_read(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        let prefix = format!("{}{}", self.store.inner.prefix, common_prefix(keys));
        let context = format!("{} keys {prefix}*", self.store.inner.endpoints);
        let answer = self
            .store
            .inner
            .members
            .call(true, |client| read_prefix(client, prefix.clone()))
            .await;
        let found: HashMap<Vec<u8>, etcd_client::KeyValue> = match answer {
            Ok((kvs, revision)) => {
                if prefix == self.shared.prefix() {
                    self.shared.seed(&kvs, revision);
                }
                kvs.into_iter().map(|kv| (kv.key().to_vec(), kv)).collect()
            }
            Err(err) => {
                return map(&context, err).for_each(keys.len());
            }
        };
        keys.iter()
            .map(|key| self.etcd_lock(key).absorb(&found))
            .collect()
    }
}

/// How many keys one request of a range read asks for. The gRPC client takes answers of 4 MiB
/// by default, which a whole set's keys pass at some thousands of records (a few hundred bytes
/// each, more with extensions), and a read that fails so fails every round.
const PAGE: i64 = 256;

/// The largest answer a range read takes: a page of records with large extensions (each
/// record's value is stored twice then: the record and its extensions key).
const PAGE_BYTES: usize = 256 << 20;

/// Every key under `prefix`, and the revision they were read at: read in pages of [`PAGE`]
/// keys, each after the first at the first's revision, so that together they are one
/// snapshot (a compaction between two pages fails the read, and the next starts over).
async fn read_prefix(
    client: etcd_client::Client,
    prefix: String,
) -> Result<(Vec<KeyValue>, i64), etcd_client::Error> {
    let mut client = client.kv_client().max_decoding_message_size(PAGE_BYTES);
    let first = client
        .get(
            prefix.as_str(),
            Some(GetOptions::new().with_prefix().with_limit(PAGE)),
        )
        .await?;
    let revision = first.header().map_or(0, |h| h.revision());
    let mut more = first.more();
    let mut kvs = first.kvs().to_vec();
    let end = prefix_end(prefix.as_bytes());
    while more && let Some(last) = kvs.last() {
        // The key right after the last one read.
        let mut from = last.key().to_vec();
        from.push(0);
        let options = GetOptions::new()
            .with_range(end.clone())
            .with_revision(revision)
            .with_limit(PAGE);
        let page = client.get(from, Some(options)).await?;
        more = page.more();
        kvs.extend_from_slice(page.kvs());
    }
    Ok((kvs, revision))
}

/// The end of the range of keys that begin with `prefix`: its last byte that can grow, grown,
/// and the bytes after it dropped; a prefix of `0xff` bytes alone (or none) ranges to the last
/// key (`\0`, as etcd reads it).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|&byte| byte < 0xff) {
        Some(at) => {
            let mut end = prefix[..=at].to_vec();
            end[at] += 1;
            end
        }
        None => vec![0],
    }
}

#[async_trait]
impl LockSet for EtcdLockSet {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.etcd_lock(key)
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("etcd:{}", self.store.inner.endpoints)
    }

    /// From the set's watch when it knows every key (see [`EtcdLockSet`]), else one range
    /// read of the set's keys, which also gives the watch its start.
    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        let known = self.shared.read_watched(keys, |values| {
            keys.iter()
                .map(|key| self.etcd_lock(key).absorb(values))
                .collect()
        });
        if let Some(answers) = known {
            return answers;
        }
        self.range_read(keys).await
    }

    /// From the set's watch when it knows every key, as [`get_many`](LockSet::get_many): a
    /// record at the revision the reader holds (renewed through its member's etcd lease since)
    /// is answered unchanged, without decoding it again. Else one range read, every record
    /// answered.
    async fn get_changed(
        &self,
        keys: &[String],
        known: &[Known<'_>],
    ) -> Vec<Result<Reread, LockError>> {
        let watched = self.shared.read_watched(keys, |values| {
            keys.iter()
                .zip(known)
                .map(|(key, known)| {
                    let lock = self.etcd_lock(key);
                    if lock.unchanged(values, known) {
                        Ok(Reread::Same)
                    } else {
                        lock.absorb(values).map(Reread::Now)
                    }
                })
                .collect()
        });
        if let Some(answers) = watched {
            return answers;
        }
        self.range_read(keys)
            .await
            .into_iter()
            .map(|answer| answer.map(Reread::Now))
            .collect()
    }

    /// A member's lease that runs out takes its records (its member record too) with it:
    /// etcd deletes them.
    fn reads_show_expiry(&self) -> bool {
        true
    }

    /// One keep-alive of this member's lease, then each record: answered by it alone while
    /// the set's watch saw nobody else write the record, else a transaction of its own.
    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        if renewals.is_empty() {
            return Vec::new();
        }
        let kept = self.shared.keep_all_alive().await;
        join_all(renewals.iter().map(|renewal| {
            let lock = self.etcd_lock(&renewal.key);
            let kept = &kept;
            async move {
                lock.renew_kept(&renewal.version, &renewal.record, kept)
                    .await
            }
        }))
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    /// The range end of a prefix is the first key past every key that begins with it.
    #[test]
    fn the_range_of_a_prefix_ends_past_its_last_key() {
        assert_eq!(prefix_end(b"leader/a-"), b"leader/a.");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
        assert_eq!(prefix_end(b""), b"\0");
    }
}
