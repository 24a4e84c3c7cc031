//! The lock: one KV key per election holding the record, locked by the holder's session, and a
//! renewal key beside it that the holder writes at every renewal.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures_util::StreamExt;
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};
use serde_json::{Value, json};

use crate::error::{BACKEND, Refusal, acl_rules, refusal};
use crate::key::{RENEWAL_SUFFIX, check_name, encode_key};
use crate::session::{self, SessionSlot};
use crate::store::ConsulStore;

mod txn;
mod watcher;

pub(crate) use txn::RENEWAL_OPS;
use txn::*;
use watcher::*;

/// How long a follower's blocking query waits on the server before it asks again.
const WAIT: Duration = Duration::from_secs(60);

impl ConsulStore {
    /// A lock on election `name` (the key `PREFIX` + `name`) for candidate `identity`.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] for a name whose key Consul's KV API would refuse (a
    /// character other than letters, digits and `,-_./`, an empty, `.` or `..` segment, an
    /// ending such as `.json`), naming the rule and a name that would do; and for a name with
    /// a segment starting with `.`, kept for the lock's renewal keys.
    pub fn lock(
        &self,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Result<ConsulLock, LockError> {
        let name = name.into();
        check_name(&self.inner.prefix, &name)?;
        let key = format!("{}{name}", self.inner.prefix);
        Ok(ConsulLock {
            context: format!("{} key {key}", self.inner.address),
            path: format!("/v1/kv/{}", encode_key(&key)),
            renewal_key: format!("{key}{RENEWAL_SUFFIX}"),
            key,
            name,
            store: self.clone(),
            identity: identity.into(),
            session: Arc::default(),
            known: Arc::default(),
        })
    }
}

/// What the renewal key holds: the session that wrote it, and the time of that renewal.
fn renewal_of(renewal: &Entry) -> (Option<String>, Option<chrono::DateTime<chrono::Utc>>) {
    let Ok(value) = serde_json::from_slice::<Value>(&renewal.value) else {
        return (None, None);
    };
    (
        value["session"].as_str().map(str::to_owned),
        serde_json::from_value(value["renewTime"].clone()).ok(),
    )
}

/// A [`ResourceLock`] on one Consul KV key:
///
/// - The record is the key's JSON value. The holder locks the key with a Consul session of its
///   own (no TTL, no health checks, a lock-delay of the lease, at most 60 s), created when it
///   takes the key and destroyed when it lets it go.
/// - Every write is one transaction (`/v1/txn`) that checks the key's `ModifyIndex` (or that
///   it is absent): taking the key also checks the renewal key's index, deletes the key and
///   locks it anew with the taker's session, so that it takes over a key a dead holder's
///   session still locks; a release `unlock`s it; a write on the holder's behalf (a handover
///   request) is a `cas`, which keeps the holder's lock.
/// - A renewal is one transaction: the record's index checked, the renewal key
///   (`KEY/.renewal`) written. The record key does not change, so followers' blocking queries
///   do not wake for renewals; the pair of indexes, which is the lock's [`Version`], changes
///   at every renewal, so followers take over a holder that stopped renewing once that pair
///   has stayed the same for a lease since they read it (S2), as with any record renewed by
///   writes. A holder's session ends with its node or an operator's destroy; that unlocks the
///   key, which is a change like any other: candidates still wait a lease from when they read
///   it, and the holder, whose next renewal meets the changed index, has stopped by then.
/// - Followers watch the record key with blocking queries (`?index=&wait=`).
/// - Fencing tokens are the record's `leaderTransitions`, raised by one under the
///   compare-and-swap at every acquisition, and never below the highest this lock object has
///   seen (a snapshot restored, or the key deleted, would otherwise hand out a token again).
#[derive(Clone)]
pub struct ConsulLock {
    store: ConsulStore,
    key: String,
    /// The election's name: the key without the store's prefix.
    name: String,
    renewal_key: String,
    path: String,
    context: String,
    identity: String,
    session: Arc<SessionSlot>,
    known: Arc<Mutex<Known>>,
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

/// What this lock object learned of its keys.
#[derive(Debug, Default)]
struct Known {
    /// The highest fencing token it read or wrote.
    highest_token: u64,
    /// The record key's index it last read or wrote, and the session that locked it then.
    locked: Option<(u64, Option<String>)>,
    /// The last session seen locking the key that the renewal key did not name, and whether
    /// Consul ends it by itself ([`session::ends_by_itself`]).
    other_session: Option<(String, bool)>,
}

impl ConsulLock {
    /// The KV key that holds the record.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The KV key the holder writes at every renewal.
    pub fn renewal_key(&self) -> &str {
        &self.renewal_key
    }

    /// The ID of this candidate's Consul session, while it has one.
    pub fn session_id(&self) -> Option<String> {
        self.session.get()
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn invalid(&self, what: impl fmt::Display) -> LockError {
        LockError::invalid_record(BACKEND, format!("{}: {what}", self.context))
    }

    /// Remembers what a read or a write showed of the record key.
    fn note(&self, index: u64, session: Option<String>, token: u64) {
        let mut known = self.known();
        known.highest_token = known.highest_token.max(token);
        known.locked = Some((index, session));
    }

    /// The session that locked the record key at `index`, as this lock object last read or
    /// wrote it there.
    fn locker_at(&self, index: u64) -> Option<String> {
        self.known()
            .locked
            .clone()
            .filter(|(at, _)| *at == index)
            .and_then(|(_, locker)| locker)
    }

    /// `record` with a fencing token above every one this lock object has seen, for an
    /// acquisition.
    fn floored(&self, record: &LeaderElectionRecord) -> LeaderElectionRecord {
        let highest = self.known().highest_token;
        let mut record = record.clone();
        if record.leader_transitions <= highest {
            record.leader_transitions = highest + 1;
        }
        record
    }

    /// Runs a transaction; a 409 is a conflict, or `Forbidden` for an operation the ACL token
    /// may not do.
    async fn txn(&self, ops: &[Value]) -> Result<Vec<Value>, LockError> {
        match self.store.txn(&self.context, ops).await? {
            Ok(results) => Ok(results),
            Err(body) => match refusal(&self.context, self.store.prefix(), ops, &body) {
                Refusal::Denied(err) | Refusal::Unsupported(err) => Err(err),
                Refusal::InvalidSession => {
                    // Consul no longer knows the session: a new one next time.
                    for id in ops.iter().filter_map(|op| op["KV"]["Session"].as_str()) {
                        self.session.forget(id);
                    }
                    Err(LockError::conflict(BACKEND))
                }
                Refusal::Conflict => Err(LockError::conflict(BACKEND)),
            },
        }
    }

    /// The `ModifyIndex` a transaction's results give `key` last (after its writes; 0 when
    /// absent).
    fn index_in(&self, results: &[Value], key: &str) -> Result<u64, LockError> {
        results
            .iter()
            .rev()
            .find(|r| r["KV"]["Key"].as_str() == Some(key))
            .and_then(|r| r["KV"]["ModifyIndex"].as_u64())
            .ok_or_else(|| self.invalid(format!("a transaction answer without {key}")))
    }

    fn entry(&self, entry: &Value) -> Result<Option<Entry>, LockError> {
        let modify_index = entry["ModifyIndex"]
            .as_u64()
            .ok_or_else(|| self.invalid("no ModifyIndex"))?;
        // `get-or-empty` answers a missing key with the operation itself: index 0.
        if modify_index == 0 {
            return Ok(None);
        }
        let value = match &entry["Value"] {
            Value::String(encoded) => BASE64
                .decode(encoded)
                .map_err(|err| self.invalid(format!("a value that is not base64: {err}")))?,
            _ => Vec::new(),
        };
        Ok(Some(Entry {
            modify_index,
            session: entry["Session"]
                .as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
            value,
        }))
    }

    /// Whether Consul ends `locker`, a session that locks the key without the renewal key
    /// naming it, by itself (another client's, or an earlier version's, that renews its session
    /// instead of writing): then only Consul frees the key. A session that nothing but a
    /// destroy ends (this lock's own, whose renewal key was deleted or overwritten by hand) is
    /// judged by the holder's writes instead, as any record renewed by writes: otherwise the
    /// key of a holder that died would stay locked until its node left. Asked once per session
    /// (its TTL and checks never change); when Consul cannot say (an error, or a session the
    /// ACL token may not read: `session:read` on its node), the key is taken as held in the
    /// store, which waits instead of risking a second holder.
    async fn ends_by_itself(&self, locker: &str) -> bool {
        if let Some((id, ends)) = &self.known().other_session
            && id == locker
        {
            return *ends;
        }
        match session::ends_by_itself(&self.store, locker).await {
            Ok(Some(ends)) => {
                self.known().other_session = Some((locker.to_owned(), ends));
                ends
            }
            // No such session in the answer: one that has ended (the key is unlocked by now,
            // and the next read shows it), or one the token may not read (Consul filters the
            // answer by the ACL, with no error). Either way not judged by writes.
            Ok(None) => true,
            Err(err) => {
                tracing::debug!(key = %self.key, error = %err, "could not read the session that locks the key");
                true
            }
        }
    }

    /// Reads both keys in one read-only transaction: the record key and the renewal key.
    async fn read(&self) -> Result<(Option<Entry>, Option<Entry>), LockError> {
        let results = self
            .txn(&[
                op("get-or-empty", &self.key),
                op("get-or-empty", &self.renewal_key),
            ])
            .await?;
        let find = |key: &str| {
            results
                .iter()
                .find(|r| r["KV"]["Key"].as_str() == Some(key))
                .ok_or_else(|| LockError::Forbidden {
                    backend: BACKEND,
                    message: format!(
                        "{}: Consul left {key:?} out of the answer: the ACL token may not read it (key:read); {}",
                        self.context,
                        acl_rules(self.store.prefix())
                    ),
                })
        };
        let record = self.entry(&find(&self.key)?["KV"])?;
        let renewal = self.entry(&find(&self.renewal_key)?["KV"])?;
        Ok((record, renewal))
    }

    /// The record and version of what [`read`](Self::read) found, noting it. The record's
    /// `renew_time` is the last renewal's, from the renewal key, while the session that locks
    /// the record writes it: renewals leave the record key as it is, and people who read the
    /// record (`leader status`, a shard set's view) would see a live holder as expired.
    fn observed(&self, record: &Entry, renewal: Option<&Entry>) -> Result<Observed, LockError> {
        let mut stored = LeaderElectionRecord::from_json(BACKEND, &self.context, &record.value)?;
        if let Some((session, Some(renewed))) = renewal.map(renewal_of)
            && session.is_some()
            && session == record.session
        {
            stored.renew_time = stored.renew_time.max(renewed);
        }
        self.note(
            record.modify_index,
            record.session.clone(),
            stored.leader_transitions,
        );
        Ok(Observed {
            record: stored,
            version: Indexes {
                record: record.modify_index,
                renewal: renewal.map_or(0, |r| r.modify_index),
            }
            .version(),
        })
    }

    /// The renewal key's value: the session it renews, the time (what [`get`](ResourceLock::get)
    /// reports as the record's `renewTime`), and the renewal key's index it replaces (`after`).
    /// No two writes can store the same bytes: a value is written at an index above the one
    /// it names, and Consul's indexes only grow, so Consul never skips a renewal as identical
    /// (`kvsSetTxn`) whatever the holder's wall clock reads (S14).
    fn renewal_value(session: &str, record: &LeaderElectionRecord, after: u64) -> String {
        BASE64.encode(
            json!({"session": session, "renewTime": record.renew_time, "after": after}).to_string(),
        )
    }

    /// This candidate's session, created for `record`'s lease if it has none.
    async fn session_for(&self, record: &LeaderElectionRecord) -> Result<String, LockError> {
        if let Some(id) = self.session.get() {
            return Ok(id);
        }
        let id = session::create(
            &self.store,
            &self.key,
            &self.identity,
            record.lease_duration,
        )
        .await?;
        self.session.set(id.clone());
        Ok(id)
    }

    /// Destroys this candidate's session, which holds nothing.
    async fn drop_session(&self) {
        if let Some(id) = self.session.take() {
            session::destroy(&self.store, &id).await;
        }
    }
}

#[async_trait]
impl ResourceLock for ConsulLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let (record, renewal) = self.read().await?;
        record
            .map(|record| self.observed(&record, renewal.as_ref()))
            .transpose()
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        if record.is_held_by(&self.identity) {
            return self.take(None, record).await;
        }
        let value = BASE64.encode(record.to_json());
        let results = self
            .txn(&[
                op("check-not-exists", &self.key),
                json!({"KV": {"Verb": "set", "Key": self.key, "Value": value}}),
                op("get-or-empty", &self.renewal_key),
            ])
            .await?;
        let index = self.index_in(&results, &self.key)?;
        self.note(index, None, record.leader_transitions);
        self.written(record, index, &results)
    }

    /// Takes the key for a record that names this candidate, unlocks it for a free record
    /// this candidate's session holds (a release, which destroys the session after), and
    /// otherwise writes it keeping whoever holds it (a handover request).
    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let at = Indexes::of(version)?;
        let ours = self.session.get();
        let held_by_us = ours.is_some() && self.locker_at(at.record) == ours;
        if record.is_held_by(&self.identity) {
            // An acquisition gets a token above every one seen; a term of its own keeps its.
            let record = if held_by_us {
                record.clone()
            } else {
                self.floored(record)
            };
            return self.take(Some(at), &record).await;
        }
        if record.is_free()
            && let Some(session) = ours
        {
            match self.write(at, record, "unlock", Some(&session)).await {
                Ok(released) => {
                    self.drop_session().await;
                    return Ok(released);
                }
                // A session that no longer holds the key: write it as anyone would.
                Err(err) if err.is_conflict() => {}
                Err(err) => return Err(err),
            }
        }
        self.write(at, record, "cas", None).await
    }

    /// One transaction: the record key's index and its lock by this candidate's session
    /// checked, the renewal key written. A conflict once anyone else wrote the record (a
    /// handover request, a takeover), or Consul ended the session (an operator's destroy, the
    /// node deregistered), which unlocks the key: the key is then under the session's
    /// lock-delay for a lease, so the term ends at its renew deadline, and candidates take
    /// the key only a lease after they read it unlocked.
    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let results = self.txn(&self.renewal_ops(version, record)?).await?;
        self.renewed(&results, version, record)
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("consul:{}", self.key)
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let watcher = Watcher {
            store: self.store.clone(),
            path: self.path.clone(),
            context: self.context.clone(),
        };
        let (entry, index) = watcher.read(&[], Duration::ZERO).await?;
        let first = Wake::of(entry.as_ref());
        let stream = futures_util::stream::unfold(
            (watcher, first, index),
            |(watcher, mut seen, mut index)| async move {
                loop {
                    let query = [
                        ("index", index.to_string()),
                        ("wait", format!("{}s", WAIT.as_secs())),
                    ];
                    // Consul adds up to wait/16 of jitter.
                    let Ok((entry, next)) = watcher.read(&query, WAIT + WAIT / 16).await else {
                        return None;
                    };
                    // An index that went backwards (a restored snapshot) starts over, with a
                    // read that does not block.
                    index = if next < index { 0 } else { next };
                    let now = Wake::of(entry.as_ref());
                    if now != seen {
                        seen = now;
                        return Some(((), (watcher, seen, index)));
                    }
                }
            },
        );
        Ok(Some(stream.boxed()))
    }

    /// Takes an absent key, or a free one nobody locks (unless a handover request names
    /// another candidate); reports anything else held. A key a session locks is held by the
    /// store when that session is not the one the renewal key names and Consul ends it by
    /// itself (an earlier version of this lock, or another client, whose holder renews its
    /// session instead of writing): only Consul's expiry of that session frees it. Otherwise
    /// candidates wait out the lease on
    /// their own clock from the pair of indexes they read (S2), also for a key this very lock
    /// object holds (the elector takes a term it started again with an update).
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let (record, renewal) = self.read().await?;
        let Some(record) = record else {
            let mut taken = desired.clone();
            taken.leader_transitions = taken.leader_transitions.max(1);
            taken.extensions.clear();
            let at = Indexes {
                record: 0,
                renewal: renewal.map_or(0, |r| r.modify_index),
            };
            let taken = self.take(Some(at), &self.floored(&taken)).await?;
            return Ok(Some(Acquisition::Acquired(taken)));
        };
        let observed = self.observed(&record, renewal.as_ref())?;
        let ours = self.session.get();
        let locked_by_us = record.session.is_some() && record.session == ours;
        if let Some(locker) = &record.session {
            if !locked_by_us {
                // Its session holds nothing of this key.
                self.drop_session().await;
            }
            let renewer = renewal.as_ref().and_then(|r| renewal_of(r).0);
            let renewed_in_store =
                renewer.as_deref() != Some(locker.as_str()) && self.ends_by_itself(locker).await;
            return Ok(Some(Acquisition::Held {
                observed,
                expires_in: None,
                renewed_in_store,
            }));
        }
        if !observed.record.is_free() || observed.record.reserved_for_other_than(&self.identity) {
            return Ok(Some(Acquisition::Held {
                observed,
                expires_in: None,
                renewed_in_store: false,
            }));
        }
        let mut taken = desired.clone();
        // At least the floor the elector asks for; the stored extensions, not the candidate's
        // (only a holder writes them).
        taken.leader_transitions = desired
            .leader_transitions
            .max(observed.record.leader_transitions + 1);
        taken.extensions = observed.record.extensions.clone();
        taken.preferred_holder = None;
        let at = Indexes::of(&observed.version)?;
        let taken = self.take(Some(at), &self.floored(&taken)).await?;
        Ok(Some(Acquisition::Acquired(taken)))
    }

    /// Destroys this candidate's session, which releases the key if it still holds it.
    async fn close(&self) {
        self.drop_session().await;
    }
}
