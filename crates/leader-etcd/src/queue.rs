//! The queue of waiting candidates: a follower's etcd lease granted in advance and registered
//! under `NAME.candidates/IDENTITY`, and whom a release hands the lease to.

use std::fmt;
use std::time::Duration;

use chrono::Utc;
use etcd_client::{Compare, CompareOp, GetResponse, KeyValue, PutOptions, Txn, TxnOp};
use leader_core::LeaderElectionRecord;

use crate::lease::KeptLease;
use crate::store::EtcdStore;

/// A follower's etcd lease, granted in advance for its next acquisition, on which it waits as a
/// candidate.
pub(crate) struct Prepared {
    pub(crate) lease: KeptLease,
}

impl Prepared {
    /// A lease for `lease_duration`, registered on as the waiting candidate `key` (the
    /// registration is best effort: without it, a release just frees the lease).
    pub(crate) async fn register(
        store: &EtcdStore,
        key: &str,
        lease_duration: Duration,
    ) -> Result<Self, etcd_client::Error> {
        let lease = KeptLease::grant(store, lease_duration).await?;
        let millis = lease_duration.as_millis().to_string();
        let id = lease.id;
        let put = store
            .inner
            .members
            .call(true, |mut client| {
                let (key, millis) = (key.to_owned(), millis.clone());
                async move {
                    let options = PutOptions::new().with_lease(id);
                    client.put(key, millis, Some(options)).await
                }
            })
            .await;
        if let Err(err) = put {
            tracing::debug!(error = %err, "could not register as a waiting candidate");
        }
        Ok(Self { lease })
    }
}

impl fmt::Debug for Prepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prepared")
            .field("lease", &self.lease.id)
            .finish_non_exhaustive()
    }
}

/// A waiting candidate a release can hand the lease to.
#[derive(Clone, Debug)]
pub(crate) struct Successor {
    pub(crate) identity: String,
    pub(crate) lease: i64,
    lease_duration: Duration,
    /// When it registered (its key's create revision): the longest-waiting goes first.
    since: i64,
}

impl Successor {
    /// The candidate registered as `kv` under `prefix`, if it is one (on a lease, with a lease
    /// duration in milliseconds).
    pub(crate) fn registered(prefix: &str, kv: &KeyValue) -> Option<Self> {
        let identity = kv.key_str().ok()?.strip_prefix(prefix)?;
        let millis: u64 = kv.value_str().ok()?.parse().ok()?;
        (kv.lease() != 0).then(|| Self {
            identity: identity.to_owned(),
            lease: kv.lease(),
            lease_duration: Duration::from_millis(millis),
            since: kv.create_revision(),
        })
    }

    /// The candidates registered under `prefix`, as `read` found them.
    pub(crate) fn all_in<'a>(
        prefix: &'a str,
        read: &'a GetResponse,
    ) -> impl Iterator<Item = Self> + 'a {
        read.kvs()
            .iter()
            .filter_map(move |kv| Self::registered(prefix, kv))
    }

    /// The one a release of `record` by `identity` hands the lease to: the one a pending
    /// handover request names if it waits, else the longest-waiting one, never `identity`.
    pub(crate) fn next_in_line(
        waiting: impl IntoIterator<Item = Self>,
        identity: &str,
        record: &LeaderElectionRecord,
    ) -> Option<Self> {
        let mut waiting = waiting.into_iter().filter(|c| c.identity != identity);
        match record.handover_to() {
            // Only the named one; if it is not waiting, the release frees the lease with the
            // request kept, and the others stand back.
            Some(to) => waiting.find(|c| c.identity == to),
            None => waiting.min_by_key(|c| c.since),
        }
    }

    /// The record that makes this candidate the holder with fencing token `wanted`, for a
    /// release of `released`.
    pub(crate) fn record(
        &self,
        released: &LeaderElectionRecord,
        wanted: u64,
    ) -> LeaderElectionRecord {
        let now = Utc::now();
        {
            let mut record =
                LeaderElectionRecord::new(self.identity.clone(), self.lease_duration, now, wanted);
            record.strategy = released.strategy.clone();
            record.extensions = released.extensions.clone();
            record
        }
    }

    /// The transaction that hands `key` to this candidate registered under `prefix` as
    /// `record` on its lease, with `wanted` in the `fence` key, if it still waits on that lease;
    /// `otherwise` when it does not.
    pub(crate) fn hand_over(
        &self,
        prefix: &str,
        (key, fence): (&str, &str),
        (record, wanted): (&LeaderElectionRecord, u64),
        otherwise: TxnOp,
    ) -> Txn {
        let registration = format!("{prefix}{}", self.identity);
        Txn::new()
            .when([Compare::lease(
                registration.as_str(),
                CompareOp::Equal,
                self.lease,
            )])
            .and_then([
                TxnOp::put(
                    key,
                    record.to_json(),
                    Some(PutOptions::new().with_lease(self.lease)),
                ),
                TxnOp::put(fence, wanted.to_string(), None),
                TxnOp::delete(registration.as_str(), None),
            ])
            .or_else([otherwise])
    }
}
