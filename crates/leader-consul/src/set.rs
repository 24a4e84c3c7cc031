//! A shard set's records on Consul: read with one transaction, renewed in transactions of as
//! many records as Consul lets one hold.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::future::join_all;
use leader_core::backend::{LockCache, LockErrorExt, Renewal, common_prefix};
use leader_core::{LockError, LockSet, Observed, ResourceLock, async_trait};
use serde_json::Value;

use crate::lock::{ConsulLock, RENEWAL_OPS};
use crate::store::ConsulStore;

/// The most operations Consul lets a transaction hold (`maxTxnOps` in
/// `agent/txn_endpoint.go`; a transaction with more is refused with 413).
pub(crate) const MAX_TXN_OPS: usize = 128;

/// The records one renewal transaction renews: Consul's limit over a renewal's operations.
pub(crate) const RENEWALS_PER_TXN: usize = MAX_TXN_OPS / RENEWAL_OPS;

/// The records of a shard set on Consul ([`ConsulStore::lock_set`]): a [`ConsulLock`] per key,
/// each with its own session, read and renewed in batches.
///
/// - [`get_many`](LockSet::get_many) is one read-only transaction, a `get-tree` over the
///   set's keys (every key of a set begins with its name and a dash, the renewal keys too),
///   whatever the number of records. Consul leaves out of it the keys the ACL token may not
///   read, which then look absent: a write to them is refused with
///   [`LockError::Forbidden`], as for a single lock.
/// - [`renew_many`](LockSet::renew_many) puts the renewals of up to 42 records in one
///   transaction (Consul's transactions hold at most 128 operations; a renewal is three: the
///   record's index and session checked, its renewal key checked and set), so a round costs one
///   request per 42 records held. A transaction is all or nothing: when one record of it was
///   lost (taken over, or its session ended), its records are renewed again one by one, so
///   that the others go on.
#[derive(Clone, Debug)]
pub struct ConsulLockSet {
    store: ConsulStore,
    identity: String,
    locks: LockCache<ConsulLock>,
}

impl ConsulStore {
    /// The records of shard set `name`, as member `identity`. Its keys are checked here, so
    /// that the set's locks can be made as its runner asks for them (a set serves any key of
    /// that shape).
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] when the set's keys (`NAME-members`, `NAME-member-HASH`,
    /// `NAME-shard-N`) would be refused, as [`lock`](Self::lock) says.
    pub fn lock_set(
        &self,
        name: &str,
        identity: impl Into<String>,
    ) -> Result<ConsulLockSet, LockError> {
        let identity = identity.into();
        for key in [
            leader_core::backend::roster_key(name),
            leader_core::backend::member_key(name, &identity),
            leader_core::backend::shard_key(name, leader_core::MAX_SHARDS),
        ] {
            self.lock(key, identity.clone())?;
        }
        Ok(ConsulLockSet {
            store: self.clone(),
            identity,
            locks: LockCache::new(),
        })
    }
}

impl ConsulLockSet {
    fn consul_lock(&self, key: &str) -> Arc<ConsulLock> {
        self.locks.get_or_make(key, || {
            // Every key of the set has the shape checked when it was opened.
            let lock = self.store.lock(key, self.identity.clone());
            Arc::new(lock.expect("the set's keys were checked when it was opened"))
        })
    }

    /// One transaction of `ops`: its results, `None` when Consul refused it (409: a check
    /// failed, or the token may not), or the error of any other answer, or of none.
    async fn txn(&self, context: &str, ops: Vec<Value>) -> Result<Option<Vec<Value>>, LockError> {
        Ok(self.store.txn(context, &ops).await?.ok())
    }

    /// Renews `renewals` (at most [`RENEWALS_PER_TXN`]) in one transaction; one by one when
    /// Consul refuses it.
    async fn renew_chunk(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        let locks: Vec<_> = renewals
            .iter()
            .map(|renewal| self.consul_lock(&renewal.key))
            .collect();
        let mut ops = Vec::with_capacity(renewals.len() * RENEWAL_OPS);
        for (lock, renewal) in locks.iter().zip(renewals) {
            match lock.renewal_ops(&renewal.version, &renewal.record) {
                Ok(more) => ops.extend(more),
                // A record this member holds no session for, or a version it did not give out:
                // its own renewal says so.
                Err(_) => return self.one_by_one(&locks, renewals).await,
            }
        }
        let context = format!("{} {} renewals", self.store.address(), renewals.len());
        match self.txn(&context, ops).await {
            Ok(Some(results)) => locks
                .iter()
                .zip(renewals)
                .map(|(lock, renewal)| lock.renewed(&results, &renewal.version, &renewal.record))
                .collect(),
            // What refuses the whole set refuses each record the same (a token revoked or
            // expired, no path to the datacenter): asking record by record learns nothing, at
            // a request per record.
            Err(err) if refuses_every_record(&err) => err.for_each(renewals.len()),
            // Refused as a whole (a check failed, or the token may not): each record's own
            // renewal says which, and how.
            Ok(None) | Err(_) => self.one_by_one(&locks, renewals).await,
        }
    }

    async fn one_by_one(
        &self,
        locks: &[Arc<ConsulLock>],
        renewals: &[Renewal],
    ) -> Vec<Result<Observed, LockError>> {
        join_all(
            locks
                .iter()
                .zip(renewals)
                .map(|(lock, renewal)| lock.renew(&renewal.version, &renewal.record)),
        )
        .await
    }
}

#[async_trait]
impl LockSet for ConsulLockSet {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.consul_lock(key)
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("consul:{}", self.store.address())
    }

    /// One `get-tree` transaction over the set's keys.
    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        let prefix = format!("{}{}", self.store.prefix(), common_prefix(keys));
        let context = format!("{} keys {prefix}*", self.store.address());
        let read = self
            .txn(
                &context,
                vec![serde_json::json!({"KV": {"Verb": "get-tree", "Key": prefix}})],
            )
            .await;
        let results = match read {
            Ok(Some(results)) => results,
            Err(err) if refuses_every_record(&err) => return err.for_each(keys.len()),
            Ok(None) | Err(_) => {
                // Refused as a whole: each record's own read says why.
                return join_all(keys.iter().map(|key| {
                    let lock = self.consul_lock(key);
                    async move { lock.get().await }
                }))
                .await;
            }
        };
        let found: HashMap<&str, &Value> = results
            .iter()
            .filter_map(|r| Some((r["KV"]["Key"].as_str()?, &r["KV"])))
            .collect();
        keys.iter()
            .map(|key| self.consul_lock(key).absorb(&found))
            .collect()
    }

    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        join_all(
            renewals
                .chunks(RENEWALS_PER_TXN)
                .map(|chunk| self.renew_chunk(chunk)),
        )
        .await
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Whether `err`, a request for many records that failed, would fail each record's own request
/// the same: an outage, a refused token (Consul checks a token before anything it asks), a
/// datacenter out of reach. Reads are never refused record by record (Consul filters what a
/// token may not read out of the answer).
fn refuses_every_record(err: &LockError) -> bool {
    matches!(
        err,
        LockError::Unavailable { .. }
            | LockError::Forbidden { .. }
            | LockError::Misconfigured { .. }
    )
}
