//! The lock's keys as etcd stores them: the reads of one election's keys in a transaction,
//! and the record, its version and its fencing token decoded from what they return.

use etcd_client::{GetResponse, KeyValue, Txn, TxnOp, TxnOpResponse, TxnResponse};
use leader_core::backend::Known;
use leader_core::{LeaderElectionRecord, LockError, Observed, Version};

use super::{EtcdLock, conflict};
use crate::error::BACKEND;
use crate::seen::RecordSeen;

impl EtcdLock {
    pub(super) fn gets(&self) -> [TxnOp; 3] {
        [
            TxnOp::get(self.key.as_str(), None),
            TxnOp::get(self.fence.as_str(), None),
            TxnOp::get(self.kept.as_str(), None),
        ]
    }

    /// The write of the extensions key that goes with every write of `record`: the record
    /// itself, on no lease, when it has extensions; the key deleted when it has none.
    pub(super) fn extensions_op(&self, record: &LeaderElectionRecord) -> TxnOp {
        if record.extensions.is_empty() {
            TxnOp::delete(self.kept.as_str(), None)
        } else {
            TxnOp::put(self.kept.as_str(), record.to_json(), None)
        }
    }

    pub(super) async fn read(&self) -> Result<Option<(Observed, i64)>, LockError> {
        let response = self.read_txn(Txn::new().and_then(self.gets())).await?;
        let (record, fence, kept) = split_gets(&response);
        self.decode(record, fence, kept)
    }

    /// The record and fence keys, as read together by a transaction's `get`s; remembers them.
    pub(super) fn decode(
        &self,
        record: Option<GetResponse>,
        fence: Option<GetResponse>,
        kept: Option<GetResponse>,
    ) -> Result<Option<(Observed, i64)>, LockError> {
        let first = |r: &Option<GetResponse>| r.as_ref().and_then(|r| r.kvs().first()).cloned();
        self.decode_kvs(
            first(&record).as_ref(),
            first(&fence).as_ref(),
            first(&kept).as_ref(),
        )
    }

    /// The keys of this election (record, fence, extensions) as one read found them, for a
    /// shard set's read of many: the record, as [`get`](ResourceLock::get) answers it.
    pub(crate) fn absorb(
        &self,
        keys: &std::collections::HashMap<Vec<u8>, KeyValue>,
    ) -> Result<Option<Observed>, LockError> {
        let kv = |key: &str| keys.get(key.as_bytes());
        Ok(self
            .decode_kvs(kv(&self.key), kv(&self.fence), kv(&self.kept))?
            .map(|(observed, _)| observed))
    }

    /// Whether the keys of this election are as this lock last learned them and as a reader
    /// holding `known` holds the record: a shard set's read may answer it unchanged. A record
    /// renewed through its member's etcd lease keeps its revision, so most records of a set
    /// are, round after round.
    pub(crate) fn unchanged(
        &self,
        keys: &std::collections::HashMap<Vec<u8>, KeyValue>,
        known: &Known<'_>,
    ) -> bool {
        let revision = |key: &str| keys.get(key.as_bytes()).map_or(0, KeyValue::mod_revision);
        let seen = self.seen();
        if seen.fence.is_none_or(|(_, at)| at != revision(&self.fence))
            || seen
                .kept
                .as_ref()
                .is_none_or(|(_, at)| *at != revision(&self.kept))
        {
            return false;
        }
        match (known, keys.get(self.key.as_bytes()), &seen.record) {
            (Known::Absent, None, Some(RecordSeen::Absent)) => true,
            (Known::Version(version), Some(kv), Some(RecordSeen::Present { mod_revision, .. })) => {
                *mod_revision == kv.mod_revision()
                    && version.as_str().parse() == Ok(kv.mod_revision())
            }
            _ => false,
        }
    }

    pub(super) fn decode_kvs(
        &self,
        record: Option<&KeyValue>,
        fence_kv: Option<&KeyValue>,
        kept_kv: Option<&KeyValue>,
    ) -> Result<Option<(Observed, i64)>, LockError> {
        let token = fence_kv.map_or(0, |kv| token_of(kv.value(), kv.mod_revision()));
        let mut seen = self.seen();
        seen.fence = Some((token, fence_kv.map_or(0, KeyValue::mod_revision)));
        // A value that is not a record keeps nothing (the record key's own value is checked).
        // A revision is one write: what was learned of it holds (a shard set reads its keys
        // every round, and most are as they were).
        let kept_revision = kept_kv.map_or(0, KeyValue::mod_revision);
        if seen
            .kept
            .as_ref()
            .is_none_or(|(_, at)| *at != kept_revision)
        {
            let extensions = kept_kv
                .and_then(|kv| LeaderElectionRecord::from_json(BACKEND, "", kv.value()).ok())
                .map(|r| r.extensions)
                .unwrap_or_default();
            seen.kept = Some((extensions, kept_revision));
        }
        let Some(kv) = record else {
            seen.record = Some(RecordSeen::Absent);
            return Ok(None);
        };
        let stored = match &seen.record {
            Some(RecordSeen::Present {
                mod_revision,
                record,
                decoded: true,
                ..
            }) if *mod_revision == kv.mod_revision() => record.clone(),
            _ => {
                seen.record = None;
                let stored = LeaderElectionRecord::from_json(BACKEND, self.context(), kv.value())?;
                seen.record = Some(RecordSeen::Present {
                    mod_revision: kv.mod_revision(),
                    lease: kv.lease(),
                    record: stored.clone(),
                    decoded: true,
                });
                stored
            }
        };
        Ok(Some((
            Observed {
                record: {
                    let mut record = stored;
                    record.leader_transitions = token;
                    record
                },
                version: Version::from(kv.mod_revision()),
            },
            kv.lease(),
        )))
    }
}

/// The `get` responses of a transaction, in order.
pub(super) fn split_gets(
    response: &TxnResponse,
) -> (
    Option<GetResponse>,
    Option<GetResponse>,
    Option<GetResponse>,
) {
    let mut gets = response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        });
    (gets.next(), gets.next(), gets.next())
}

/// The fencing token from the fence key: its revision, or the value the elector asked for if
/// higher.
pub(super) fn token_of(value: &[u8], revision: i64) -> u64 {
    let asked = std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    asked.max(u64::try_from(revision).unwrap_or(0))
}

pub(super) fn parse_version(version: &Version) -> Result<i64, LockError> {
    version.as_str().parse().map_err(|_| conflict())
}
