//! The lock: one KV key per election, locked by the holder's session.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures_util::StreamExt;
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::error::BACKEND;
use crate::store::{Answer, ConsulStore};

/// The shortest session TTL Consul accepts.
const TTL_MIN: u64 = 10;
/// The longest session TTL Consul accepts (24 h).
const TTL_MAX: u64 = 24 * 3600;
/// The longest lock-delay Consul applies.
const LOCK_DELAY_MAX: Duration = Duration::from_secs(60);
/// How long a follower's blocking query waits on the server before it asks again.
const WAIT: Duration = Duration::from_secs(60);

impl ConsulStore {
    /// A lock on election `name` (the key `PREFIX` + `name`) for candidate `identity`.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> ConsulLock {
        let name = name.into();
        let key = format!("{}{name}", self.inner.prefix);
        ConsulLock {
            context: format!("{} key {key}", self.inner.address),
            path: format!("/v1/kv/{}", encode_key(&key)),
            key,
            store: self.clone(),
            identity: identity.into(),
            session: Arc::new(SessionSlot {
                id: Mutex::new(None),
            }),
            holding: Arc::default(),
        }
    }
}

/// Percent-encodes a key for the URL path, keeping its slashes.
fn encode_key(key: &str) -> String {
    let mut encoded = String::with_capacity(key.len());
    for byte in key.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~/".contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// A [`ResourceLock`] on one Consul KV key:
///
/// - Each candidate has a session of its own, created when it first tries to take the key,
///   with a TTL of the lease duration (at least Consul's 10 s), behaviour `release`, no health
///   checks unless [`node_checks`](crate::ConsulStoreBuilder::node_checks) are given, and a
///   lock-delay of 0 (of the lease duration with checks).
/// - The record is the key's JSON value. Every write is a transaction (`/v1/txn`) that checks
///   the key's `ModifyIndex` (or that it is absent) and then locks it with the writer's session
///   (`lock`), unlocks it (`unlock`, a release) or sets it keeping the holder's session (`cas`,
///   a handover request written on the holder's behalf): the compare-and-swap and the lock are
///   one atomic step.
/// - The holder renews its session (`/v1/session/renew`): one request per renewal, not a write,
///   so followers' blocking queries do not wake. Its own blocking query on the key (one
///   request a minute while nothing changes) tells it of any write since its own; after one,
///   or while that query is not running, a renewal also reads the key to check it still holds
///   that version.
/// - `try_acquire` goes by Consul's own expiry: a key locked by a live session is held (Consul
///   invalidates a session between one and two TTLs after its last renewal, and releases its
///   keys); an unlocked one is taken.
/// - Followers watch the key with blocking queries (`?index=&wait=`) and wake when the lock is
///   released, lost or asked to hand over, not on renewals.
/// - Fencing tokens are the record's `leaderTransitions`, raised by one under the
///   compare-and-swap at every acquisition.
#[derive(Clone)]
pub struct ConsulLock {
    store: ConsulStore,
    key: String,
    path: String,
    context: String,
    identity: String,
    session: Arc<SessionSlot>,
    holding: Arc<Holding>,
}

impl fmt::Debug for ConsulLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsulLock")
            .field("store", &self.store)
            .field("key", &self.key)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// The candidate's session. Dropping the lock leaves it to its TTL (a dropped lock never
/// writes); [`ResourceLock::close`] destroys it.
struct SessionSlot {
    id: Mutex<Option<String>>,
}

impl SessionSlot {
    fn get(&self) -> Option<String> {
        self.id.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, id: Option<String>) {
        *self.id.lock().unwrap_or_else(|p| p.into_inner()) = id;
    }

    /// Forgets `id` if it is still the current session (Consul no longer knows it).
    fn forget(&self, id: &str) {
        let mut current = self.id.lock().unwrap_or_else(|p| p.into_inner());
        if current.as_deref() == Some(id) {
            *current = None;
        }
    }
}

/// The holder's watch of its key since its last write: while it runs and has seen no other
/// write, the key is still the version written, locked by this candidate's session.
#[derive(Default)]
struct Holding {
    watched: Mutex<Option<Watched>>,
}

struct Watched {
    /// The `ModifyIndex` of the holder's last write.
    index: u64,
    /// Set by the watch when the key moved on, or the watch stopped.
    moved: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Holding {
    fn set(&self, watched: Option<Watched>) {
        *self.watched.lock().unwrap_or_else(|p| p.into_inner()) = watched;
    }

    /// Forgets that the key is unchanged: the change stream saw a write, which the next
    /// renewal must read, whether or not the holder's own query has reported it yet.
    fn moved(&self) {
        if let Some(watched) = &*self.watched.lock().unwrap_or_else(|p| p.into_inner()) {
            watched.moved.store(true, Ordering::Release);
        }
    }

    /// Whether the key is known to be still at `index`.
    fn unchanged_since(&self, index: u64) -> bool {
        self.watched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|w| w.index == index && !w.moved.load(Ordering::Acquire))
    }
}

async fn destroy(store: &ConsulStore, id: &str) {
    let path = format!("/v1/session/destroy/{id}");
    let answer = store
        .send(
            "session destroy",
            Method::PUT,
            &path,
            &[],
            None,
            Duration::ZERO,
        )
        .await;
    if let Err(err) = answer {
        tracing::debug!(error = %err, "could not destroy the Consul session");
    }
}

/// The key as Consul returns it.
struct Entry {
    modify_index: u64,
    session: Option<String>,
    value: Vec<u8>,
}

impl ConsulLock {
    /// The KV key that holds the record.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The ID of this candidate's Consul session, while it has one.
    pub fn session_id(&self) -> Option<String> {
        self.session.get()
    }

    /// A reader of the key without this candidate's session or watch, for tasks that must not
    /// keep them after the lock is dropped.
    fn reader(&self) -> Self {
        Self {
            session: Arc::new(SessionSlot {
                id: Mutex::new(None),
            }),
            holding: Arc::default(),
            ..self.clone()
        }
    }

    /// Watches the key as its holder from `index`, the `ModifyIndex` of this candidate's write
    /// that locked it with `session`, until it moves on.
    fn hold(&self, index: u64, session: String) {
        let moved = Arc::new(AtomicBool::new(false));
        let reader = self.reader();
        let flag = moved.clone();
        let task = tokio::spawn(async move {
            let mut at = index;
            loop {
                let query = [
                    ("index", at.to_string()),
                    ("wait", format!("{}s", WAIT.as_secs())),
                ];
                match reader.read(&query, WAIT + WAIT / 16).await {
                    Ok((Some(entry), next))
                        if entry.modify_index == index
                            && entry.session.as_deref() == Some(session.as_str())
                            && next >= at =>
                    {
                        at = next;
                    }
                    _ => break,
                }
            }
            flag.store(true, Ordering::Release);
        });
        self.holding.set(Some(Watched { index, moved, task }));
    }

    fn invalid(&self, what: impl fmt::Display) -> LockError {
        LockError::invalid_record(BACKEND, format!("{}: {what}", self.context))
    }

    /// Reads the key: the entry, if any, and the index to block on next.
    async fn read(
        &self,
        query: &[(&str, String)],
        extra: Duration,
    ) -> Result<(Option<Entry>, u64), LockError> {
        let answer = self
            .store
            .send(&self.context, Method::GET, &self.path, query, None, extra)
            .await?;
        match answer.code {
            StatusCode::NOT_FOUND => Ok((None, answer.index)),
            StatusCode::OK => {
                let entries: Value = serde_json::from_str(&answer.body)
                    .map_err(|err| self.invalid(format!("an answer that is not JSON: {err}")))?;
                let entry = entries
                    .get(0)
                    .ok_or_else(|| self.invalid("an empty answer"))?;
                Ok((Some(self.entry(entry)?), answer.index))
            }
            _ => Err(self.store.refused(&self.context, &answer)),
        }
    }

    fn entry(&self, entry: &Value) -> Result<Entry, LockError> {
        let value = match &entry["Value"] {
            Value::String(encoded) => BASE64
                .decode(encoded)
                .map_err(|err| self.invalid(format!("a value that is not base64: {err}")))?,
            _ => Vec::new(),
        };
        Ok(Entry {
            modify_index: entry["ModifyIndex"]
                .as_u64()
                .ok_or_else(|| self.invalid("no ModifyIndex"))?,
            session: entry["Session"]
                .as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
            value,
        })
    }

    fn observed(&self, entry: &Entry) -> Result<Observed, LockError> {
        let record = LeaderElectionRecord::from_json(BACKEND, &self.context, &entry.value)?;
        Ok(Observed {
            record,
            version: Version::new(entry.modify_index.to_string()),
        })
    }

    /// This candidate's session, created with the lease's TTL if it has none.
    async fn session(&self, record: &LeaderElectionRecord) -> Result<String, LockError> {
        if let Some(id) = self.session.get() {
            return Ok(id);
        }
        let lease = record.lease_duration;
        let ttl = lease
            .as_secs()
            .saturating_add(u64::from(lease.subsec_nanos() > 0))
            .clamp(TTL_MIN, TTL_MAX);
        let checks = &self.store.inner.node_checks;
        let lock_delay = if checks.is_empty() {
            Duration::ZERO
        } else {
            lease.min(LOCK_DELAY_MAX)
        };
        let body = json!({
            "Name": format!("leader {} {}", self.key, self.identity),
            "TTL": format!("{ttl}s"),
            "LockDelay": format!("{}ms", lock_delay.as_millis()),
            "Behavior": "release",
            // Empty lists: no serfHealth check unless asked for.
            "Checks": [],
            "NodeChecks": checks,
        });
        let context = format!("{} session create", self.store.inner.address);
        let answer = self
            .store
            .send(
                &context,
                Method::PUT,
                "/v1/session/create",
                &[],
                Some(body.to_string().into_bytes()),
                Duration::ZERO,
            )
            .await?;
        if answer.code != StatusCode::OK {
            return Err(self.store.refused(&context, &answer));
        }
        let created: Value = serde_json::from_str(&answer.body)
            .map_err(|err| LockError::other(BACKEND, format!("{context}: {err}")))?;
        let id = created["ID"]
            .as_str()
            .ok_or_else(|| LockError::other(BACKEND, format!("{context}: no session ID")))?
            .to_owned();
        self.session.set(Some(id.clone()));
        Ok(id)
    }

    /// Runs a transaction of KV operations; `Ok(None)` when one of its checks failed (409).
    async fn txn(&self, ops: Vec<Value>) -> Result<Option<Vec<Value>>, LockError> {
        let body = Value::Array(ops).to_string().into_bytes();
        let answer: Answer = self
            .store
            .send(
                &self.context,
                Method::PUT,
                "/v1/txn",
                &[],
                Some(body),
                Duration::ZERO,
            )
            .await?;
        match answer.code {
            StatusCode::OK => {
                let result: Value = serde_json::from_str(&answer.body)
                    .map_err(|err| self.invalid(format!("a transaction answer: {err}")))?;
                Ok(Some(
                    result["Results"].as_array().cloned().unwrap_or_default(),
                ))
            }
            StatusCode::CONFLICT => {
                // A session Consul no longer knows fails the lock as "invalid session".
                if answer.body.contains("invalid session")
                    && let Some(id) = self.session.get()
                {
                    self.session.forget(&id);
                }
                Ok(None)
            }
            _ => Err(self.store.refused(&self.context, &answer)),
        }
    }

    /// Writes `record` after `check` (a `check-index` or `check-not-exists` operation): locked
    /// by this candidate's session when it names this candidate, unlocked when it is free and
    /// this session held the key, set keeping the holder's session otherwise.
    async fn write(
        &self,
        check: Value,
        record: &LeaderElectionRecord,
        held_by_us: bool,
    ) -> Result<Observed, LockError> {
        let value = BASE64.encode(record.to_json());
        self.holding.set(None);
        let mut locked_by = None;
        let write = if record.is_held_by(&self.identity) {
            let session = self.session(record).await?;
            locked_by = Some(session.clone());
            json!({"KV": {"Verb": "lock", "Key": self.key, "Value": value, "Session": session}})
        } else if record.is_free() && held_by_us {
            let session = self.session.get().unwrap_or_default();
            json!({"KV": {"Verb": "unlock", "Key": self.key, "Value": value, "Session": session}})
        } else {
            let index = check["KV"]["Index"].as_u64().unwrap_or(0);
            json!({"KV": {"Verb": "cas", "Key": self.key, "Value": value, "Index": index}})
        };
        let results = self
            .txn(vec![check, write])
            .await?
            .ok_or_else(|| LockError::conflict(BACKEND))?;
        let modify_index = results
            .iter()
            .rev()
            .find_map(|r| r["KV"]["ModifyIndex"].as_u64())
            .ok_or_else(|| self.invalid("a transaction answer without the key"))?;
        if let Some(session) = locked_by {
            self.hold(modify_index, session);
        }
        Ok(Observed {
            record: record.clone(),
            version: Version::new(modify_index.to_string()),
        })
    }

    fn index_of(&self, version: &Version) -> Result<u64, LockError> {
        version
            .as_str()
            .parse()
            .map_err(|_| LockError::conflict(BACKEND))
    }
}

fn check_index(key: &str, index: u64) -> Value {
    json!({"KV": {"Verb": "check-index", "Key": key, "Index": index}})
}

#[async_trait]
impl ResourceLock for ConsulLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let (entry, _) = self.read(&[], Duration::ZERO).await?;
        entry.map(|entry| self.observed(&entry)).transpose()
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let check = json!({"KV": {"Verb": "check-not-exists", "Key": self.key}});
        self.write(check, record, false).await
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let index = self.index_of(version)?;
        // Whether this candidate's session holds the key, for a release.
        let held_by_us = record.is_free() && self.session.get().is_some();
        let observed = self
            .write(check_index(&self.key, index), record, held_by_us)
            .await;
        match observed {
            // A release by a session that no longer holds the key: set it as any write.
            Err(err) if err.is_conflict() && held_by_us => {
                self.write(check_index(&self.key, index), record, false)
                    .await
            }
            other => other,
        }
    }

    /// Renews this candidate's session and, unless the holder's watch knows the key is still
    /// `version`, reads the key: a conflict when the session is gone or the key is no longer
    /// this version locked by it.
    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let Some(id) = self.session.get() else {
            return self.update(version, record).await;
        };
        let path = format!("/v1/session/renew/{id}");
        let context = format!("{} session renew", self.store.inner.address);
        let answer = self
            .store
            .send(&context, Method::PUT, &path, &[], None, Duration::ZERO)
            .await?;
        match answer.code {
            StatusCode::OK => {}
            StatusCode::NOT_FOUND => {
                self.session.forget(&id);
                return Err(LockError::conflict(BACKEND));
            }
            _ => return Err(self.store.refused(&context, &answer)),
        }
        let index = self.index_of(version)?;
        let renewed = Observed {
            record: record.clone(),
            version: version.clone(),
        };
        if self.holding.unchanged_since(index) {
            return Ok(renewed);
        }
        let (entry, _) = self.read(&[], Duration::ZERO).await?;
        match entry {
            Some(entry)
                if entry.session.as_deref() == Some(id.as_str()) && entry.modify_index == index =>
            {
                self.hold(index, id);
                Ok(renewed)
            }
            _ => Err(LockError::conflict(BACKEND)),
        }
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("consul:{}", self.key)
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let (entry, index) = self.read(&[], Duration::ZERO).await?;
        let first = Seen::of(entry.as_ref());
        let this = self.reader();
        let holding = Arc::downgrade(&self.holding);
        let stream = futures_util::stream::unfold(
            (this, first, index),
            move |(this, mut seen, mut index)| {
                let holding = holding.clone();
                async move {
                    loop {
                        let query = [
                            ("index", index.to_string()),
                            ("wait", format!("{}s", WAIT.as_secs())),
                        ];
                        // Consul adds up to wait/16 of jitter.
                        let read = this.read(&query, WAIT + WAIT / 16).await;
                        let Ok((entry, next)) = read else {
                            return None;
                        };
                        // An index that went backwards (a restored snapshot) starts over.
                        index = if next < index { 0 } else { next };
                        let now = Seen::of(entry.as_ref());
                        if now != seen {
                            seen = now;
                            if let Some(holding) = holding.upgrade() {
                                holding.moved();
                            }
                            return Some(((), (this, seen, index)));
                        }
                    }
                }
            },
        );
        Ok(Some(stream.boxed()))
    }

    /// Goes by Consul's expiry: a key locked by a live session is held; an absent or unlocked
    /// one (released, or its holder's session invalidated) is taken with a transaction.
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let (entry, _) = self.read(&[], Duration::ZERO).await?;
        let Some(entry) = entry else {
            let mut record = desired.clone();
            record.leader_transitions = record.leader_transitions.max(1);
            record.extensions.clear();
            let taken = self.create(&record).await?;
            return Ok(Some(Acquisition::Acquired(taken)));
        };
        let observed = self.observed(&entry)?;
        let ours = self.session.get();
        let locked_by_other = entry
            .session
            .as_ref()
            .is_some_and(|s| Some(s) != ours.as_ref());
        if locked_by_other || observed.record.reserved_for_other_than(&self.identity) {
            return Ok(Some(Acquisition::Held {
                renewed_in_store: locked_by_other,
                observed,
                expires_in: None,
            }));
        }
        let mut record = desired.clone();
        // At least the floor the elector asks for; the stored extensions, not the candidate's
        // (only a holder writes them).
        record.leader_transitions =
            (observed.record.leader_transitions + 1).max(desired.leader_transitions);
        record.extensions = observed.record.extensions.clone();
        record.preferred_holder = None;
        let taken = self
            .write(check_index(&self.key, entry.modify_index), &record, false)
            .await?;
        Ok(Some(Acquisition::Acquired(taken)))
    }

    /// Destroys this candidate's session, which releases the key if it still holds it.
    async fn close(&self) {
        self.holding.set(None);
        let id = self.session.get();
        if let Some(id) = id {
            self.session.forget(&id);
            destroy(&self.store, &id).await;
        }
    }
}

/// What followers wake for: the key's existence, its lock, its holder and a handover request.
#[derive(PartialEq, Eq)]
struct Seen {
    present: bool,
    session: Option<String>,
    holder: Option<String>,
    handover_to: Option<String>,
}

impl Seen {
    fn of(entry: Option<&Entry>) -> Self {
        let record =
            entry.and_then(|e| serde_json::from_slice::<LeaderElectionRecord>(&e.value).ok());
        Self {
            present: entry.is_some(),
            session: entry.and_then(|e| e.session.clone()),
            holder: record.as_ref().map(|r| r.holder_identity.clone()),
            handover_to: record.and_then(|r| r.handover_to().map(str::to_owned)),
        }
    }
}
