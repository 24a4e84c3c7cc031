//! A Consul HTTP API server for tests (feature `consul-api`), serving what a session lock uses
//! with Consul's contract, each behaviour citing where it comes from in Consul's source
//! (hashicorp/consul: `agent/*_endpoint.go` for the HTTP layer, `agent/consul/*_endpoint.go`
//! for the servers' RPC endpoints, `agent/consul/state/*.go` for the state store) and
//! documentation (`website/content/api-docs/{session,kv,txn}.mdx`).
//!
//! No Consul agent can run where the tests run (it is not in Debian's packages); this server
//! keeps the parts of the contract the lock depends on, in the configuration users run by
//! default (ACLs on request, agents that leave):
//!
//! - Agents and nodes: each agent ([`ConsulApiServer::start`], [`ConsulApiServer::agent`]) is a
//!   node of the catalog with a passing `serfHealth` check, and its sessions belong to that
//!   node. A node deregistered ([`ConsulApiServer::deregister_node`], `PUT
//!   /v1/catalog/deregister`, or an agent that leaves, [`ConsulApiServer::leave`]) takes every
//!   session of the node with it (`deleteNodeTxn` in `state/catalog.go`), and a check turning
//!   critical the sessions tied to it (`ensureCheckTxn`); an agent that left answers nothing.
//! - Sessions (`session.rs`: create, renew, destroy, info, list): created with the agent's
//!   node, `serfHealth` and a 15 s lock-delay by default (`SessionCreate`), the checks fixed up
//!   as `fixupEmptySessionChecks` does (an empty `Checks` list clears `NodeChecks` too), a TTL
//!   between `session_ttl_min` (10 s unless an operator raised it,
//!   [`ConsulApiServer::set_session_ttl_min`]) and 24 h or none, else 500 "Invalid Session
//!   TTL" (`Session.Apply`), a registered node and checks that are not critical
//!   (`sessionCreateTxn`); invalidated twice
//!   their TTL after their last renewal (`SessionTTLMultiplier`), when destroyed, with their
//!   node or a check; an invalidation releases (or deletes) the keys the session holds and
//!   puts them under its lock-delay, at most 60 s (`deleteSessionTxn`), which an `unlock`
//!   never does.
//! - KV (`kv.rs`): key names checked on `GET`, `PUT` and `DELETE` as `validateKVKey` does
//!   (`agent/kvs_endpoint.go`; transactions do not check them), values base64 in JSON answers,
//!   `X-Consul-Index`, blocking reads that return once the index passes the one asked for, the
//!   wait ends or a snapshot is restored, and that keep waiting on a key that is missing
//!   until it exists (`KVS.Get` returns `errNotFound` to `blockingquery.Query`);
//!   `?cas=`, `?acquire=`, `?release=` with their boolean answers, a lock refused during a
//!   key's lock-delay (`kvsPreApply`).
//! - Transactions (`txn.rs`, `PUT /v1/txn`): every operation first checked for its ACL rule and
//!   a lock for its key's lock-delay (`Txn.preCheck`, `kvsPreApply`), so that a denied
//!   operation is a 409 whose `Errors[].What` says "Permission denied", never a 403; then all
//!   or nothing, one index for all writes, 409 with the failed operations (`txnKVS` in
//!   `state/txn.go`, `get-or-empty` and `get-tree` included); results of reads filtered by the
//!   token's `key:read` (`FilterTxnResults`).
//! - ACLs: with [`ConsulApiServer::require_token`], a request without that token is 403
//!   `Permission denied`; [`ConsulApiServer::deny`] refuses one rule (`key:write`,
//!   `key:read`, `session:write`) to every token; a token [`ConsulApiServer::revoke`]d is 403
//!   "ACL not found" on every request.
//! - `?dc=` other than the server's own (`dc1`) is 500 "No path to datacenter".
//! - A snapshot ([`ConsulApiServer::snapshot`]) restored ([`ConsulApiServer::restore`]) puts
//!   the data and the raft index back where they were (the index goes backwards), wakes every
//!   blocking query (`FSM.Restore` abandons the old state store), forgets the lock-delays (a
//!   new state store) and starts the sessions' timers anew (the leader reasserts its
//!   leadership, `initializeSessionTimers`).
//! - With a state file ([`ConsulApiServer::serve_with_state`], `--state` of the binary) the
//!   data survives a restart, as Consul's raft log and snapshots keep it; at start every
//!   session's timer is set anew, as a newly elected leader does, and lock-delays are lost.
//!
//! The raft index starts at 1 and grows by one per write (a transaction is one write).

mod data;
mod kv;
mod process;
mod session;
mod txn;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use serde_json::Value;
use tokio::sync::watch;

use data::{Data, Node, Write};
pub use process::process_main;

/// The shortest TTL a session may have unless an operator sets `session_ttl_min`
/// (`SessionTTLMin`).
pub const SESSION_TTL_MIN: Duration = Duration::from_secs(10);
/// The longest TTL a session may have (`SessionTTLMax`).
pub const SESSION_TTL_MAX: Duration = Duration::from_secs(24 * 3600);
/// A session is invalidated this many TTLs after its last renewal (`SessionTTLMultiplier`).
pub const SESSION_TTL_MULTIPLIER: u32 = 2;
/// The lock-delay of a session that names none (`SessionCreate`'s default).
pub const DEFAULT_LOCK_DELAY: Duration = Duration::from_secs(15);
/// The longest lock-delay an invalidation applies (`MaxLockDelay`).
pub const MAX_LOCK_DELAY: Duration = Duration::from_secs(60);
/// The datacenter this server is.
pub const DATACENTER: &str = "dc1";
/// The node of the first agent.
pub const NODE: &str = "test-node";
/// The check every agent registers for its node, and sessions get by default
/// (`structs.SerfCheckID`).
pub const SERF_HEALTH: &str = "serfHealth";

#[derive(Debug, Default)]
struct Acl {
    token: Option<String>,
    denied: HashSet<String>,
    /// Tokens the agent no longer knows (deleted, expired).
    revoked: HashSet<String>,
}

/// The raft index after a write, and how many snapshots were restored: blocking reads wait
/// for the first to pass theirs, and return at once when the second changes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Written {
    index: u64,
    restores: u64,
}

#[derive(Debug)]
struct Shared {
    data: Mutex<Data>,
    acl: Mutex<Acl>,
    /// `session_ttl_min`.
    session_ttl_min: Mutex<Duration>,
    written: watch::Sender<Written>,
    requests: Mutex<BTreeMap<String, usize>>,
    /// Where the data is kept across restarts, if anywhere.
    state_file: Option<std::path::PathBuf>,
}

/// One agent: a node, and the listener it serves on until it leaves.
#[derive(Debug)]
struct Agent {
    node: String,
    left: AtomicBool,
    accept: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// A running test Consul server, as seen through one of its agents; it stops with the runtime
/// that started it.
#[derive(Clone, Debug)]
pub struct ConsulApiServer {
    shared: Arc<Shared>,
    agent: Arc<Agent>,
    address: SocketAddr,
}

/// The data of a server at one moment ([`ConsulApiServer::snapshot`]), to restore later.
#[derive(Clone, Debug)]
pub struct ConsulSnapshot(Data);

/// A loopback listener on a [`free_port`](crate::free_port): below the ephemeral range, so that
/// an agent that restarts finds its address free to bind again.
async fn listen_on_free_port() -> tokio::net::TcpListener {
    for _ in 0..100 {
        // Another process may take the port between the draw and this bind: draw again.
        if let Ok(listener) = tokio::net::TcpListener::bind(("127.0.0.1", crate::free_port())).await
        {
            return listener;
        }
    }
    panic!("no free loopback port could be bound");
}

impl ConsulApiServer {
    /// Starts a server on a free loopback port, on the current runtime.
    ///
    /// # Panics
    /// If no loopback port can be bound.
    pub async fn start() -> Self {
        Self::serve(listen_on_free_port().await)
    }

    /// Serves on `listener`, keeping nothing across restarts.
    ///
    /// # Panics
    /// If the listener has no local address.
    pub fn serve(listener: tokio::net::TcpListener) -> Self {
        Self::serve_with_state(listener, None).expect("a server without a state file")
    }

    /// Serves on `listener`, keeping the data in `state_file` (read first if it exists, and
    /// written after every change) when one is given. The agent's node is [`NODE`].
    ///
    /// # Errors
    /// The state file cannot be read, or the listener has no local address.
    pub fn serve_with_state(
        listener: tokio::net::TcpListener,
        state_file: Option<&std::path::Path>,
    ) -> std::io::Result<Self> {
        let mut data = match state_file {
            Some(path) => Data::load(path)?,
            None => Data::new(),
        };
        data.nodes
            .entry(NODE.to_owned())
            .or_insert_with(Node::registered);
        let shared = Arc::new(Shared {
            written: watch::channel(Written {
                index: data.index,
                restores: 0,
            })
            .0,
            data: Mutex::new(data),
            acl: Mutex::default(),
            session_ttl_min: Mutex::new(SESSION_TTL_MIN),
            requests: Mutex::default(),
            state_file: state_file.map(std::path::Path::to_owned),
        });
        let server = Self::serve_agent(shared, NODE, listener)?;
        tokio::spawn(expire_sessions(server.clone()));
        Ok(server)
    }

    /// Starts another agent of the same cluster on a free loopback port, as node `node`
    /// (registered, with `serfHealth` passing): sessions created through it are that node's.
    ///
    /// # Panics
    /// If no loopback port can be bound.
    pub async fn agent(&self, node: &str) -> Self {
        let listener = listen_on_free_port().await;
        self.register_node(node);
        Self::serve_agent(self.shared.clone(), node, listener).expect("a bound listener")
    }

    fn serve_agent(
        shared: Arc<Shared>,
        node: &str,
        listener: tokio::net::TcpListener,
    ) -> std::io::Result<Self> {
        let address = listener.local_addr()?;
        let server = Self {
            shared,
            agent: Arc::new(Agent {
                node: node.to_owned(),
                left: AtomicBool::new(false),
                accept: Mutex::default(),
            }),
            address,
        };
        let app = Self::agent_routes(server.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        *lock(&server.agent.accept) = Some(task);
        Ok(server)
    }

    /// What an agent other than the first serves.
    fn agent_routes(server: Self) -> Router {
        Router::new()
            .route("/v1/session/create", put(session::create))
            .route("/v1/session/renew/{id}", put(session::renew))
            .route("/v1/session/destroy/{id}", put(session::destroy))
            .route("/v1/session/info/{id}", get(session::info))
            .route("/v1/session/list", get(session::list))
            .route("/v1/session/node/{node}", get(session::node))
            .route("/v1/catalog/deregister", put(session::deregister))
            .route(
                "/v1/kv/{*key}",
                get(kv::get).put(kv::put).delete(kv::delete),
            )
            .route("/v1/txn", put(txn::txn))
            .layer(axum::middleware::from_fn_with_state(
                server.clone(),
                unless_left,
            ))
            .with_state(server)
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

    /// This agent's node.
    #[must_use]
    pub fn node(&self) -> &str {
        &self.agent.node
    }

    /// This agent leaves the cluster (`consul leave`): the servers deregister its node, which
    /// invalidates every session of the node (`handleLeftMember` → `deleteNodeTxn`), and the
    /// agent stops answering: no new connection is accepted, and requests on connections
    /// already open never get an answer.
    pub fn leave(&self) {
        self.agent.left.store(true, Ordering::Release);
        let accept = lock(&self.agent.accept).take();
        if let Some(task) = accept {
            task.abort();
        }
        self.deregister_node(&self.agent.node);
    }

    /// This agent restarts as a client agent does by default (`leave_on_terminate`): it
    /// leaves ([`leave`](Self::leave): its node deregistered, its sessions invalidated),
    /// stays down for `down`, then starts again on the same address and joins, which
    /// registers its node anew.
    ///
    /// # Panics
    /// If the address cannot be bound again.
    pub async fn restart(&self, down: std::time::Duration) {
        self.leave();
        tokio::time::sleep(down).await;
        let listener = tokio::net::TcpListener::bind(self.address)
            .await
            .expect("bind the agent's address again");
        self.register_node(&self.agent.node);
        self.agent.left.store(false, Ordering::Release);
        let app = Self::agent_routes(self.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        *lock(&self.agent.accept) = Some(task);
    }

    /// Deregisters `node` from the catalog, as `consul force-leave -prune` or `PUT
    /// /v1/catalog/deregister` do (`deleteNodeTxn`): every session of the node is invalidated,
    /// while its agent, if it still runs, goes on answering.
    pub fn deregister_node(&self, node: &str) {
        let mut data = self.data();
        if data.deregister_node(node) {
            self.written(&data);
        }
    }

    /// Registers `node` (with `serfHealth` passing), as its agent does when it joins or at its
    /// next anti-entropy sync.
    pub fn register_node(&self, node: &str) {
        let mut data = self.data();
        data.nodes.insert(node.to_owned(), Node::registered());
        let _ = data.next_index();
        self.written(&data);
    }

    /// Sets check `check` of `node` to `status` (`passing`, `warning`, `critical`): a
    /// critical check invalidates the sessions tied to it.
    pub fn set_check(&self, node: &str, check: &str, status: &str) {
        let mut data = self.data();
        if data.set_check(node, check, status) {
            self.written(&data);
        }
    }

    /// Sets `session_ttl_min`, the shortest TTL a session may be created with: an operator
    /// may raise it (or lower it) from its default of 10 s.
    pub fn set_session_ttl_min(&self, min: Duration) {
        *lock(&self.shared.session_ttl_min) = min;
    }

    /// Requires `token` in `X-Consul-Token` on every request, as an agent with
    /// `acl.default_policy = deny` and a token granting what the lock needs.
    pub fn require_token(&self, token: &str) {
        self.acl().token = Some(token.to_owned());
    }

    /// Forgets `token`, as a token deleted or past its expiration time: every request that
    /// carries it is 403 "ACL not found", before anything it asks is looked at (Consul's
    /// `acl.ErrNotFound` from the token's resolution, which `agent/http.go` answers 403).
    pub fn revoke(&self, token: &str) {
        self.acl().revoked.insert(token.to_owned());
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
        let index = data.next_index();
        let ids: Vec<String> = data.sessions.keys().cloned().collect();
        for id in ids {
            data.invalidate(index, &id);
        }
        self.written(&data);
    }

    /// How many sessions exist.
    #[must_use]
    pub fn sessions(&self) -> usize {
        self.data().sessions.len()
    }

    /// The IDs of the sessions that exist.
    #[must_use]
    pub fn session_ids(&self) -> Vec<String> {
        self.data().sessions.keys().cloned().collect()
    }

    /// Session `id` as `GET /v1/session/info/ID` shows it, if it exists.
    #[must_use]
    pub fn session(&self, id: &str) -> Option<Value> {
        self.data().sessions.get(id).map(|s| s.to_json(id))
    }

    /// The data as it is now, to restore later.
    #[must_use]
    pub fn snapshot(&self) -> ConsulSnapshot {
        ConsulSnapshot(self.data().clone())
    }

    /// Restores `snapshot` (`consul snapshot restore`): the data and the raft index go back to
    /// it, blocking queries return at once, lock-delays are forgotten and session timers
    /// start anew (see the module's documentation).
    pub fn restore(&self, snapshot: &ConsulSnapshot) {
        let mut data = self.data();
        *data = snapshot.0.clone();
        data.lock_delays.clear();
        data.sessions
            .values_mut()
            .for_each(data::Session::reset_timer);
        let restores = self.shared.written.borrow().restores + 1;
        self.save(&data);
        self.shared.written.send_replace(Written {
            index: data.index,
            restores,
        });
    }

    /// Requests received so far, by `METHOD /v1/area` (`PUT /v1/session/renew`, `GET /v1/kv`,
    /// `PUT /v1/txn`, ...).
    #[must_use]
    pub fn requests(&self) -> BTreeMap<String, usize> {
        lock(&self.shared.requests).clone()
    }

    /// Stores `value` at `key` with no session, as another client's plain `PUT` would.
    pub fn put_raw(&self, key: &str, value: &[u8]) {
        let mut data = self.data();
        let index = data.index + 1;
        if let Ok(true) = data.apply(index, key, value, 0, &Write::Set) {
            data.index = index;
            self.written(&data);
        }
    }

    fn data(&self) -> MutexGuard<'_, Data> {
        lock(&self.shared.data)
    }

    fn acl(&self) -> MutexGuard<'_, Acl> {
        lock(&self.shared.acl)
    }

    fn session_ttl_min(&self) -> Duration {
        *lock(&self.shared.session_ttl_min)
    }

    fn save(&self, data: &Data) {
        if let Some(path) = &self.shared.state_file
            && let Err(err) = data.save(path)
        {
            eprintln!("consul-api-server: saving {}: {err}", path.display());
        }
    }

    /// Saves the data (with a state file) and wakes the blocking reads, once a write is done.
    fn written(&self, data: &Data) {
        self.save(data);
        self.shared.written.send_modify(|w| w.index = data.index);
    }

    fn count(&self, endpoint: &str) {
        *lock(&self.shared.requests)
            .entry(endpoint.to_owned())
            .or_default() += 1;
    }

    /// Counts a request to `endpoint` (`METHOD /v1/area`) and answers it at once when it is
    /// for another datacenter (500) or its token lacks `rule` on `resource` (403; no rule:
    /// the handler checks it later, as Consul does after decoding the request).
    pub(super) fn admit(
        &self,
        endpoint: &str,
        params: &HashMap<String, String>,
        headers: &HeaderMap,
        rule: &str,
        resource: &str,
    ) -> Option<Response> {
        self.count(endpoint);
        // Forwarded to the datacenter first (`ForwardRPC`), then the token resolved there.
        if let Some(refused) = wrong_datacenter(params) {
            return Some(refused);
        }
        let token = headers
            .get("x-consul-token")
            .and_then(|t| t.to_str().ok())
            .unwrap_or_default();
        if self.acl().revoked.contains(token) {
            return Some((StatusCode::FORBIDDEN, "ACL not found").into_response());
        }
        if rule.is_empty() {
            return None;
        }
        self.denied(headers, rule, resource)
            .map(|message| (StatusCode::FORBIDDEN, message).into_response())
    }

    /// Why a request lacks `rule` on `resource`, if it does: Consul's
    /// `acl.PermissionDeniedError` text.
    fn denied(&self, headers: &HeaderMap, rule: &str, resource: &str) -> Option<String> {
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
        Some(format!(
            "Permission denied: token with AccessorID '{}' lacks permission '{kind}:{access}' on \"{resource}\"",
            if has_token {
                "00000000-0000-0000-0000-000000000002"
            } else {
                "anonymous"
            }
        ))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// An agent that left answers nothing: its requests wait forever.
async fn unless_left(State(api): State<ConsulApiServer>, request: Request, next: Next) -> Response {
    if api.agent.left.load(Ordering::Acquire) {
        std::future::pending::<()>().await;
    }
    next.run(request).await
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

/// Invalidates sessions whose deadline passed, as the leader's session timers do.
async fn expire_sessions(api: ConsulApiServer) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let mut data = api.data();
        let expired = data.expired_sessions();
        if expired.is_empty() {
            continue;
        }
        let index = data.next_index();
        for id in expired {
            data.invalidate(index, &id);
        }
        api.written(&data);
    }
}
