//! The parts of the lock's transactions: its version (the two keys' indexes), the checks, and
//! the operations of a renewal that a shard set batches with others'.

use super::*;

/// The lock's version: the `ModifyIndex` of the record key and of the renewal key (0: absent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Indexes {
    pub(super) record: u64,
    pub(super) renewal: u64,
}

impl Indexes {
    pub(super) fn version(self) -> Version {
        Version::new(format!("{}:{}", self.record, self.renewal))
    }

    /// A version this lock gave out; anything else cannot match what is stored.
    pub(super) fn of(version: &Version) -> Result<Self, LockError> {
        version
            .as_str()
            .split_once(':')
            .and_then(|(record, renewal)| {
                Some(Self {
                    record: record.parse().ok()?,
                    renewal: renewal.parse().ok()?,
                })
            })
            .ok_or_else(|| LockError::conflict(BACKEND))
    }
}

/// A key as Consul returns it.
pub(super) struct Entry {
    pub(super) modify_index: u64,
    pub(super) session: Option<String>,
    pub(super) value: Vec<u8>,
}

pub(super) fn op(verb: &str, key: &str) -> Value {
    json!({"KV": {"Verb": verb, "Key": key}})
}

pub(super) fn check_index(key: &str, index: u64) -> Value {
    if index == 0 {
        op("check-not-exists", key)
    } else {
        json!({"KV": {"Verb": "check-index", "Key": key, "Index": index}})
    }
}

/// The operations of a renewal ([`ConsulLock::renewal_ops`]).
pub(crate) const RENEWAL_OPS: usize = 3;

impl ConsulLock {
    /// A renewal's operations: the record key's index and its lock by this candidate's session
    /// checked, the renewal key written. A conflict when this candidate has no session, or for
    /// a version it did not give out.
    pub(crate) fn renewal_ops(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<[Value; RENEWAL_OPS], LockError> {
        let at = Indexes::of(version)?;
        let Some(session) = self.session.get() else {
            return Err(LockError::conflict(BACKEND));
        };
        Ok([
            check_index(&self.key, at.record),
            json!({"KV": {"Verb": "check-session", "Key": self.key, "Session": session}}),
            json!({"KV": {"Verb": "set", "Key": self.renewal_key, "Value": Self::renewal_value(&session, record)}}),
        ])
    }

    /// What a transaction with [`renewal_ops`](Self::renewal_ops) stored, from its results.
    pub(crate) fn renewed(
        &self,
        results: &[Value],
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let renewed = Observed {
            record: record.clone(),
            version: Indexes {
                record: Indexes::of(version)?.record,
                renewal: self.index_in(results, &self.renewal_key)?,
            }
            .version(),
        };
        // A renewal key written as it was keeps its ModifyIndex (`kvsSetTxn`): no renewal.
        LockError::unless_moved(BACKEND, "renew", version, renewed)
    }

    /// The record as [`get`](ResourceLock::get) answers it, from the entries of a read of many
    /// keys by key (a key missing from them is absent).
    pub(crate) fn absorb(
        &self,
        found: &std::collections::HashMap<&str, &Value>,
    ) -> Result<Option<Observed>, LockError> {
        let entry = |key: &str| match found.get(key) {
            Some(entry) => self.entry(entry),
            None => Ok(None),
        };
        let renewal = entry(&self.renewal_key)?;
        entry(&self.key)?
            .map(|record| self.observed(&record, renewal.as_ref()))
            .transpose()
    }
}
