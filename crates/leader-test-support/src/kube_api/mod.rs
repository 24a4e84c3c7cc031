//! A Kubernetes API server for tests (feature `kube-api`), serving what Lease clients use with
//! kube-apiserver's contract, each behaviour citing its source in the Kubernetes tree.
//!
//! No cluster runs where the tests run; this server keeps the parts of the real contract that
//! Lease clients depend on, so that our lock and other clients (client-go's layout, kubert,
//! kube-lease-manager, `kubectl`-style patches) can be run against it:
//!
//! - `coordination.k8s.io/v1` Leases: GET, POST, PUT, PATCH, DELETE, LIST and WATCH, with the
//!   Lease strategy as a stock cluster runs it (`objects::admit`: the `CoordinatedLeaderElection`
//!   feature gate off, so `strategy` and `preferredHolder` are dropped; on when a test asks;
//!   `routes`: create-on-update, no unconditional update), decoding and validation
//!   (`objects::decode` and `objects::admit`: 400 for a wrong type, 422 `Invalid`, unknown
//!   fields dropped, times as RFC 3339 micro UTC), preconditions (409 `Conflict` for a
//!   `resourceVersion` or a body's `uid` that does not match, also for a Lease deleted since;
//!   DELETE with `preconditions`), JSON patch, merge, strategic merge and server-side apply
//!   patches with field ownership (`fields`: `managedFields`, 409 apply conflicts, `force`).
//! - Updates that leave an object as stored are skipped, as `GuaranteedUpdate` skips them
//!   (`objects::Objects::store`): 200 with the same `resourceVersion`, no watch event.
//! - Watches as the watch cache serves them: the current state first, or the changes after a
//!   `resourceVersion`, 410 `Expired` once that is too old, `timeoutSeconds`, `BOOKMARK`s.
//! - `coordination.k8s.io/v1beta1` LeaseCandidates when a test serves them (a beta API, off by
//!   default), with the same verbs and the LeaseCandidate strategy and validation
//!   (`objects::admit`), and, when started
//!   ([`KubeApiServer::start_coordinator`]), the [`coordinator`] of coordinated leader election
//!   that kube-apiserver runs with the `CoordinatedLeaderElection` feature gate.
//! - core/v1 Pods (`pods`): GET, POST, PUT, PATCH (JSON, merge and strategic merge patches of
//!   their labels), DELETE, LIST and WATCH, with the Pod strategy and the validation of labels,
//!   for clients that label Pods.
//! - `labelSelector` on every LIST and WATCH (`selector`), a watch reporting an object that
//!   leaves the selection as `DELETED` and one that enters it as `ADDED`, as the watch cache does.
//! - The core/v1 Events endpoint (POST).
//! - 403 `Forbidden` for a verb a test denies, as RBAC would; 429/5xx and slow answers on
//!   request, as a busy API server; a Pod PATCH held back until the test lets it through; a
//!   validating admission policy on Pod updates that a test installs.
//!
//! It runs inside a test ([`KubeApiServer::start`]) or as a process (the `kube-api-server`
//! binary), and with a state file it keeps its objects and revision across a restart, as the
//! real server keeps them in etcd.

pub mod coordinator;
mod fields;
mod objects;
mod pods;
pub mod process;
mod routes;
mod selector;
mod validation;

use std::collections::{HashSet, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::broadcast;

use objects::{Change, Objects, Resource, Write};
use selector::Selector;

/// What a test can make the server do besides keeping the contract.
#[derive(Debug)]
struct Behaviour {
    /// `(resource, verb)` pairs answered 403, such as `("leases", "update")`.
    denied: HashSet<(String, String)>,
    /// How long a PUT of a Lease or a LeaseCandidate takes to answer.
    write_delay: Duration,
    /// How long a PATCH or PUT of a Pod takes to answer.
    pod_write_delay: Duration,
    /// Answers for the next PUTs instead of doing them: a status code each.
    reject_writes: VecDeque<u16>,
    /// How often a watch that allows them gets a BOOKMARK.
    bookmark_every: Duration,
    /// Watches to answer with 410 Gone whatever version they ask for.
    expire_watches: usize,
    /// Ends every watch after this long, whatever `timeoutSeconds` asked.
    watch_timeout: Option<Duration>,
    /// Watch requests received.
    watches: usize,
    /// List requests received (watches not counted).
    lists: usize,
    /// kube-apiserver's `CoordinatedLeaderElection` feature gate, off by default (also at
    /// beta): the Lease strategy drops `strategy` and `preferredHolder` while it is off.
    coordinated_leader_election: bool,
    /// `coordination.k8s.io/v1beta1` served (`--runtime-config`); a beta API, off by default.
    lease_candidates: bool,
    /// Annotations removed from every Lease written, as a mutating admission webhook might.
    stripped_annotations: Vec<String>,
    /// The next Pod PATCH to hold until the test releases it.
    held_pod_write: Option<HeldSlot>,
    /// A validating admission policy every Pod update goes through.
    pod_admission: Option<PodAdmission>,
}

/// What a [`PodAdmission`] check is given: the Pod as stored, the Pod as the update would
/// store it, and the bearer token the request came with (empty without one).
pub type PodAdmissionCheck = dyn Fn(&Value, &Value, &str) -> Result<(), String> + Send + Sync;

/// A validating admission policy on Pod updates ([`KubeApiServer::admit_pod_updates`]).
#[derive(Clone)]
struct PodAdmission {
    name: String,
    check: Arc<PodAdmissionCheck>,
}

impl std::fmt::Debug for PodAdmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodAdmission")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The server's side of a [`HeldWrite`].
#[derive(Debug)]
struct HeldSlot {
    arrived: tokio::sync::oneshot::Sender<()>,
    release: tokio::sync::oneshot::Receiver<()>,
    answered: tokio::sync::oneshot::Sender<u16>,
}

/// A Pod PATCH that the server holds, as a request delayed on its way (or sent by a process
/// frozen and resumed) would be: it is applied only once [`released`](Self::release) (or the
/// handle dropped), to the Pod as stored then, and whether or not its client still waits.
#[derive(Debug)]
pub struct HeldWrite {
    arrived: tokio::sync::oneshot::Receiver<()>,
    release: tokio::sync::oneshot::Sender<()>,
    answered: tokio::sync::oneshot::Receiver<u16>,
}

impl HeldWrite {
    /// Completes once the server holds a PATCH.
    ///
    /// # Panics
    /// If the server is gone.
    pub async fn arrived(&mut self) {
        (&mut self.arrived).await.expect("the server holds a write");
    }

    /// Lets the held PATCH through; returns the status code the server answered it with.
    ///
    /// # Panics
    /// If the server is gone.
    pub async fn release(self) -> u16 {
        let _ = self.release.send(());
        self.answered.await.expect("the held write answered")
    }
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            denied: HashSet::new(),
            write_delay: Duration::ZERO,
            pod_write_delay: Duration::ZERO,
            reject_writes: VecDeque::new(),
            // The watch cache sends them about once a minute.
            bookmark_every: Duration::from_secs(60),
            expire_watches: 0,
            watch_timeout: None,
            watches: 0,
            lists: 0,
            coordinated_leader_election: false,
            lease_candidates: false,
            stripped_annotations: Vec::new(),
            held_pod_write: None,
            pod_admission: None,
        }
    }
}

#[derive(Debug)]
struct Shared {
    objects: Mutex<Objects>,
    behaviour: Mutex<Behaviour>,
    events: Mutex<Vec<Value>>,
    changes: broadcast::Sender<Change>,
    /// Where the objects are kept across restarts, if anywhere.
    state_file: Option<PathBuf>,
}

impl Shared {
    fn objects(&self) -> MutexGuard<'_, Objects> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn behaviour(&self) -> MutexGuard<'_, Behaviour> {
        self.behaviour.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Saves the objects (with a state file) and tells the watches, once a change is stored.
    fn committed(&self, objects: &Objects, change: Change) {
        if let Some(path) = &self.state_file
            && let Err(err) = objects.save(path)
        {
            eprintln!("kube-api-server: saving {}: {err}", path.display());
        }
        let _ = self.changes.send(change);
    }

    /// [`committed`](Self::committed) for a write that changed the object; a skipped write
    /// changed nothing and tells nobody.
    fn written(&self, objects: &Objects, write: &Write) {
        if let Write::Changed(change) = write {
            self.committed(objects, change.clone());
        }
    }
}

/// A running test API server; it stops with the runtime that started it.
#[derive(Clone, Debug)]
pub struct KubeApiServer {
    shared: Arc<Shared>,
    url: String,
}

impl KubeApiServer {
    /// Starts a server on a free loopback port, on the current runtime, with no state file.
    ///
    /// # Panics
    /// If no loopback port can be bound.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        Self::serve(listener, None).expect("a server without a state file")
    }

    /// Serves on `listener`, keeping the objects in `state_file` (read first if it exists, and
    /// written after every change) when one is given.
    ///
    /// # Errors
    /// The state file cannot be read.
    pub fn serve(
        listener: tokio::net::TcpListener,
        state_file: Option<&Path>,
    ) -> std::io::Result<Self> {
        let objects = match state_file {
            Some(path) => Objects::load(path)?,
            None => Objects::default(),
        };
        let address: SocketAddr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            objects: Mutex::new(objects),
            behaviour: Mutex::default(),
            events: Mutex::default(),
            changes: broadcast::channel(1024).0,
            state_file: state_file.map(Path::to_owned),
        });
        let server = Self {
            shared,
            url: format!("http://{address}"),
        };
        let app = routes::router(server.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(server)
    }

    /// The server's base URL, `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A kubeconfig that points at this server, with `namespace` as the context's namespace.
    #[must_use]
    pub fn kubeconfig(&self, namespace: &str) -> String {
        kubeconfig(&self.url, namespace)
    }

    /// Denies `verb` (get, create, update, patch, watch, list, delete) on leases, as a Role
    /// without it would.
    pub fn deny(&self, verb: &str) {
        self.deny_on("leases", verb);
    }

    /// Allows `verb` on leases again.
    pub fn allow(&self, verb: &str) {
        self.allow_on("leases", verb);
    }

    /// Denies `verb` on `resource` (`leases`, `leasecandidates` or `pods`).
    pub fn deny_on(&self, resource: &str, verb: &str) {
        let denied = (resource.to_owned(), verb.to_owned());
        self.shared.behaviour().denied.insert(denied);
    }

    /// Allows `verb` on `resource` again.
    pub fn allow_on(&self, resource: &str, verb: &str) {
        let denied = (resource.to_owned(), verb.to_owned());
        self.shared.behaviour().denied.remove(&denied);
    }

    /// Serves `coordination.k8s.io/v1beta1` LeaseCandidates, as kube-apiserver does with
    /// `--runtime-config=coordination.k8s.io/v1beta1=true` (a beta API: not served by default,
    /// `pkg/registry/coordination/rest/storage_coordination.go` `v1beta1Storage`; the feature
    /// gate does not change that). Without it they are 404, as on a stock cluster.
    pub fn serve_lease_candidates(&self) {
        self.shared.behaviour().lease_candidates = true;
    }

    /// Turns kube-apiserver's `CoordinatedLeaderElection` feature gate on: the Lease strategy
    /// keeps `strategy` and `preferredHolder` (`pkg/registry/coordination/lease/strategy.go`).
    /// Off, the default, it drops them, as a stock cluster does.
    pub fn enable_coordinated_leader_election(&self) {
        self.shared.behaviour().coordinated_leader_election = true;
    }

    /// Runs coordinated leader election as kube-apiserver does with the `CoordinatedLeaderElection`
    /// feature gate on and `coordination.k8s.io/v1beta1` served: both turned on, and the
    /// [`coordinator`] running on the current runtime. Without it, nobody elects among
    /// LeaseCandidates, as on a cluster with the gate off.
    pub fn start_coordinator(&self) {
        self.serve_lease_candidates();
        self.enable_coordinated_leader_election();
        tokio::spawn(coordinator::run(self.clone()));
    }

    /// Removes the annotation `key` from every Lease written (created, replaced or patched), as
    /// a mutating admission webhook or policy engine (`MutatingAdmissionWebhook`, run after the
    /// strategy and before storage) that rewrites Leases would. Not part of a stock cluster: for
    /// tests of clients that must notice what was not stored.
    pub fn strip_annotation(&self, key: &str) {
        self.shared
            .behaviour()
            .stripped_annotations
            .push(key.to_owned());
    }

    /// Makes every PUT of a Lease or a LeaseCandidate answer after `delay`, as a busy API server
    /// would.
    pub fn delay_writes(&self, delay: Duration) {
        self.shared.behaviour().write_delay = delay;
    }

    /// Answers the next PUTs with these status codes (429 with `Retry-After: 1`, 5xx without)
    /// instead of doing them, as an overloaded API server or its priority and fairness would.
    pub fn reject_writes(&self, codes: &[u16]) {
        self.shared.behaviour().reject_writes.extend(codes);
    }

    /// How many of the codes given to [`reject_writes`](Self::reject_writes) no PUT has met yet.
    pub fn rejections_left(&self) -> usize {
        self.shared.behaviour().reject_writes.len()
    }

    /// Sends watches that allow them a BOOKMARK this often.
    pub fn bookmark_every(&self, every: Duration) {
        self.shared.behaviour().bookmark_every = every;
    }

    /// Forgets the history of changes, as etcd's compaction does: a watch from an older
    /// `resourceVersion` gets 410 Gone.
    pub fn compact(&self) {
        self.shared.objects().history.clear();
    }

    /// Answers the next `n` watches with 410 Gone, as after a compaction or a watch cache
    /// re-initialisation.
    pub fn expire_watches(&self, n: usize) {
        self.shared.behaviour().expire_watches = n;
    }

    /// Ends every watch after `after` on the server's side.
    pub fn end_watches_after(&self, after: Duration) {
        self.shared.behaviour().watch_timeout = Some(after);
    }

    /// How many list requests (not watches) the server received.
    #[must_use]
    pub fn lists(&self) -> usize {
        self.shared.behaviour().lists
    }

    /// How many watch requests the server received.
    #[must_use]
    pub fn watches(&self) -> usize {
        self.shared.behaviour().watches
    }

    /// Stores `lease` (any JSON, unvalidated) as it is, as a client that bypassed the API
    /// server's checks (or an older server) would have left it.
    pub fn put_raw(&self, namespace: &str, name: &str, mut lease: Value) {
        lease["metadata"]["name"] = json!(name);
        lease["metadata"]["namespace"] = json!(namespace);
        self.put(Resource::Lease, namespace, name, lease);
    }

    /// Stores `object` as it is, and tells the watchers.
    fn put(&self, resource: Resource, namespace: &str, name: &str, object: Value) {
        let mut objects = self.shared.objects();
        let key = (resource, namespace.to_owned(), name.to_owned());
        let write = objects.store(&key, object);
        self.shared.written(&objects, &write);
    }

    /// The stored Lease, if there is one.
    #[must_use]
    pub fn lease(&self, namespace: &str, name: &str) -> Option<Value> {
        self.object(Resource::Lease, namespace, name)
    }

    /// The stored LeaseCandidate, if there is one.
    #[must_use]
    pub fn lease_candidate(&self, namespace: &str, name: &str) -> Option<Value> {
        self.object(Resource::LeaseCandidate, namespace, name)
    }

    fn object(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        let key = (resource, namespace.to_owned(), name.to_owned());
        self.shared.objects().items.get(&key).cloned()
    }

    /// The Events posted so far.
    #[must_use]
    pub fn events(&self) -> Vec<Value> {
        self.shared
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A kubeconfig for the API server at `url` (plain HTTP, no credentials), with `namespace` as
/// its context's namespace.
#[must_use]
pub fn kubeconfig(url: &str, namespace: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: {url}
contexts:
- name: test
  context:
    cluster: test
    user: test
    namespace: {namespace}
current-context: test
users:
- name: test
  user: {{}}
"
    )
}

impl KubeApiServer {
    /// Stores a running Pod `name` in `namespace` with `labels`, as a Deployment's ReplicaSet
    /// would have created it (one container; `status.phase` `Running`).
    pub fn put_pod(&self, namespace: &str, name: &str, labels: &[(&str, &str)]) {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let pod = json!({
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"name": "app", "image": "app:1"}]},
            "status": {"phase": "Running"},
        });
        self.put(Resource::Pod, namespace, name, pod);
    }

    /// The stored Pod, if there is one.
    #[must_use]
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.object(Resource::Pod, namespace, name)
    }

    /// The names of the Pods in `namespace` that `selector` (a label selector, such as
    /// `leader-rs.io/leader=billing`) selects, in name order.
    ///
    /// # Panics
    /// If `selector` does not parse.
    #[must_use]
    pub fn pods_selected(&self, namespace: &str, selector: &str) -> Vec<String> {
        let selector = Selector::parse(selector).expect("a valid label selector");
        self.shared
            .objects()
            .items
            .iter()
            .filter(|((resource, ns, _), pod)| {
                *resource == Resource::Pod
                    && ns == namespace
                    && selector.matches(&pod["metadata"]["labels"])
            })
            .map(|((_, _, name), _)| name.clone())
            .collect()
    }

    /// Makes every Pod write (PATCH, PUT) answer after `delay`, as a busy API server would.
    pub fn delay_pod_writes(&self, delay: Duration) {
        self.shared.behaviour().pod_write_delay = delay;
    }

    /// Runs `check` on every update of a Pod (PATCH, PUT) that passed the Pod strategy and
    /// validation, as the ValidatingAdmissionPolicy `name` with a binding of the same name and
    /// `validationActions: [Deny]` would (`staging/src/k8s.io/apiserver/pkg/admission/plugin/
    /// policy/validating/dispatcher.go`): an `Err(message)` is 422 `Invalid`, "pods \"NAME\" is
    /// forbidden: ValidatingAdmissionPolicy 'name' with binding 'name' denied request:
    /// message", and nothing is stored. The check decides who the request is from by its bearer
    /// token, as the API server's authenticator does.
    pub fn admit_pod_updates(
        &self,
        name: &str,
        check: impl Fn(&Value, &Value, &str) -> Result<(), String> + Send + Sync + 'static,
    ) {
        self.shared.behaviour().pod_admission = Some(PodAdmission {
            name: name.to_owned(),
            check: Arc::new(check),
        });
    }

    /// The refusal of the Pod admission policy, if one is installed and refuses the update of
    /// `old` into `new`.
    fn pod_admission_refuses(
        &self,
        name: &str,
        old: &Value,
        new: &Value,
        headers: &axum::http::HeaderMap,
    ) -> Option<String> {
        let admission = self.shared.behaviour().pod_admission.clone()?;
        let token = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        (admission.check)(old, new, token).err().map(|message| {
            format!(
                "pods \"{name}\" is forbidden: ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request: {message}",
                policy = admission.name
            )
        })
    }

    /// Holds the next PATCH of a Pod until the returned handle releases it, while every other
    /// request goes on: a write that lands late, after writes sent later.
    #[must_use = "the held write waits until the handle releases it"]
    pub fn hold_next_pod_write(&self) -> HeldWrite {
        let (arrived_tx, arrived) = tokio::sync::oneshot::channel();
        let (release, release_rx) = tokio::sync::oneshot::channel();
        let (answered_tx, answered) = tokio::sync::oneshot::channel();
        self.shared.behaviour().held_pod_write = Some(HeldSlot {
            arrived: arrived_tx,
            release: release_rx,
            answered: answered_tx,
        });
        HeldWrite {
            arrived,
            release,
            answered,
        }
    }
}
