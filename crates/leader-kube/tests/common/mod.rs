//! A small Kubernetes API server for tests, serving what the Lease lock uses with the real API's
//! contract: Lease JSON with `resourceVersion`s, 409 `Status` bodies (reasons `Conflict` and
//! `AlreadyExists`), 404 `NotFound`, 403 `Forbidden` for a denied verb, a chunked watch stream
//! (ADDED / MODIFIED / DELETED events), and the core/v1 Events endpoint. The lock talks to it
//! through a real `kube::Client` over HTTP.

#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
use leader_kube::LeaseLock;
use serde_json::{Value, json};
use tokio::sync::broadcast;

#[derive(Default)]
struct Objects {
    revision: u64,
    leases: HashMap<(String, String), Value>,
    events: Vec<Value>,
    denied: HashSet<String>,
    /// How long a PUT takes to answer.
    write_delay: std::time::Duration,
    /// Watch requests received.
    watches: usize,
    /// Answers for the next PUTs instead of doing them: a status code each.
    reject_writes: std::collections::VecDeque<u16>,
}

/// The fake API server; dropped with the test's runtime.
#[derive(Clone)]
pub struct FakeApi {
    objects: Arc<Mutex<Objects>>,
    changes: broadcast::Sender<(String, Value)>,
    pub url: String,
}

fn status(code: StatusCode, reason: &str, message: String, name: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason,
        "details": {"name": name, "group": "coordination.k8s.io", "kind": "leases"},
        "code": code.as_u16(),
    });
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

impl FakeApi {
    /// Starts the server on a free loopback port.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let api = Self {
            objects: Arc::default(),
            changes: broadcast::channel(1024).0,
            url,
        };
        let app = Router::new()
            .route(
                "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
                post(create).get(list_or_watch),
            )
            .route(
                "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}",
                get(read).put(replace).delete(remove),
            )
            .route("/api/v1/namespaces/{ns}/events", post(event))
            .with_state(api.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        api
    }

    /// A kube client for this server.
    pub fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url.parse().expect("url"));
        kube::Client::try_from(config).expect("client")
    }

    /// Denies `verb` (get, create, update, watch, list) on leases, as a Role without it would.
    pub fn deny(&self, verb: &str) {
        self.objects.lock().unwrap().denied.insert(verb.to_owned());
    }

    /// Makes every PUT answer after `delay`, as a busy API server would.
    pub fn delay_writes(&self, delay: std::time::Duration) {
        self.objects.lock().unwrap().write_delay = delay;
    }

    /// Answers the next PUTs with these status codes (429 with `Retry-After: 1`, 5xx) instead of
    /// doing them, as an overloaded API server or its priority and fairness would.
    pub fn reject_writes(&self, codes: &[u16]) {
        self.objects.lock().unwrap().reject_writes.extend(codes);
    }

    /// How many watch requests the server received.
    pub fn watches(&self) -> usize {
        self.objects.lock().unwrap().watches
    }

    pub fn allow(&self, verb: &str) {
        self.objects.lock().unwrap().denied.remove(verb);
    }

    /// Stores `lease` (any JSON) as it is, as another client (client-go, kubectl) would.
    pub fn put_raw(&self, ns: &str, name: &str, mut lease: Value) {
        let mut objects = self.objects.lock().unwrap();
        objects.revision += 1;
        lease["metadata"]["resourceVersion"] = json!(objects.revision.to_string());
        let existed = objects
            .leases
            .insert((ns.into(), name.into()), lease.clone())
            .is_some();
        let _ = self
            .changes
            .send((if existed { "MODIFIED" } else { "ADDED" }.into(), lease));
    }

    pub fn lease(&self, ns: &str, name: &str) -> Option<Value> {
        self.objects
            .lock()
            .unwrap()
            .leases
            .get(&(ns.into(), name.into()))
            .cloned()
    }

    pub fn events(&self) -> Vec<Value> {
        self.objects.lock().unwrap().events.clone()
    }

    fn denied(&self, verb: &str, ns: &str, name: &str) -> Option<Response> {
        self.objects.lock().unwrap().denied.contains(verb).then(|| {
            status(
                StatusCode::FORBIDDEN,
                "Forbidden",
                format!(
                    "leases.coordination.k8s.io \"{name}\" is forbidden: User \"system:serviceaccount:{ns}:leader\" cannot {verb} resource \"leases\" in API group \"coordination.k8s.io\" in the namespace \"{ns}\""
                ),
                name,
            )
        })
    }
}

async fn read(State(api): State<FakeApi>, Path((ns, name)): Path<(String, String)>) -> Response {
    if let Some(denied) = api.denied("get", &ns, &name) {
        return denied;
    }
    match api.lease(&ns, &name) {
        Some(lease) => json_response(StatusCode::OK, &lease),
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("leases.coordination.k8s.io \"{name}\" not found"),
            &name,
        ),
    }
}

async fn create(State(api): State<FakeApi>, Path(ns): Path<String>, body: Bytes) -> Response {
    let Ok(mut lease) = serde_json::from_slice::<Value>(&body) else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "invalid JSON".into(),
            "",
        );
    };
    let name = lease["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if let Some(denied) = api.denied("create", &ns, &name) {
        return denied;
    }
    let mut objects = api.objects.lock().unwrap();
    if objects.leases.contains_key(&(ns.clone(), name.clone())) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("leases.coordination.k8s.io \"{name}\" already exists"),
            &name,
        );
    }
    objects.revision += 1;
    lease["apiVersion"] = json!("coordination.k8s.io/v1");
    lease["kind"] = json!("Lease");
    lease["metadata"]["namespace"] = json!(ns);
    lease["metadata"]["resourceVersion"] = json!(objects.revision.to_string());
    lease["metadata"]["uid"] = json!(format!("uid-{}", objects.revision));
    objects.leases.insert((ns, name), lease.clone());
    let _ = api.changes.send(("ADDED".into(), lease.clone()));
    json_response(StatusCode::CREATED, &lease)
}

async fn replace(
    State(api): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    if let Some(denied) = api.denied("update", &ns, &name) {
        return denied;
    }
    let (delay, rejected) = {
        let mut objects = api.objects.lock().unwrap();
        (objects.write_delay, objects.reject_writes.pop_front())
    };
    tokio::time::sleep(delay).await;
    if let Some(code) = rejected {
        let code = StatusCode::from_u16(code).expect("status code");
        let mut response = status(code, "TooManyRequests", "the server is busy".into(), &name);
        response
            .headers_mut()
            .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        return response;
    }
    let Ok(mut lease) = serde_json::from_slice::<Value>(&body) else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "invalid JSON".into(),
            &name,
        );
    };
    let mut objects = api.objects.lock().unwrap();
    let Some(current) = objects.leases.get(&(ns.clone(), name.clone())) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("leases.coordination.k8s.io \"{name}\" not found"),
            &name,
        );
    };
    // An update names the version it read; without one it is unconditional, as in the real API.
    if let Some(expected) = lease["metadata"]["resourceVersion"].as_str()
        && Some(expected) != current["metadata"]["resourceVersion"].as_str()
    {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
            ),
            &name,
        );
    }
    let uid = current["metadata"]["uid"].clone();
    objects.revision += 1;
    lease["apiVersion"] = json!("coordination.k8s.io/v1");
    lease["kind"] = json!("Lease");
    lease["metadata"]["namespace"] = json!(ns);
    lease["metadata"]["uid"] = uid;
    lease["metadata"]["resourceVersion"] = json!(objects.revision.to_string());
    objects.leases.insert((ns, name), lease.clone());
    let _ = api.changes.send(("MODIFIED".into(), lease.clone()));
    json_response(StatusCode::OK, &lease)
}

async fn remove(State(api): State<FakeApi>, Path((ns, name)): Path<(String, String)>) -> Response {
    let removed = api
        .objects
        .lock()
        .unwrap()
        .leases
        .remove(&(ns, name.clone()));
    match removed {
        Some(lease) => {
            let _ = api.changes.send(("DELETED".into(), lease.clone()));
            json_response(StatusCode::OK, &lease)
        }
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("leases.coordination.k8s.io \"{name}\" not found"),
            &name,
        ),
    }
}

async fn list_or_watch(
    State(api): State<FakeApi>,
    Path(ns): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let name = query
        .get("fieldSelector")
        .and_then(|f| f.strip_prefix("metadata.name="))
        .map(str::to_owned);
    let verb = if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
        "watch"
    } else {
        "list"
    };
    if let Some(denied) = api.denied(verb, &ns, name.as_deref().unwrap_or("")) {
        return denied;
    }
    if verb == "watch" {
        api.objects.lock().unwrap().watches += 1;
    }
    let matches = move |lease: &Value| {
        lease["metadata"]["namespace"].as_str() == Some(ns.as_str())
            && name
                .as_deref()
                .is_none_or(|n| lease["metadata"]["name"].as_str() == Some(n))
    };
    if verb == "list" {
        let items: Vec<Value> = api
            .objects
            .lock()
            .unwrap()
            .leases
            .values()
            .filter(|l| matches(l))
            .cloned()
            .collect();
        return json_response(
            StatusCode::OK,
            &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "LeaseList", "metadata": {}, "items": items}),
        );
    }
    // resourceVersion=0: the current state first, as ADDED events, then every change.
    let initial: Vec<Value> = api
        .objects
        .lock()
        .unwrap()
        .leases
        .values()
        .filter(|l| matches(l))
        .cloned()
        .collect();
    let rx = api.changes.subscribe();
    let initial = futures_util::stream::iter(initial.into_iter().map(|l| ("ADDED".to_owned(), l)));
    let changes = futures_util::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(change) => return Some((change, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    use futures_util::StreamExt;
    let lines = initial
        .chain(changes)
        .filter(move |(_, lease)| std::future::ready(matches(lease)))
        .map(|(kind, lease)| {
            Ok::<_, Infallible>(Bytes::from(format!(
                "{}\n",
                json!({"type": kind, "object": lease})
            )))
        });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(lines))
        .expect("response")
}

async fn event(State(api): State<FakeApi>, Path(ns): Path<String>, body: Bytes) -> Response {
    let Ok(mut event) = serde_json::from_slice::<Value>(&body) else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "invalid JSON".into(),
            "",
        );
    };
    let mut objects = api.objects.lock().unwrap();
    objects.revision += 1;
    let prefix = event["metadata"]["generateName"]
        .as_str()
        .unwrap_or("event.")
        .to_owned();
    event["metadata"]["name"] = json!(format!("{prefix}{}", objects.revision));
    event["metadata"]["namespace"] = json!(ns);
    event["metadata"]["resourceVersion"] = json!(objects.revision.to_string());
    objects.events.push(event.clone());
    json_response(StatusCode::CREATED, &event)
}

/// Lease locks on the test API server, for the conformance suite.
pub struct Factory {
    pub api: FakeApi,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(LeaseLock::new(self.api.client(), "default", name, identity))
    }

    async fn corrupt(&self, name: &str) {
        self.api.put_raw(
            "default",
            name,
            json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                   "metadata": {"name": name, "namespace": "default"},
                   "spec": {"holderIdentity": "x", "leaseDurationSeconds": -5, "leaseTransitions": 1}}),
        );
    }
}
