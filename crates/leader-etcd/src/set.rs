//! A shard set's records on etcd: one range read finds them all, and a member's records are on
//! one etcd lease, whose one keep-alive renews them all.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use etcd_client::GetOptions;
use futures_util::future::join_all;
use leader_core::{
    LockError, LockSet, Observed, Renewal, ResourceLock, async_trait, common_prefix,
};
use tokio::time::Instant;

use crate::error::map;
use crate::lease::SetLease;
use crate::lock::EtcdLock;
use crate::store::EtcdStore;

/// The records of a shard set on etcd ([`EtcdStore::lock_set`]): an [`EtcdLock`] per key,
/// whatever the number of records, a round costs two requests:
///
/// - [`get_many`](LockSet::get_many) is one range read over the set's keys (every key of a set
///   begins with its name and a dash);
/// - every record this member takes goes on one etcd lease of the member's (granted once, kept
///   alive on the stream [`EtcdLock`] uses), so [`renew_many`](LockSet::renew_many) is one
///   keep-alive message while the records are as their terms wrote them (a record written
///   since, by a handover request say, is renewed by a transaction of its own, as
///   [`EtcdLock`] renews). A member that stops renewing loses all its records at once, when
///   etcd expires that lease.
///
/// A record taken is kept alive in the same round trip as the transaction that takes it, so
/// that the lease's TTL runs from after the attempt began, as a fresh lease's would.
#[derive(Clone, Debug)]
pub struct EtcdLockSet {
    store: EtcdStore,
    identity: String,
    lease: Arc<SetLease>,
    locks: Arc<Mutex<HashMap<String, Arc<EtcdLock>>>>,
}

impl EtcdStore {
    /// The records of a shard set, as member `identity`.
    pub fn lock_set(&self, identity: impl Into<String>) -> EtcdLockSet {
        EtcdLockSet {
            store: self.clone(),
            identity: identity.into(),
            lease: Arc::default(),
            locks: Arc::default(),
        }
    }
}

impl EtcdLockSet {
    fn etcd_lock(&self, key: &str) -> Arc<EtcdLock> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks
            .entry(key.to_owned())
            .or_insert_with(|| {
                let lock = self.store.lock(key, self.identity.clone());
                Arc::new(lock.in_set(self.lease.clone()))
            })
            .clone()
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

    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        let prefix = format!("{}{}", self.store.inner.prefix, common_prefix(keys));
        let context = format!("{} keys {prefix}*", self.store.inner.endpoints);
        let answer = self
            .store
            .inner
            .members
            .call(true, |mut client| {
                let prefix = prefix.clone();
                async move {
                    client
                        .get(prefix, Some(GetOptions::new().with_prefix()))
                        .await
                }
            })
            .await;
        let found: HashMap<Vec<u8>, etcd_client::KeyValue> = match answer {
            Ok(response) => response
                .kvs()
                .iter()
                .map(|kv| (kv.key().to_vec(), kv.clone()))
                .collect(),
            Err(err) => {
                let err = map(&context, err);
                return keys
                    .iter()
                    .map(|_| {
                        Err(LockError::unavailable(
                            crate::error::BACKEND,
                            err.to_string(),
                        ))
                    })
                    .collect();
            }
        };
        keys.iter()
            .map(|key| self.etcd_lock(key).absorb(&found))
            .collect()
    }

    /// One keep-alive of the member's lease, then each record's renewal, which takes that
    /// keep-alive's answer and sends nothing more while its record is as its term wrote it.
    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        let since = Instant::now();
        self.lease.keep_current_alive(&self.store).await;
        join_all(renewals.iter().map(|renewal| {
            let lock = self.etcd_lock(&renewal.key);
            async move {
                lock.renew_since(since, &renewal.version, &renewal.record)
                    .await
            }
        }))
        .await
    }
}
