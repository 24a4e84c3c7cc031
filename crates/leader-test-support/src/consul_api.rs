//! A Consul HTTP API server for tests (feature `consul-api`), serving what a session lock uses
//! with Consul's contract, each behaviour citing where it comes from in Consul's documentation
//! (`website/content/api-docs/{session,kv,txn}.mdx`) and source (`agent/session_endpoint.go`,
//! `agent/kvs_endpoint.go`, `agent/txn_endpoint.go`, `agent/consul/state/kvs.go`,
//! `agent/consul/state/session.go`, `agent/consul/session_ttl.go`, `agent/consul/kvs_endpoint.go`).
//!
//! No Consul agent can run where the tests run (it is not in Debian's packages); this server
//! keeps the parts of the contract the lock depends on:
//!
//! - Sessions (`PUT /v1/session/create`, `renew/ID`, `destroy/ID`, `GET /v1/session/info/ID`):
//!   a TTL between 10 s and 24 h or none (400 otherwise: `validateSession`/`SessionTTLMin`,
//!   `SessionTTLMax`), a `LockDelay` (default 15 s, capped at 60 s: `MaxLockDelay`), `Behavior`
//!   `release` or `delete`. A session is invalidated twice its TTL after its last renewal
//!   (`SessionTTLMultiplier` in `session_ttl.go`: "a session is not expired before the TTL, but
//!   there is no explicit promise about the upper bound"), or when destroyed; invalidation
//!   releases (or deletes) the keys it holds and puts them under its lock-delay
//!   (`deleteSessionTxn`). A renewal of an unknown session is 404.
//! - KV (`GET`, `PUT`, `DELETE /v1/kv/KEY`): values are base64 in JSON answers with `CreateIndex`,
//!   `ModifyIndex`, `LockIndex`, `Flags`, `Session`; 404 for a missing key; `X-Consul-Index` on
//!   every read (the key's `ModifyIndex`, or the KV table's index for a missing key: `kvsGetTxn`
//!   and the tombstone-aware `kvs` index); blocking reads (`?index=&wait=`, default 5 min, at
//!   most 10 min, plus up to `wait/16` jitter) return once that index passes `index` or the
//!   wait ends. `PUT ?cas=` (0: only if absent), `?acquire=SESSION`, `?release=SESSION` answer
//!   `true` or `false` (`kvsSetCASTxn`, `kvsLockTxn`, `kvsUnlockTxn`): an acquire by another
//!   session than the holder's is `false`, by the holder keeps `LockIndex`, by a new session
//!   raises it; an acquire during a key's lock-delay is `false` (`KVS.Apply` in
//!   `agent/consul/kvs_endpoint.go`); an unknown session is an error (500 "invalid session").
//!   A plain set keeps the holder's session (`kvsSetTxn` with `updateSession` false).
//! - Transactions (`PUT /v1/txn`) of KV operations (`set`, `cas`, `lock`, `unlock`, `get`,
//!   `check-index`, `check-session`, `check-not-exists`, `delete`, `delete-cas`): all or nothing,
//!   one index for all their writes; 200 with `Results`, or 409 with `Errors`
//!   (`OpIndex`, `What`) when an operation fails (`txn_endpoint.go`).
//! - ACLs: with [`ConsulApiServer::require_token`], a request without that token in
//!   `X-Consul-Token` is 403 `Permission denied` naming the rule it lacks, as Consul's
//!   `acl.PermissionDeniedError` does; [`ConsulApiServer::deny`] refuses one rule
//!   (`key:write`, `key:read`, `session:write`) to every token.
//! - `?dc=` other than the server's own (`dc1`) is 500 "No path to datacenter".
//! - With a state file ([`ConsulApiServer::serve_with_state`], `--state` of the binary) the KV
//!   entries, sessions and indexes survive a restart, as Consul's raft log and snapshots keep
//!   them. At start every session's timer is set anew, to two TTLs from then, as a newly
//!   elected Consul leader does (`initializeSessionTimers` in `session_ttl.go`); lock-delays
//!   are lost, as Consul keeps them in memory only (`agent/consul/state/delay.go`, not part of
//!   a snapshot).
//!
//! The raft index starts at 1 and grows by one per write (a transaction is one write).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;

/// The shortest TTL a session may have (`SessionTTLMin`).
pub const SESSION_TTL_MIN: Duration = Duration::from_secs(10);
/// The longest TTL a session may have (`SessionTTLMax`).
pub const SESSION_TTL_MAX: Duration = Duration::from_secs(24 * 3600);
/// A session is invalidated this many TTLs after its last renewal (`SessionTTLMultiplier`).
pub const SESSION_TTL_MULTIPLIER: u32 = 2;
/// The lock-delay of a session that names none (`DefaultLockDelay`).
pub const DEFAULT_LOCK_DELAY: Duration = Duration::from_secs(15);
/// The longest lock-delay (`MaxLockDelay`).
pub const MAX_LOCK_DELAY: Duration = Duration::from_secs(60);
/// The datacenter this server is.
pub const DATACENTER: &str = "dc1";

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Entry {
    create_index: u64,
    modify_index: u64,
    lock_index: u64,
    flags: u64,
    value: Vec<u8>,
    session: Option<String>,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Session {
    name: String,
    ttl: Option<Duration>,
    lock_delay: Duration,
    delete: bool,
    create_index: u64,
    /// When it is invalidated unless renewed.
    #[serde(skip)]
    deadline: Option<Instant>,
}

impl Session {
    /// Starts the session's timer anew: it is invalidated `SESSION_TTL_MULTIPLIER` TTLs from
    /// now unless renewed (`resetSessionTimer` in `session_ttl.go`).
    fn reset_timer(&mut self) {
        self.deadline = self
            .ttl
            .map(|ttl| Instant::now() + ttl * SESSION_TTL_MULTIPLIER);
    }
}

#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
struct Data {
    /// The raft index of the last write.
    index: u64,
    /// The KV table's index: its last write, deletions included.
    kv_index: u64,
    kv: BTreeMap<String, Entry>,
    sessions: HashMap<String, Session>,
    #[serde(skip)]
    lock_delays: HashMap<String, Instant>,
}

impl Data {
    fn new() -> Self {
        Self {
            index: 1,
            kv_index: 1,
            ..Self::default()
        }
    }

    /// The data kept in `path`, or a new store if there is no such file; every session's
    /// timer starts anew.
    fn load(path: &std::path::Path) -> std::io::Result<Self> {
        let mut data: Self = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Self::new()),
            Err(err) => return Err(err),
        };
        data.sessions.values_mut().for_each(Session::reset_timer);
        Ok(data)
    }

    /// Writes the data to `path` through a temporary file and a rename.
    fn save(&self, path: &std::path::Path) -> std::io::Result<()> {
        let temporary = path.with_extension("tmp");
        std::fs::write(&temporary, serde_json::to_vec(self)?)?;
        std::fs::rename(&temporary, path)
    }
}

#[derive(Debug, Default)]
struct Acl {
    token: Option<String>,
    denied: HashSet<String>,
}

#[derive(Debug)]
struct Shared {
    data: Mutex<Data>,
    acl: Mutex<Acl>,
    /// The raft index after each write, for blocking reads.
    written: watch::Sender<u64>,
    requests: Mutex<BTreeMap<String, usize>>,
    /// Where the data is kept across restarts, if anywhere.
    state_file: Option<std::path::PathBuf>,
}

/// A running test Consul server; it stops with the runtime that started it.
#[derive(Clone, Debug)]
pub struct ConsulApiServer {
    shared: Arc<Shared>,
    address: SocketAddr,
}

impl ConsulApiServer {
    /// Starts a server on a free loopback port, on the current runtime.
    ///
    /// # Panics
    /// If no loopback port can be bound.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        Self::serve(listener)
    }

    /// Serves on `listener`, keeping nothing across restarts.
    ///
    /// # Panics
    /// If the listener has no local address.
    pub fn serve(listener: tokio::net::TcpListener) -> Self {
        Self::serve_with_state(listener, None).expect("a server without a state file")
    }

    /// Serves on `listener`, keeping the data in `state_file` (read first if it exists, and
    /// written after every change) when one is given.
    ///
    /// # Errors
    /// The state file cannot be read, or the listener has no local address.
    pub fn serve_with_state(
        listener: tokio::net::TcpListener,
        state_file: Option<&std::path::Path>,
    ) -> std::io::Result<Self> {
        let address = listener.local_addr()?;
        let data = match state_file {
            Some(path) => Data::load(path)?,
            None => Data::new(),
        };
        let server = Self {
            shared: Arc::new(Shared {
                written: watch::channel(data.index).0,
                data: Mutex::new(data),
                acl: Mutex::default(),
                requests: Mutex::default(),
                state_file: state_file.map(std::path::Path::to_owned),
            }),
            address,
        };
        let app = Router::new()
            .route("/v1/session/create", put(session_create))
            .route("/v1/session/renew/{id}", put(session_renew))
            .route("/v1/session/destroy/{id}", put(session_destroy))
            .route("/v1/session/info/{id}", get(session_info))
            .route("/v1/kv/{*key}", get(kv_get).put(kv_put).delete(kv_delete))
            .route("/v1/txn", put(txn))
            .with_state(server.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        tokio::spawn(expire_sessions(server.clone()));
        Ok(server)
    }

    /// `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// `127.0.0.1:PORT`.
    #[must_use]
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Requires `token` in `X-Consul-Token` on every request, as an agent with
    /// `acl.default_policy = deny` and a token granting what the lock needs.
    pub fn require_token(&self, token: &str) {
        self.acl().token = Some(token.to_owned());
    }

    /// Refuses `rule` (`key:read`, `key:write`, `session:write`) to every token.
    pub fn deny(&self, rule: &str) {
        self.acl().denied.insert(rule.to_owned());
    }

    /// Grants `rule` again.
    pub fn allow(&self, rule: &str) {
        self.acl().denied.remove(rule);
    }

    /// Invalidates every session now, as their TTLs running out would.
    pub fn expire_sessions(&self) {
        let mut data = self.data();
        let ids: Vec<String> = data.sessions.keys().cloned().collect();
        for id in ids {
            invalidate(&mut data, &id);
        }
        self.written(&data);
    }

    /// How many sessions exist.
    #[must_use]
    pub fn sessions(&self) -> usize {
        self.data().sessions.len()
    }

    /// Requests received so far, by `METHOD /v1/area` (`PUT /v1/session/renew`, `GET /v1/kv`,
    /// `PUT /v1/txn`, ...).
    #[must_use]
    pub fn requests(&self) -> BTreeMap<String, usize> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stores `value` at `key` with no session, as another client's plain `PUT` would.
    pub fn put_raw(&self, key: &str, value: &[u8]) {
        let mut data = self.data();
        let index = data.index + 1;
        if let Ok(true) = apply(&mut data, index, key, value, &Write::Set) {
            data.index = index;
            self.written(&data);
        }
    }

    fn data(&self) -> MutexGuard<'_, Data> {
        self.shared.data.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn acl(&self) -> MutexGuard<'_, Acl> {
        self.shared.acl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Saves the data (with a state file) and wakes the blocking reads, once a write is done.
    fn written(&self, data: &Data) {
        if let Some(path) = &self.shared.state_file
            && let Err(err) = data.save(path)
        {
            eprintln!("consul-api-server: saving {}: {err}", path.display());
        }
        self.shared.written.send_replace(data.index);
    }

    fn count(&self, endpoint: &str) {
        let mut requests = self
            .shared
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *requests.entry(endpoint.to_owned()).or_default() += 1;
    }

    /// Counts a request to `endpoint` (`METHOD /v1/area`) and answers it at once when it is
    /// for another datacenter (500) or its token lacks `rule` on `resource` (403).
    fn admit(
        &self,
        endpoint: &str,
        params: &HashMap<String, String>,
        headers: &HeaderMap,
        rule: &str,
        resource: &str,
    ) -> Option<Response> {
        self.count(endpoint);
        wrong_datacenter(params).or_else(|| self.check(headers, rule, resource))
    }

    /// One KV write of a `PUT` or `DELETE`: `true` once stored, `false` when its condition
    /// failed; an unknown session is the 500 Consul answers.
    fn write_key(&self, key: &str, value: &[u8], write: &Write<'_>) -> Response {
        let mut data = self.data();
        let index = data.index + 1;
        // `apply` changes nothing unless it succeeds.
        match apply(&mut data, index, key, value, write) {
            Ok(true) => {
                data.index = index;
                self.written(&data);
                json_response(StatusCode::OK, index, &json!(true))
            }
            Ok(false) => json_response(StatusCode::OK, data.index, &json!(false)),
            Err(err) => text(StatusCode::INTERNAL_SERVER_ERROR, err),
        }
    }

    /// The 403 for a request that lacks `rule` on `resource`, if it does.
    fn check(&self, headers: &HeaderMap, rule: &str, resource: &str) -> Option<Response> {
        let acl = self.acl();
        let token = headers
            .get("x-consul-token")
            .and_then(|t| t.to_str().ok())
            .unwrap_or("anonymous");
        let has_token = acl.token.as_deref().is_none_or(|wanted| wanted == token);
        if has_token && !acl.denied.contains(rule) {
            return None;
        }
        let (kind, access) = rule.split_once(':').unwrap_or((rule, "write"));
        let message = format!(
            "Permission denied: token with AccessorID '{}' lacks permission '{kind}:{access}' on \"{resource}\"",
            if has_token {
                "00000000-0000-0000-0000-000000000002"
            } else {
                "anonymous"
            }
        );
        Some((StatusCode::FORBIDDEN, message).into_response())
    }
}

type Params = Query<HashMap<String, String>>;

fn text(code: StatusCode, body: impl Into<String>) -> Response {
    (code, body.into()).into_response()
}

fn json_response(code: StatusCode, index: u64, body: &Value) -> Response {
    (
        code,
        [
            ("content-type", "application/json".to_owned()),
            ("x-consul-index", index.to_string()),
            ("x-consul-knownleader", "true".to_owned()),
        ],
        body.to_string(),
    )
        .into_response()
}

/// 500 "No path to datacenter" for another datacenter than this one.
fn wrong_datacenter(params: &HashMap<String, String>) -> Option<Response> {
    params
        .get("dc")
        .filter(|dc| !dc.is_empty() && *dc != DATACENTER)
        .map(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "No path to datacenter"))
}

/// A Go duration (`10s`, `1m30s`, `500ms`, `0`) or, as Consul's decoder also accepts, a number
/// of nanoseconds.
fn go_duration(value: &Value) -> Result<Duration, String> {
    match value {
        Value::Number(n) => n
            .as_u64()
            .map(Duration::from_nanos)
            .ok_or_else(|| format!("invalid duration {n}")),
        Value::String(s) if s == "0" || s.is_empty() => Ok(Duration::ZERO),
        Value::String(s) => {
            humantime::parse_duration(s).map_err(|err| format!("invalid duration {s:?}: {err}"))
        }
        other => Err(format!("invalid duration {other}")),
    }
}

fn session_json(id: &str, session: &Session) -> Value {
    json!({
        "ID": id, "Name": session.name, "Node": "test-node", "LockDelay": session.lock_delay.as_nanos() as u64,
        "Behavior": if session.delete { "delete" } else { "release" },
        "TTL": session.ttl.map(|t| format!("{}s", t.as_secs())).unwrap_or_default(),
        "NodeChecks": [], "ServiceChecks": null,
        "CreateIndex": session.create_index, "ModifyIndex": session.create_index,
    })
}

/// `PUT /v1/session/create`.
async fn session_create(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Query(params): Params,
    body: Bytes,
) -> Response {
    if let Some(refused) = api.admit(
        "PUT /v1/session/create",
        &params,
        &headers,
        "session:write",
        "test-node",
    ) {
        return refused;
    }
    let spec: Value = if body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(spec) => spec,
            Err(err) => {
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("Request decode failed: {err}"),
                );
            }
        }
    };
    let ttl = match spec.get("TTL").map(go_duration).transpose() {
        Ok(ttl) => ttl.filter(|t| !t.is_zero()),
        Err(err) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("Request decode failed: {err}"),
            );
        }
    };
    if let Some(ttl) = ttl
        && !(SESSION_TTL_MIN..=SESSION_TTL_MAX).contains(&ttl)
    {
        return text(
            StatusCode::BAD_REQUEST,
            format!(
                "Invalid Session TTL '{}', must be between [10s=24h0m0s]",
                ttl.as_nanos()
            ),
        );
    }
    let lock_delay = match spec.get("LockDelay").map(go_duration).transpose() {
        Ok(delay) => delay.unwrap_or(DEFAULT_LOCK_DELAY).min(MAX_LOCK_DELAY),
        Err(err) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("Request decode failed: {err}"),
            );
        }
    };
    let delete = match spec
        .get("Behavior")
        .and_then(Value::as_str)
        .unwrap_or("release")
    {
        "release" | "" => false,
        "delete" => true,
        other => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("Invalid Behavior setting '{other}'"),
            );
        }
    };
    let mut data = api.data();
    let index = data.index + 1;
    data.index = index;
    let id = uuid();
    let mut session = Session {
        name: spec
            .get("Name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        ttl,
        lock_delay,
        delete,
        create_index: index,
        deadline: None,
    };
    session.reset_timer();
    data.sessions.insert(id.clone(), session);
    api.written(&data);
    json_response(StatusCode::OK, index, &json!({ "ID": id }))
}

fn uuid() -> String {
    let hex = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// `PUT /v1/session/renew/ID`: 404 once the session is gone.
async fn session_renew(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit(
        "PUT /v1/session/renew",
        &params,
        &headers,
        "session:write",
        "test-node",
    ) {
        return refused;
    }
    let mut data = api.data();
    let index = data.index;
    let Some(session) = data.sessions.get_mut(&id) else {
        return text(
            StatusCode::NOT_FOUND,
            format!("Session id '{id}' not found"),
        );
    };
    session.reset_timer();
    let body = json!([session_json(&id, session)]);
    json_response(StatusCode::OK, index, &body)
}

/// `PUT /v1/session/destroy/ID`: invalidates it; `true` whether or not it existed.
async fn session_destroy(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit(
        "PUT /v1/session/destroy",
        &params,
        &headers,
        "session:write",
        "test-node",
    ) {
        return refused;
    }
    let mut data = api.data();
    invalidate(&mut data, &id);
    api.written(&data);
    json_response(StatusCode::OK, data.index, &json!(true))
}

/// `GET /v1/session/info/ID`: the session in a list, or `null`.
async fn session_info(State(api): State<ConsulApiServer>, Path(id): Path<String>) -> Response {
    api.count("GET /v1/session/info");
    let data = api.data();
    let body = data
        .sessions
        .get(&id)
        .map_or(Value::Null, |s| json!([session_json(&id, s)]));
    json_response(StatusCode::OK, data.index, &body)
}

/// Invalidates session `id` (`deleteSessionTxn`): the keys it holds are released (or deleted,
/// for behaviour `delete`) and put under its lock-delay.
fn invalidate(data: &mut Data, id: &str) {
    let Some(session) = data.sessions.remove(id) else {
        return;
    };
    let index = data.index + 1;
    data.index = index;
    let held: Vec<String> = data
        .kv
        .iter()
        .filter(|(_, e)| e.session.as_deref() == Some(id))
        .map(|(k, _)| k.clone())
        .collect();
    for key in held {
        if session.delete {
            data.kv.remove(&key);
        } else if let Some(entry) = data.kv.get_mut(&key) {
            entry.session = None;
            entry.modify_index = index;
        }
        data.kv_index = index;
        if !session.lock_delay.is_zero() {
            data.lock_delays
                .insert(key, Instant::now() + session.lock_delay);
        }
    }
}

/// Invalidates sessions whose deadline passed, as the leader's session timers do.
async fn expire_sessions(api: ConsulApiServer) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let mut data = api.data();
        let now = Instant::now();
        let expired: Vec<String> = data
            .sessions
            .iter()
            .filter(|(_, s)| s.deadline.is_some_and(|d| d <= now))
            .map(|(id, _)| id.clone())
            .collect();
        if expired.is_empty() {
            continue;
        }
        for id in expired {
            invalidate(&mut data, &id);
        }
        api.written(&data);
    }
}

fn entry_json(key: &str, entry: &Entry, with_value: bool) -> Value {
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

/// The index a read of `key` reports: its `ModifyIndex`, or the KV table's for a missing key.
fn read_index(data: &Data, key: &str) -> u64 {
    data.kv
        .get(key)
        .map_or(data.kv_index, |e| e.modify_index)
        .max(1)
}

/// `GET /v1/kv/KEY`, blocking with `?index=&wait=`.
async fn kv_get(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit("GET /v1/kv", &params, &headers, "key:read", &key) {
        return refused;
    }
    let wanted: Option<u64> = params.get("index").and_then(|i| i.parse().ok());
    if let Some(wanted) = wanted.filter(|i| *i > 0) {
        let wait = params
            .get("wait")
            .and_then(|w| humantime::parse_duration(w).ok())
            .unwrap_or(Duration::from_secs(300))
            .min(Duration::from_secs(600));
        let wait = wait + wait.mul_f64(fastrand::f64() / 16.0);
        let mut written = api.shared.written.subscribe();
        let _ = tokio::time::timeout(wait, async {
            loop {
                if read_index(&api.data(), &key) > wanted {
                    return;
                }
                if written.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
    }
    let data = api.data();
    let index = read_index(&data, &key);
    match data.kv.get(&key) {
        Some(entry) => json_response(
            StatusCode::OK,
            index,
            &json!([entry_json(&key, entry, true)]),
        ),
        None => json_response(StatusCode::NOT_FOUND, index, &Value::Null),
    }
}

/// One KV write of a `PUT`, a `DELETE` or a transaction, on `data` at `index`.
enum Write<'a> {
    Set,
    Cas(u64),
    Lock(&'a str),
    Unlock(&'a str),
    Delete,
    DeleteCas(u64),
}

/// Applies `write` to `key`: `Ok(true)` when done, `Ok(false)` when its condition failed,
/// `Err` for an error (an unknown session). Nothing changes unless it succeeds.
fn apply(
    data: &mut Data,
    index: u64,
    key: &str,
    value: &[u8],
    write: &Write<'_>,
) -> Result<bool, String> {
    let existing = data.kv.get(key).cloned();
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
            if !data.sessions.contains_key(*id) {
                return Err(format!("invalid session \"{id}\""));
            }
            if data
                .lock_delays
                .get(key)
                .is_some_and(|until| *until > Instant::now())
            {
                return Ok(false);
            }
            match session.as_deref() {
                Some(holder) if holder == *id => {}
                Some(_) => return Ok(false),
                None => lock_index += 1,
            }
            session = Some((*id).to_owned());
        }
        Write::Unlock(id) => {
            if session.as_deref() != Some(*id) {
                return Ok(false);
            }
            session = None;
        }
        Write::Delete => {
            data.kv.remove(key);
            data.kv_index = index;
            return Ok(true);
        }
        Write::DeleteCas(wanted) => {
            if existing.as_ref().is_none_or(|e| e.modify_index != *wanted) {
                return Ok(false);
            }
            data.kv.remove(key);
            data.kv_index = index;
            return Ok(true);
        }
    }
    data.kv.insert(
        key.to_owned(),
        Entry {
            create_index: existing.as_ref().map_or(index, |e| e.create_index),
            modify_index: index,
            lock_index,
            flags: existing.as_ref().map_or(0, |e| e.flags),
            value: value.to_vec(),
            session,
        },
    );
    data.kv_index = index;
    Ok(true)
}

/// `PUT /v1/kv/KEY` with `?cas=`, `?acquire=`, `?release=`: `true` or `false`.
async fn kv_put(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(params): Params,
    body: Bytes,
) -> Response {
    if let Some(refused) = api.admit("PUT /v1/kv", &params, &headers, "key:write", &key) {
        return refused;
    }
    let cas = params.get("cas").map(|c| c.parse::<u64>());
    let write = if let Some(id) = params.get("acquire") {
        Write::Lock(id)
    } else if let Some(id) = params.get("release") {
        Write::Unlock(id)
    } else {
        match cas {
            Some(Ok(index)) => Write::Cas(index),
            Some(Err(_)) => return text(StatusCode::BAD_REQUEST, "Invalid CAS index"),
            None => Write::Set,
        }
    };
    api.write_key(&key, &body, &write)
}

/// `DELETE /v1/kv/KEY`, with `?cas=`.
async fn kv_delete(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit("DELETE /v1/kv", &params, &headers, "key:write", &key) {
        return refused;
    }
    let write = match params.get("cas").map(|c| c.parse::<u64>()) {
        Some(Ok(index)) => Write::DeleteCas(index),
        Some(Err(_)) => return text(StatusCode::BAD_REQUEST, "Invalid CAS index"),
        None => Write::Delete,
    };
    api.write_key(&key, &[], &write)
}

/// `PUT /v1/txn`: KV operations, all or none.
async fn txn(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Query(params): Params,
    body: Bytes,
) -> Response {
    api.count("PUT /v1/txn");
    if let Some(refused) = wrong_datacenter(&params) {
        return refused;
    }
    let ops: Vec<Value> = match serde_json::from_slice(&body) {
        Ok(ops) => ops,
        Err(err) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("Failed to parse body: {err}"),
            );
        }
    };
    if ops.len() > 128 {
        return text(
            StatusCode::PAYLOAD_TOO_LARGE,
            "Transaction contains too many operations (129 > 128)",
        );
    }
    let mut data = api.data();
    let mut next = data.clone();
    let index = data.index + 1;
    let mut results = Vec::new();
    let mut errors = Vec::new();
    let mut wrote = false;
    for (op_index, op) in ops.iter().enumerate() {
        let Some(kv) = op.get("KV") else {
            errors.push(json!({"OpIndex": op_index, "What": "only KV operations are served"}));
            continue;
        };
        let verb = kv["Verb"].as_str().unwrap_or_default();
        let key = kv["Key"].as_str().unwrap_or_default();
        let rule = if matches!(
            verb,
            "get" | "check-index" | "check-session" | "check-not-exists"
        ) {
            "key:read"
        } else {
            "key:write"
        };
        if let Some(denied) = api.check(&headers, rule, key) {
            return denied;
        }
        let value = match kv["Value"].as_str().map(|v| BASE64.decode(v)) {
            Some(Ok(value)) => value,
            Some(Err(err)) => {
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("Failed to parse body: {err}"),
                );
            }
            None => Vec::new(),
        };
        let op_index_value = kv["Index"].as_u64().unwrap_or(0);
        let session = kv["Session"].as_str().unwrap_or_default();
        let fail = |what: String| json!({"OpIndex": op_index, "What": what});
        let write = match verb {
            "get" => {
                match next.kv.get(key) {
                    Some(entry) => results.push(json!({"KV": entry_json(key, entry, true)})),
                    None => errors.push(fail(format!("key {key:?} doesn't exist"))),
                }
                continue;
            }
            "check-index" => {
                match next.kv.get(key) {
                    Some(e) if e.modify_index == op_index_value => {
                        results.push(json!({"KV": entry_json(key, e, false)}));
                    }
                    Some(e) => errors.push(fail(format!(
                        "failed index check for key {key:?}, current modify index {} != {op_index_value}",
                        e.modify_index
                    ))),
                    None => errors.push(fail(format!(
                        "failed to check index, key {key:?} doesn't exist"
                    ))),
                }
                continue;
            }
            "check-session" => {
                match next.kv.get(key) {
                    Some(e) if e.session.as_deref() == Some(session) => {
                        results.push(json!({"KV": entry_json(key, e, false)}));
                    }
                    Some(e) => errors.push(fail(format!(
                        "failed session check for key {key:?}, current session {:?} != {session:?}",
                        e.session.clone().unwrap_or_default()
                    ))),
                    None => errors.push(fail(format!(
                        "failed to check session, key {key:?} doesn't exist"
                    ))),
                }
                continue;
            }
            "check-not-exists" => {
                if next.kv.contains_key(key) {
                    errors.push(fail(format!("key {key:?} exists")));
                }
                continue;
            }
            "set" => Write::Set,
            "cas" => Write::Cas(op_index_value),
            "lock" => Write::Lock(session),
            "unlock" => Write::Unlock(session),
            "delete" => Write::Delete,
            "delete-cas" => Write::DeleteCas(op_index_value),
            other => {
                errors.push(fail(format!("unknown KV verb {other:?}")));
                continue;
            }
        };
        match apply(&mut next, index, key, &value, &write) {
            Ok(true) => {
                wrote = true;
                if let Some(entry) = next.kv.get(key) {
                    results.push(json!({"KV": entry_json(key, entry, false)}));
                }
            }
            Ok(false) => errors.push(fail(match verb {
                "lock" => format!("failed to lock key {key:?}, lock is already held"),
                "unlock" => format!(
                    "failed to unlock key {key:?}, lock isn't held, or is held by another session"
                ),
                _ => format!("failed to {verb} key {key:?}, index is stale"),
            })),
            Err(err) => errors.push(fail(format!("failed to {verb} key {key:?}: {err}"))),
        }
    }
    if !errors.is_empty() {
        return json_response(
            StatusCode::CONFLICT,
            data.index,
            &json!({"Results": null, "Errors": errors}),
        );
    }
    if wrote {
        next.index = index;
        *data = next;
        api.written(&data);
    }
    json_response(
        StatusCode::OK,
        data.index,
        &json!({"Results": results, "Errors": null}),
    )
}

/// The `consul-api-server` program (`[--listen ADDR] [--state FILE]`): serves on `ADDR`
/// (default a free loopback port), prints `listening on URL`, and runs until it is killed; with
/// `--state`, keeps its data in `FILE` across restarts. For binaries that start the server as a
/// process.
#[must_use]
pub fn process_main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let mut listen = "127.0.0.1:0".to_owned();
    let mut state = None;
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--listen", Some(address)) => listen = address,
            ("--state", Some(file)) => state = Some(std::path::PathBuf::from(file)),
            _ => {
                eprintln!("usage: consul-api-server [--listen ADDR] [--state FILE]");
                return std::process::ExitCode::from(2);
            }
        }
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("consul-api-server: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let listener = match tokio::net::TcpListener::bind(&listen).await {
            Ok(listener) => listener,
            Err(err) => {
                eprintln!("consul-api-server: listening on {listen}: {err}");
                return std::process::ExitCode::FAILURE;
            }
        };
        let server = match ConsulApiServer::serve_with_state(listener, state.as_deref()) {
            Ok(server) => server,
            Err(err) => {
                eprintln!("consul-api-server: reading the state file: {err}");
                return std::process::ExitCode::FAILURE;
            }
        };
        println!("listening on {}", server.url());
        std::future::pending::<()>().await;
        std::process::ExitCode::SUCCESS
    })
}
