//! What the server keeps, as Consul's state store keeps it (`agent/consul/state/`): KV entries,
//! sessions, the catalog's nodes and their checks, the raft index, and the lock-delays the
//! leader keeps in memory.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::{MAX_LOCK_DELAY, SERF_HEALTH, SESSION_TTL_MULTIPLIER};

/// A KV entry (`structs.DirEntry`).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Entry {
    pub(super) create_index: u64,
    pub(super) modify_index: u64,
    pub(super) lock_index: u64,
    pub(super) flags: u64,
    pub(super) value: Vec<u8>,
    pub(super) session: Option<String>,
}

/// A session (`structs.Session`).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Session {
    pub(super) name: String,
    /// The node it belongs to; deregistering the node invalidates it (`deleteNodeTxn`).
    pub(super) node: String,
    /// The node's checks it is tied to (`Session.CheckIDs`): one turning critical invalidates
    /// it (`ensureCheckTxn`).
    pub(super) checks: Vec<String>,
    pub(super) ttl: Option<Duration>,
    pub(super) lock_delay: Duration,
    pub(super) delete: bool,
    pub(super) create_index: u64,
    /// When it is invalidated unless renewed.
    #[serde(skip)]
    pub(super) deadline: Option<Instant>,
}

impl Session {
    /// Starts the session's timer anew: it is invalidated `SESSION_TTL_MULTIPLIER` TTLs from
    /// now unless renewed (`resetSessionTimer`/`createSessionTimer` in `session_ttl.go`).
    pub(super) fn reset_timer(&mut self) {
        self.deadline = self
            .ttl
            .map(|ttl| Instant::now() + ttl * SESSION_TTL_MULTIPLIER);
    }

    pub(super) fn to_json(&self, id: &str) -> Value {
        json!({
            "ID": id, "Name": self.name, "Node": self.node,
            "LockDelay": u64::try_from(self.lock_delay.as_nanos()).unwrap_or(u64::MAX),
            "Behavior": if self.delete { "delete" } else { "release" },
            "TTL": self.ttl.map(|t| format!("{}s", t.as_secs())).unwrap_or_default(),
            "NodeChecks": self.checks, "ServiceChecks": null,
            "CreateIndex": self.create_index, "ModifyIndex": self.create_index,
        })
    }
}

/// A registered node and the status of its checks (`passing`, `warning`, `critical`).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct Node {
    pub(super) checks: BTreeMap<String, String>,
}

impl Node {
    /// A node as an agent registers itself: with its `serfHealth` check passing.
    pub(super) fn registered() -> Self {
        Self {
            checks: BTreeMap::from([(SERF_HEALTH.to_owned(), "passing".to_owned())]),
        }
    }
}

/// One KV write of a `PUT`, a `DELETE` or a transaction.
pub(super) enum Write<'a> {
    Set,
    Cas(u64),
    Lock(&'a str),
    Unlock(&'a str),
    Delete,
    DeleteCas(u64),
}

#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Data {
    /// The raft index of the last write.
    pub(super) index: u64,
    /// The KV table's index: its last write, deletions included.
    pub(super) kv_index: u64,
    pub(super) kv: BTreeMap<String, Entry>,
    pub(super) sessions: HashMap<String, Session>,
    #[serde(default)]
    pub(super) nodes: BTreeMap<String, Node>,
    /// Kept by the leader in memory only (`agent/consul/state/delay.go`), so a restart or a
    /// restored snapshot forgets them.
    #[serde(skip)]
    pub(super) lock_delays: HashMap<String, Instant>,
}

impl Data {
    pub(super) fn new() -> Self {
        Self {
            index: 1,
            kv_index: 1,
            ..Self::default()
        }
    }

    /// The data kept in `path`, or a new store if there is no such file; every session's
    /// timer starts anew.
    pub(super) fn load(path: &std::path::Path) -> std::io::Result<Self> {
        let mut data: Self = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Self::new()),
            Err(err) => return Err(err),
        };
        data.sessions.values_mut().for_each(Session::reset_timer);
        Ok(data)
    }

    /// Writes the data to `path` through a temporary file and a rename.
    pub(super) fn save(&self, path: &std::path::Path) -> std::io::Result<()> {
        let temporary = path.with_extension("tmp");
        std::fs::write(&temporary, serde_json::to_vec(self)?)?;
        std::fs::rename(&temporary, path)
    }

    /// The next raft index, taken by a write.
    pub(super) fn next_index(&mut self) -> u64 {
        self.index += 1;
        self.index
    }

    /// Invalidates session `id` at raft index `index` (`deleteSessionTxn` in
    /// `state/session.go`): the keys it holds are released (or deleted, for behaviour
    /// `delete`) and put under its lock-delay, capped at `MaxLockDelay`. Every way a session
    /// ends goes through here: its TTL (`invalidateSession` in `session_ttl.go` applies a
    /// `SessionDestroy`), an explicit destroy, its node deregistered (`deleteNodeTxn`) or one
    /// of its checks turning critical (`ensureCheckTxn`). An explicit `unlock` does not.
    pub(super) fn invalidate(&mut self, index: u64, id: &str) {
        let Some(session) = self.sessions.remove(id) else {
            return;
        };
        let delay = session.lock_delay.min(MAX_LOCK_DELAY);
        let held: Vec<String> = self
            .kv
            .iter()
            .filter(|(_, e)| e.session.as_deref() == Some(id))
            .map(|(k, _)| k.clone())
            .collect();
        for key in held {
            if session.delete {
                self.kv.remove(&key);
            } else if let Some(entry) = self.kv.get_mut(&key) {
                entry.session = None;
                entry.modify_index = index;
            }
            self.kv_index = index;
            if !delay.is_zero() {
                self.lock_delays.insert(key, Instant::now() + delay);
            }
        }
    }

    /// Deregisters `node` (`deleteNodeTxn` in `state/catalog.go`, which an agent's leave, a
    /// `force-leave` or `PUT /v1/catalog/deregister` come to): its checks go, and every
    /// session of the node is invalidated. `false` if no such node was registered.
    pub(super) fn deregister_node(&mut self, node: &str) -> bool {
        if self.nodes.remove(node).is_none() {
            return false;
        }
        let index = self.next_index();
        let ids: Vec<String> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.node == node)
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.invalidate(index, &id);
        }
        true
    }

    /// Sets a check of `node` (`ensureCheckTxn`): a check turning critical invalidates the
    /// sessions tied to it (`checkSessionsTxn`). `false` if the node is not registered.
    pub(super) fn set_check(&mut self, node: &str, check: &str, status: &str) -> bool {
        let Some(registered) = self.nodes.get_mut(node) else {
            return false;
        };
        registered
            .checks
            .insert(check.to_owned(), status.to_owned());
        let index = self.next_index();
        if status == "critical" {
            let ids: Vec<String> = self
                .sessions
                .iter()
                .filter(|(_, s)| s.node == node && s.checks.iter().any(|c| c == check))
                .map(|(id, _)| id.clone())
                .collect();
            for id in ids {
                self.invalidate(index, &id);
            }
        }
        true
    }

    /// Why a session of `node` tied to `checks` cannot be created, if it cannot
    /// (`sessionCreateTxn`, `validateSessionChecksTxn`).
    pub(super) fn refuse_session(&self, node: &str, checks: &[String]) -> Option<String> {
        let Some(registered) = self.nodes.get(node) else {
            return Some("Missing node registration".to_owned());
        };
        checks
            .iter()
            .find_map(|check| match registered.checks.get(check) {
                None => Some(format!("Missing check '{check}' registration")),
                Some(status) if status == "critical" => {
                    Some(format!("Check '{check}' is in critical state"))
                }
                Some(_) => None,
            })
    }

    /// Whether `key` is under a lock-delay (`KVSLockDelay`).
    pub(super) fn lock_delayed(&self, key: &str) -> bool {
        self.lock_delays
            .get(key)
            .is_some_and(|until| *until > Instant::now())
    }

    /// The index a read of `key` reports: its `ModifyIndex`, or the KV table's for a missing
    /// key (`KVS.Get`; never 0: `SetQueryMeta`).
    pub(super) fn read_index(&self, key: &str) -> u64 {
        self.kv
            .get(key)
            .map_or(self.kv_index, |e| e.modify_index)
            .max(1)
    }

    /// Applies `write` to `key` at `index` (`kvsSetTxn`, `kvsSetCASTxn`, `kvsLockTxn`,
    /// `kvsUnlockTxn`, `kvsDeleteTxn`, `kvsDeleteCASTxn` in `state/kvs.go`): `Ok(true)` when
    /// done, `Ok(false)` when its condition failed, `Err` for an error (a missing or unknown
    /// session). Nothing changes unless it succeeds. The entry takes the write's flags; a set
    /// or a check-and-set keeps the holder's session.
    pub(super) fn apply(
        &mut self,
        index: u64,
        key: &str,
        value: &[u8],
        flags: u64,
        write: &Write<'_>,
    ) -> Result<bool, String> {
        let existing = self.kv.get(key).cloned();
        let mut session = existing.as_ref().and_then(|e| e.session.clone());
        let mut lock_index = existing.as_ref().map_or(0, |e| e.lock_index);
        match write {
            Write::Set => {}
            Write::Cas(0) if existing.is_some() => return Ok(false),
            Write::Cas(wanted) if *wanted != 0 => {
                if existing.as_ref().is_none_or(|e| e.modify_index != *wanted) {
                    return Ok(false);
                }
            }
            Write::Cas(_) => {}
            Write::Lock(id) => {
                if id.is_empty() {
                    return Err("missing session".to_owned());
                }
                if !self.sessions.contains_key(*id) {
                    return Err(format!("invalid session \"{id}\""));
                }
                match session.as_deref() {
                    Some(holder) if holder == *id => {}
                    Some(_) => return Ok(false),
                    None => lock_index += 1,
                }
                session = Some((*id).to_owned());
            }
            Write::Unlock(id) => {
                if id.is_empty() {
                    return Err("missing session".to_owned());
                }
                if session.as_deref() != Some(*id) {
                    return Ok(false);
                }
                session = None;
            }
            Write::Delete => {
                self.kv.remove(key);
                self.kv_index = index;
                return Ok(true);
            }
            Write::DeleteCas(wanted) => {
                if existing.as_ref().is_none_or(|e| e.modify_index != *wanted) {
                    return Ok(false);
                }
                self.kv.remove(key);
                self.kv_index = index;
                return Ok(true);
            }
        }
        // A write of what is stored already is skipped: the entry keeps its ModifyIndex and
        // no watch fires (`kvsSetTxn` returns early when `existing.Equal(entry)`, and
        // `DirEntry.Equal` compares LockIndex, Key, Flags, Value and Session alone).
        if existing.as_ref().is_some_and(|e| {
            e.lock_index == lock_index
                && e.flags == flags
                && e.value == value
                && e.session == session
        }) {
            return Ok(true);
        }
        self.kv.insert(
            key.to_owned(),
            Entry {
                create_index: existing.as_ref().map_or(index, |e| e.create_index),
                modify_index: index,
                lock_index,
                flags,
                value: value.to_vec(),
                session,
            },
        );
        self.kv_index = index;
        Ok(true)
    }

    /// The sessions whose deadline passed.
    pub(super) fn expired_sessions(&self) -> Vec<String> {
        let now = Instant::now();
        self.sessions
            .iter()
            .filter(|(_, s)| s.deadline.is_some_and(|d| d <= now))
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// An entry as the KV and transaction endpoints answer it: the value base64-encoded, or
/// `null` where the answer leaves values out (`txnKVS` blanks them but for `get`s).
pub(super) fn entry_json(key: &str, entry: &Entry, with_value: bool) -> Value {
    let mut body = json!({
        "LockIndex": entry.lock_index, "Key": key, "Flags": entry.flags,
        "Value": if with_value { json!(BASE64.encode(&entry.value)) } else { Value::Null },
        "CreateIndex": entry.create_index, "ModifyIndex": entry.modify_index,
    });
    if let Some(session) = &entry.session {
        body["Session"] = json!(session);
    }
    body
}
