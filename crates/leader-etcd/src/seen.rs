//! What a lock last learned of its keys (by a read, a watch or its own write), and the
//! takeover it allows without another read.

use std::collections::BTreeMap;

use etcd_client::{Compare, CompareOp, Event, EventType};
use leader_core::LeaderElectionRecord;

use crate::error::BACKEND;

/// What the lock last learned of its keys.
#[derive(Clone, Debug, Default)]
pub(crate) struct Seen {
    /// The record key, `None` when unknown.
    pub(crate) record: Option<RecordSeen>,
    /// The fence key's token and `mod_revision` (0 when absent), when read.
    pub(crate) fence: Option<(u64, i64)>,
    /// The extensions key's extensions and `mod_revision` (0 when absent), when read or
    /// written by this lock.
    pub(crate) kept: Option<(BTreeMap<String, String>, i64)>,
    /// The revision of this lock's last own write of the record (0: none).
    pub(crate) own_write: i64,
}

#[derive(Clone, Debug)]
pub(crate) enum RecordSeen {
    Absent,
    /// The record as stored (its `leader_transitions` as written, not the fence's token), its
    /// `mod_revision` and its etcd lease (0: none).
    Present {
        mod_revision: i64,
        lease: i64,
        record: LeaderElectionRecord,
        /// Decoded from the value stored at `mod_revision`, which a read of that revision may
        /// take as it is; `false` for what this lock wrote (a record's lease duration is stored
        /// in milliseconds, and finer parts would be read back without them).
        decoded: bool,
    },
}

impl Seen {
    /// The record key as a watch `event` on it reports it (unknown when it cannot be read).
    pub(crate) fn learn(&mut self, event: &Event) {
        self.record = match (event.event_type(), event.kv()) {
            (EventType::Put, Some(kv)) => LeaderElectionRecord::from_json(BACKEND, "", kv.value())
                .ok()
                .map(|record| RecordSeen::Present {
                    mod_revision: kv.mod_revision(),
                    lease: kv.lease(),
                    record,
                    decoded: true,
                }),
            (EventType::Delete, _) => Some(RecordSeen::Absent),
            _ => None,
        };
    }

    /// Whether `event` reports this lock's own last write of the record, which the lock
    /// answered its caller for already.
    pub(crate) fn wrote_it(&self, event: &Event) -> bool {
        self.own_write > 0
            && event.event_type() == EventType::Put
            && event
                .kv()
                .is_some_and(|kv| kv.mod_revision() == self.own_write)
    }

    /// The lock's own write of `record` at `revision` on `lease` (the fence is unchanged),
    /// unless something newer was seen already.
    pub(crate) fn wrote(&mut self, record: &LeaderElectionRecord, revision: i64, lease: i64) {
        if let Some(RecordSeen::Present { mod_revision, .. }) = &self.record
            && *mod_revision > revision
        {
            return;
        }
        // Every write of the record writes the extensions key with it (see `extensions_op`).
        self.kept = Some(if record.extensions.is_empty() {
            (BTreeMap::new(), 0)
        } else {
            (record.extensions.clone(), revision)
        });
        self.record = Some(RecordSeen::Present {
            mod_revision: revision,
            lease,
            record: record.clone(),
            decoded: false,
        });
        self.own_write = revision;
    }

    /// The conditions under which `desired` may take the record `key` (fenced by `fence`) as
    /// last seen, with the token it should ask for; `None` when it was not seen takeable.
    pub(crate) fn takeover(
        &self,
        (key, fence, kept_key): (&str, &str, &str),
        desired: &LeaderElectionRecord,
    ) -> Option<Takeover> {
        let (fence_token, fence_revision) = self.fence?;
        let mut conditions = Vec::with_capacity(3);
        let extensions = match self.record.as_ref()? {
            // Gone with its holder's etcd lease: the extensions it carried are in the
            // extensions key, which must still be as read.
            RecordSeen::Absent => {
                let (kept, kept_revision) = self.kept.clone()?;
                conditions.push(Compare::create_revision(key, CompareOp::Equal, 0));
                conditions.push(Compare::mod_revision(
                    kept_key,
                    CompareOp::Equal,
                    kept_revision,
                ));
                kept
            }
            RecordSeen::Present {
                mod_revision,
                record,
                ..
            } => {
                if !record.is_free() || record.reserved_for_other_than(&desired.holder_identity) {
                    return None;
                }
                conditions.push(Compare::mod_revision(key, CompareOp::Equal, *mod_revision));
                record.extensions.clone()
            }
        };
        // The fence must be as read too: an acquisition since then raised it.
        conditions.push(Compare::mod_revision(
            fence,
            CompareOp::Equal,
            fence_revision,
        ));
        // At least the floor the elector asks for.
        let wanted = (fence_token + 1).max(desired.leader_transitions);
        Some(Takeover {
            conditions,
            wanted,
            extensions,
        })
    }
}

impl Seen {
    /// The conditions under which `desired` may take again the record `key` (fenced by
    /// `fence`) that it holds, as last seen, on etcd lease `lease` (a term its holder no longer
    /// counts, say, on a lease only this lock's shard set member has), with the next token;
    /// `None` when it was not seen so.
    pub(crate) fn retake(
        &self,
        (key, fence): (&str, &str),
        lease: i64,
        desired: &LeaderElectionRecord,
    ) -> Option<Takeover> {
        let (fence_token, fence_revision) = self.fence?;
        let Some(RecordSeen::Present {
            mod_revision,
            lease: on,
            record,
            ..
        }) = &self.record
        else {
            return None;
        };
        if *on != lease || record.holder_identity != desired.holder_identity {
            return None;
        }
        Some(Takeover {
            conditions: vec![
                Compare::mod_revision(key, CompareOp::Equal, *mod_revision),
                Compare::lease(key, CompareOp::Equal, lease),
                Compare::mod_revision(fence, CompareOp::Equal, fence_revision),
            ],
            wanted: (fence_token + 1).max(desired.leader_transitions),
            extensions: record.extensions.clone(),
        })
    }
}

/// A takeover of the record as last seen: the conditions that it is still so, the token to ask
/// for, and the stored extensions to keep (only a holder writes them).
#[derive(Debug)]
pub(crate) struct Takeover {
    pub(crate) conditions: Vec<Compare>,
    pub(crate) wanted: u64,
    pub(crate) extensions: BTreeMap<String, String>,
}
