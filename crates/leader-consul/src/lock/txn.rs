//! The lock's transactions: its version (the two keys' indexes), the checks, the operations of
//! a renewal that a shard set batches with others', and the acquisition and write.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use leader_core::{LeaderElectionRecord, LockError, Observed, Version};
use serde_json::{Value, json};

use super::ConsulLock;
use crate::error::BACKEND;
use crate::session;

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
    /// checked, the renewal key written over its index as read (a check-and-set). A conflict
    /// when this candidate has no session, or for a version it did not give out.
    ///
    /// The renewal key's index is checked as the record key's is: a renewal whose answer was
    /// lost moved it, and a follower that read it counts the lease from then, so sending the
    /// renewal again from the version before must conflict, as on every other store, instead
    /// of writing the same bytes (which Consul skips, answering the lost write's index) and
    /// extending the term from the retry (S3, S14).
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
            json!({"KV": {"Verb": "cas", "Key": self.renewal_key, "Index": at.renewal, "Value": Self::renewal_value(&session, record, at.renewal)}}),
        ])
    }

    /// `record` as a transaction stored it with the record key at `index`, from the
    /// transaction's `results`. The renewal key's index is read there, not taken to be `index`:
    /// Consul skips a renewal key set to the value it holds (`kvsSetTxn`), which keeps its
    /// ModifyIndex.
    pub(super) fn written(
        &self,
        record: &LeaderElectionRecord,
        index: u64,
        results: &[Value],
    ) -> Result<Observed, LockError> {
        Ok(Observed {
            record: record.clone(),
            version: Indexes {
                record: index,
                renewal: self.index_in(results, &self.renewal_key)?,
            }
            .version(),
        })
    }

    /// What a transaction with [`renewal_ops`](Self::renewal_ops) stored, from its results.
    pub(crate) fn renewed(
        &self,
        results: &[Value],
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let renewed = self.written(record, Indexes::of(version)?.record, results)?;
        // A renewal key written as it was keeps its ModifyIndex (`kvsSetTxn`): no renewal.
        leader_core::backend::unless_moved(BACKEND, "renew", version, renewed)
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

    /// Takes the key for `record` (which names this candidate) from the version `at` (`None`:
    /// a create, which only wants the record key absent): checks both indexes, deletes the key
    /// (a dead holder's session may still lock it) and locks it anew with this candidate's
    /// session, and writes the renewal key. The session of the holder it took over from, if
    /// any, is destroyed after.
    pub(super) async fn take(
        &self,
        at: Option<Indexes>,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let session = self.session_for(record).await?;
        let before = at.and_then(|at| self.locker_at(at.record));
        let mut ops = Vec::new();
        match at {
            None => ops.push(op("check-not-exists", &self.key)),
            Some(at) => {
                ops.push(check_index(&self.key, at.record));
                ops.push(check_index(&self.renewal_key, at.renewal));
                if at.record != 0 {
                    ops.push(op("delete", &self.key));
                }
            }
        }
        let value = BASE64.encode(record.to_json());
        ops.push(
            json!({"KV": {"Verb": "lock", "Key": self.key, "Value": value, "Session": session}}),
        );
        let after = at.map_or(0, |at| at.renewal);
        ops.push(json!({"KV": {"Verb": "set", "Key": self.renewal_key, "Value": Self::renewal_value(&session, record, after)}}));
        let results = match self.txn(&ops).await {
            Ok(results) => results,
            Err(err) => {
                // The transaction changed nothing: a session that held nothing before still
                // holds nothing.
                let held = self.known().locked.as_ref().and_then(|(_, l)| l.clone());
                if err.is_conflict() && held.as_deref() != Some(session.as_str()) {
                    self.drop_session().await;
                }
                return Err(err);
            }
        };
        let index = self.index_in(&results, &self.key)?;
        self.note(index, Some(session.clone()), record.leader_transitions);
        if before.as_deref() != Some(session.as_str()) {
            if let Some(previous) = before {
                // A dead or stopped holder's session, which now holds nothing.
                session::destroy(&self.store, &previous).await;
            }
            // A new term: a lease from now, sessions left for this key before it are gone.
            session::sweep_later(
                &self.store,
                self.key.clone(),
                session.clone(),
                index,
                record.lease_duration,
            );
        }
        self.written(record, index, &results)
    }

    /// Writes `record` over version `at` with `verb`: `cas` (which keeps whoever locks the key),
    /// or `unlock` by `session`; the renewal key stays as it is.
    pub(super) async fn write(
        &self,
        at: Indexes,
        record: &LeaderElectionRecord,
        verb: &str,
        session: Option<&str>,
    ) -> Result<Observed, LockError> {
        let value = BASE64.encode(record.to_json());
        let write = match session {
            Some(session) => {
                json!({"KV": {"Verb": verb, "Key": self.key, "Value": value, "Session": session}})
            }
            None => {
                json!({"KV": {"Verb": verb, "Key": self.key, "Value": value, "Index": at.record}})
            }
        };
        let results = self
            .txn(&[
                check_index(&self.key, at.record),
                write,
                op("get-or-empty", &self.renewal_key),
            ])
            .await?;
        let index = self.index_in(&results, &self.key)?;
        let renewal = self.index_in(&results, &self.renewal_key)?;
        let locked = if verb == "unlock" {
            None
        } else {
            self.locker_at(at.record)
        };
        self.note(index, locked, record.leader_transitions);
        let written = Observed {
            record: record.clone(),
            version: Indexes {
                record: index,
                renewal,
            }
            .version(),
        };
        // Consul keeps the ModifyIndex of a key written with the value, flags and session it
        // has (`kvsSetTxn`): such a write changed nothing (S14).
        leader_core::backend::unless_moved(BACKEND, "update", &at.version(), written)
    }
}
