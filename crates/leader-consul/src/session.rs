//! The candidate's Consul session: created to lock the key, destroyed once the key is let go.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use leader_core::LockError;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::error::BACKEND;
use crate::store::ConsulStore;
use crate::sweeper::Due;

/// The longest lock-delay Consul applies (`MaxLockDelay`).
const LOCK_DELAY_MAX: Duration = Duration::from_secs(60);

/// The lock-delay of a session that locks a key with lease `lease`: the lease, at most
/// Consul's 60 s.
///
/// Consul puts a key under its session's lock-delay when the session is invalidated while it
/// holds the key (`deleteSessionTxn`: an operator's destroy, the node deregistered when its
/// agent leaves or is force-left), and never after an explicit `unlock`, so a release still
/// hands over at once. The lock's own candidates do not need it: they take a key whose
/// session was invalidated only a lease after they first read it unlocked, by which time the
/// holder, whose last renewal started before the invalidation, has stopped (renew deadline <
/// lease). It keeps other clients off the key for as long: earlier versions of this lock and
/// `consul lock`, which lock a key the moment its session is gone.
pub(crate) fn lock_delay(lease: Duration) -> Duration {
    lease.min(LOCK_DELAY_MAX)
}

/// This lock object's session, while it has one. Dropping the lock leaves it (a dropped lock
/// never writes): the candidate that takes the key over next destroys it.
#[derive(Debug, Default)]
pub(crate) struct SessionSlot {
    id: Mutex<Option<String>>,
}

impl SessionSlot {
    pub(crate) fn get(&self) -> Option<String> {
        self.id.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set(&self, id: String) {
        *self.id.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
    }

    /// Forgets `id` if it is still the current session; true if it was.
    pub(crate) fn forget(&self, id: &str) -> bool {
        let mut current = self.id.lock().unwrap_or_else(|p| p.into_inner());
        let was = current.as_deref() == Some(id);
        if was {
            *current = None;
        }
        was
    }

    /// Takes the session out, to destroy it.
    pub(crate) fn take(&self) -> Option<String> {
        self.id.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The name of the sessions that lock `key`: the key, then the candidate's identity.
fn name(key: &str, identity: &str) -> String {
    format!("leader {key} {identity}")
}

/// How long the sweeping task waits past the first sweep due for others to come due.
const SWEEP_GATHER: Duration = Duration::from_secs(1);

/// How many keys one read of a sweep asks for: a read-only transaction of that many
/// operations, under Consul's limit of 128.
const SWEEP_READ: usize = 64;

/// A lease after a term began (`ours` locked `key` at raft index `locked_at`), destroys the
/// sessions left for `key` that hold nothing (S9: bounded load on the server, here its
/// memory): named for the key, on the node of `ours`, created before that index, and not
/// `ours`. Such a session belongs to a process killed between creating it and locking the
/// key, or to a holder whose successor could not destroy it; without a TTL, Consul keeps it
/// until its node deregisters, and it has no cap on sessions (hashicorp/consul#5327).
///
/// A key is swept only while `ours` still locks it: then no other session holds it, so no
/// session destroyed holds a key (a candidate that kept its session after a take that timed
/// out, and took the key with it once this term ended, keeps it). The node's sessions alone
/// are listed (`/v1/session/node/NODE`): sessions left on other nodes are swept by holders
/// that run there, and go with their node.
pub(crate) fn sweep_later(
    store: &ConsulStore,
    key: String,
    ours: String,
    locked_at: u64,
    after: Duration,
) {
    let sweeper = &store.inner.sweeper;
    let mut pending = sweeper.lock_pending();
    pending.keys.insert(
        key,
        Due {
            ours,
            locked_at,
            at: Instant::now() + after,
        },
    );
    if !pending.running {
        pending.running = true;
        tokio::spawn(sweep_while_due(store.clone()));
    }
}

/// The store's sweeping task: sweeps each key when due, until none is pending.
async fn sweep_while_due(store: ConsulStore) {
    loop {
        let next = {
            let mut pending = store.inner.sweeper.lock_pending();
            match pending.keys.values().map(|due| due.at).min() {
                Some(next) => next,
                None => {
                    pending.running = false;
                    return;
                }
            }
        };
        // Sweeps due within a second of each other are made together; later is always safe.
        tokio::time::sleep_until(next + SWEEP_GATHER).await;
        let due: Vec<(String, Due)> = {
            let mut pending = store.inner.sweeper.lock_pending();
            let now = Instant::now();
            let keys: Vec<String> = pending
                .keys
                .iter()
                .filter(|(_, due)| due.at <= now)
                .map(|(key, _)| key.clone())
                .collect();
            keys.into_iter()
                .filter_map(|key| pending.keys.remove_entry(&key))
                .collect()
        };
        for batch in due.chunks(SWEEP_READ) {
            sweep(&store, batch).await;
        }
    }
}

/// Sweeps `due`'s keys: reads which session locks each, lists the sessions of the node, and
/// destroys those left for a key that its term's session still locks.
async fn sweep(store: &ConsulStore, due: &[(String, Due)]) {
    let Some((_, first)) = due.first() else {
        return;
    };
    let ops: Vec<Value> = due
        .iter()
        .map(|(key, _)| json!({"KV": {"Verb": "get-or-empty", "Key": key}}))
        .collect();
    let context = format!("{} sweep", store.address());
    let locked: HashMap<String, String> = match store.txn(&context, &ops).await {
        Ok(Ok(results)) => results
            .iter()
            .filter_map(|r| {
                Some((
                    r["KV"]["Key"].as_str()?.to_owned(),
                    r["KV"]["Session"].as_str()?.to_owned(),
                ))
            })
            .collect(),
        Ok(Err(body)) => {
            tracing::debug!(%body, "could not read the keys to sweep");
            return;
        }
        Err(err) => {
            tracing::debug!(error = %err, "could not read the keys to sweep");
            return;
        }
    };
    let still_ours: Vec<&(String, Due)> = due
        .iter()
        .filter(|(key, due)| locked.get(key) == Some(&due.ours))
        .collect();
    if still_ours.is_empty() {
        return;
    }
    let Some(node) = node_of(store, &first.ours).await else {
        return;
    };
    let path = format!("/v1/session/node/{}", crate::key::encode_key(&node));
    let context = format!("{} session list of node {node}", store.address());
    let answer = match store
        .send(&context, Method::GET, &path, &[], None, Duration::ZERO)
        .await
    {
        Ok(answer) if answer.code == StatusCode::OK => answer,
        Ok(answer) => {
            let err = store.refused(&context, &answer);
            tracing::warn!(error = %err, "could not list Consul sessions to destroy those left behind (the token needs session read)");
            return;
        }
        Err(err) => {
            tracing::debug!(error = %err, "could not list Consul sessions");
            return;
        }
    };
    let Ok(Value::Array(sessions)) = serde_json::from_str::<Value>(&answer.body) else {
        return;
    };
    for (key, due) in still_ours {
        let prefix = name(key, "");
        for left in sessions.iter().filter(|s| {
            s["Name"].as_str().is_some_and(|n| n.starts_with(&prefix))
                && s["CreateIndex"].as_u64().is_some_and(|i| i < due.locked_at)
                && s["ID"].as_str() != Some(due.ours.as_str())
        }) {
            if let Some(id) = left["ID"].as_str() {
                tracing::info!(
                    key,
                    session = id,
                    "destroying a Consul session left behind for this key"
                );
                destroy(store, id).await;
            }
        }
    }
}

/// The node that session `id` belongs to, as every session of the store does: the store's
/// session node, or the one Consul says (asked once).
async fn node_of(store: &ConsulStore, id: &str) -> Option<String> {
    if let Some(node) = &store.inner.session_node {
        return Some(node.clone());
    }
    let pending = || store.inner.sweeper.lock_pending();
    let known = pending().node.clone();
    if known.is_some() {
        return known;
    }
    let session = info(store, id).await.ok()??;
    let node = session["Node"].as_str()?.to_owned();
    pending().node = Some(node.clone());
    Some(node)
}

/// Session `id` as `GET /v1/session/info/ID` shows it; `None` when Consul no longer knows it.
async fn info(store: &ConsulStore, id: &str) -> Result<Option<Value>, LockError> {
    let context = format!("{} session info", store.address());
    let answer = store
        .send(
            &context,
            Method::GET,
            &format!("/v1/session/info/{id}"),
            &[],
            None,
            Duration::ZERO,
        )
        .await?;
    if answer.code != StatusCode::OK {
        return Err(store.refused(&context, &answer));
    }
    let mut info: Value = serde_json::from_str(&answer.body)
        .map_err(|err| LockError::other(BACKEND, format!("{context}: {err}")))?;
    Ok(info
        .as_array_mut()
        .filter(|list| !list.is_empty())
        .map(|list| list.swap_remove(0)))
}

/// Whether Consul ends session `id` by itself: a TTL, or a health check (node or service) that
/// invalidates it once critical. `None` when the answer does not hold it: Consul no longer
/// knows it (it has ended, and what it locked is unlocked), or the ACL token may not read it
/// (Consul leaves it out of the answer, `filterACLWithAuthorizer`). A session with neither, as this lock's own are, ends only by an
/// explicit destroy or with its node's deregistration, so nothing in the store tells whether
/// its holder is alive: only the holder's writes do. A session's TTL and checks are set when
/// it is created and never change.
pub(crate) async fn ends_by_itself(
    store: &ConsulStore,
    id: &str,
) -> Result<Option<bool>, LockError> {
    let Some(session) = info(store, id).await? else {
        return Ok(None);
    };
    // `TTL` is a Go duration string, empty or zero (`0s`) for none, as `session_ttl.go` reads
    // it: a duration is zero when every digit is.
    let ttl = session["TTL"]
        .as_str()
        .is_some_and(|ttl| ttl.chars().any(|c| c.is_ascii_digit() && c != '0'));
    let checked = ["Checks", "NodeChecks", "ServiceChecks"]
        .iter()
        .any(|field| {
            session[field]
                .as_array()
                .is_some_and(|list| !list.is_empty())
        });
    Ok(Some(ttl || checked))
}

/// Creates a session for `identity` on `key`, locking a key of lease `lease`: no TTL (nothing
/// but an explicit destroy or the node's deregistration ends it: the lock's renewals are
/// writes that candidates see, so no session timer decides who leads), no health checks
/// (`Checks: []`, which `fixupEmptySessionChecks` turns into no node checks either, on every
/// Consul version), behaviour `release`, and [`lock_delay`].
pub(crate) async fn create(
    store: &ConsulStore,
    key: &str,
    identity: &str,
    lease: Duration,
) -> Result<String, LockError> {
    let mut body = json!({
        "Name": name(key, identity),
        "LockDelay": format!("{}ms", lock_delay(lease).as_millis()),
        "Behavior": "release",
        "Checks": [],
    });
    if let Some(node) = &store.inner.session_node {
        body["Node"] = json!(node);
    }
    let context = format!("{} session create", store.address());
    let answer = store
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
        return Err(store.refused(&context, &answer));
    }
    let created: Value = serde_json::from_str(&answer.body)
        .map_err(|err| LockError::other(BACKEND, format!("{context}: {err}")))?;
    created["ID"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| LockError::other(BACKEND, format!("{context}: no session ID")))
}

/// Destroys session `id`, best effort: an invalidation, which releases what it still holds.
pub(crate) async fn destroy(store: &ConsulStore, id: &str) {
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
    match answer {
        Err(err) => tracing::debug!(error = %err, "could not destroy the Consul session"),
        // A refusal (an ACL without session write) leaves sessions that only a node's
        // deregistration ends: say so.
        Ok(answer) if answer.code != StatusCode::OK => {
            let err = store.refused("session destroy", &answer);
            tracing::warn!(session = id, error = %err, "could not destroy a Consul session; it stays until its node deregisters");
        }
        Ok(_) => {}
    }
}
