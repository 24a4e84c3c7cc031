//! A shard set's records on etcd: one range read finds them all.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use etcd_client::GetOptions;
use leader_core::{LockError, LockSet, Observed, ResourceLock, async_trait, common_prefix};

use crate::error::map;
use crate::lock::EtcdLock;
use crate::store::EtcdStore;

/// The records of a shard set on etcd ([`EtcdStore::lock_set`]): an [`EtcdLock`] per key.
/// [`get_many`](LockSet::get_many) is one range read over the set's keys (every key of a set
/// begins with its name and a dash), whatever the number of records; renewals stay one
/// keep-alive per record for now, each on the record's own etcd lease.
#[derive(Clone, Debug)]
pub struct EtcdLockSet {
    store: EtcdStore,
    identity: String,
    locks: Arc<Mutex<HashMap<String, Arc<EtcdLock>>>>,
}

impl EtcdStore {
    /// The records of a shard set, as member `identity`.
    pub fn lock_set(&self, identity: impl Into<String>) -> EtcdLockSet {
        EtcdLockSet {
            store: self.clone(),
            identity: identity.into(),
            locks: Arc::default(),
        }
    }
}

impl EtcdLockSet {
    fn etcd_lock(&self, key: &str) -> Arc<EtcdLock> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks
            .entry(key.to_owned())
            .or_insert_with(|| Arc::new(self.store.lock(key, self.identity.clone())))
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
                return map(&context, err).for_each(keys.len());
            }
        };
        keys.iter()
            .map(|key| self.etcd_lock(key).absorb(&found))
            .collect()
    }
}
