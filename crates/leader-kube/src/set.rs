//! A shard set's Leases: read with one list of the namespace's Leases.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::ListParams;
use leader_core::backend::{LockCache, LockErrorExt, member_key, roster_key, shard_key};
use leader_core::{LockError, LockSet, MAX_SHARDS, Observed, ResourceLock, async_trait};

use crate::error::BACKEND;
use crate::lock::LeaseLock;

/// The Leases of a shard set ([`LeaseLock::lock_set`]): a [`LeaseLock`] per record, in one
/// namespace, through one client.
///
/// - [`get_many`](LockSet::get_many) is one list of the namespace's Leases: one request a
///   round whatever the number of records, instead of one per record. It is a consistent
///   read, as a `get` is (not `resourceVersion=0`, which may answer from a cache far behind,
///   such as an API server cut off from the others); Kubernetes 1.31 and later serve it from
///   the watch cache once that has caught up (`ConsistentListFromCache`). Every Lease of the namespace
///   comes back, so a set with other busy elections beside it costs more bytes, not more
///   requests. The service account needs the verb `list` on leases (`deploy/kubernetes`
///   grants it).
/// - Renewals stay one request per record: the Kubernetes API writes one object per request,
///   with no transaction over several (a Lease's `update` is its compare-and-swap), so a member
///   renews its shards with one `update` each, sent together.
#[derive(Clone, Debug)]
pub struct LeaseSet {
    base: LeaseLock,
    identity: String,
    locks: LockCache<LeaseLock>,
}

impl LeaseLock {
    /// The Leases of shard set `name`, in this lock's namespace, through its clients, as member
    /// `identity`. The set's Lease names are checked here.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] when the API server would refuse the set's Lease names, or
    /// for a lock in coordinated leader election (the coordinator assigns one Lease to one
    /// candidate: it has no place in a set).
    pub fn lock_set(&self, name: &str, identity: impl Into<String>) -> Result<LeaseSet, LockError> {
        let identity = identity.into();
        if self.is_coordinated() {
            return Err(LockError::Misconfigured {
                backend: BACKEND,
                message: "a shard set cannot use coordinated leader election (binary_version)"
                    .into(),
            });
        }
        for key in [
            roster_key(name),
            member_key(name, &identity),
            shard_key(name, MAX_SHARDS),
        ] {
            self.sibling(key, identity.clone())?;
        }
        Ok(LeaseSet {
            base: self.clone(),
            identity,
            locks: LockCache::new(),
        })
    }
}

impl LeaseSet {
    fn lease_lock(&self, key: &str) -> Arc<LeaseLock> {
        self.locks.get_or_make(key, || {
            // Every name of the set has the shape checked when it was opened.
            let lock = self.base.sibling(key, self.identity.clone());
            Arc::new(lock.expect("the set's names were checked when it was opened"))
        })
    }
}

#[async_trait]
impl LockSet for LeaseSet {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.lease_lock(key)
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("kubernetes:{}", self.base.namespace())
    }

    /// One list of the namespace's Leases.
    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        let listed = self.base.api().list(&ListParams::default()).await;
        let leases: HashMap<String, Lease> = match listed {
            Ok(list) => list
                .items
                .into_iter()
                .filter_map(|lease| Some((lease.metadata.name.clone()?, lease)))
                .collect(),
            Err(err) => {
                let context = format!("leases in namespace {}", self.base.namespace());
                let err = crate::error::map(&context, "list", err);
                return err.for_each(keys.len());
            }
        };
        keys.iter()
            .map(|key| {
                let lock = self.lease_lock(key);
                leases.get(key).cloned().map(|l| lock.absorb(l)).transpose()
            })
            .collect()
    }
}
