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
    /// Recent changes (revision, type, object), for watches from a `resourceVersion`.
    history: Vec<(u64, String, Value)>,
    /// How often a watch that allows them gets a BOOKMARK.
    bookmark_every: std::time::Duration,
    /// Watches to answer with 410 Gone whatever version they ask for.
    expire_watches: usize,
    /// Ends every watch after this long, whatever `timeoutSeconds` asked.
    watch_timeout: Option<std::time::Duration>,
}

impl Default for Objects {
    fn default() -> Self {
        Self {
            revision: 0,
            leases: HashMap::new(),
            events: Vec::new(),
            denied: HashSet::new(),
            write_delay: std::time::Duration::ZERO,
            watches: 0,
            reject_writes: std::collections::VecDeque::new(),
            history: Vec::new(),
            // The watch cache sends them about once a minute.
            bookmark_every: std::time::Duration::from_secs(60),
            expire_watches: 0,
            watch_timeout: None,
        }
    }
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
                get(read).put(replace).patch(patch).delete(remove),
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

    /// Sends watches that allow them a BOOKMARK this often.
    pub fn bookmark_every(&self, every: std::time::Duration) {
        self.objects.lock().unwrap().bookmark_every = every;
    }

    /// Forgets the history of changes, as etcd's compaction does: a watch from an older
    /// `resourceVersion` gets 410 Gone.
    pub fn compact(&self) {
        self.objects.lock().unwrap().history.clear();
    }

    /// Answers the next `n` watches with 410 Gone, as after a compaction or a watch cache
    /// re-initialisation.
    pub fn expire_watches(&self, n: usize) {
        self.objects.lock().unwrap().expire_watches = n;
    }

    /// Ends every watch after `after` on the server's side.
    pub fn end_watches_after(&self, after: std::time::Duration) {
        self.objects.lock().unwrap().watch_timeout = Some(after);
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
        let kind = if existed { "MODIFIED" } else { "ADDED" };
        objects.record(kind, lease.clone());
        let _ = self.changes.send((kind.into(), lease));
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

/// kube-apiserver's validation of a Lease (`pkg/apis/coordination/validation`,
/// `ValidateLeaseSpec`): a set `leaseDurationSeconds` must be greater than 0, a set
/// `leaseTransitions` at least 0, and `preferredHolder` may be set only with `strategy`. Answered
/// as 422 `Invalid`, as the registry store does.
fn validate(lease: &Value) -> Result<(), String> {
    let spec = &lease["spec"];
    if let Some(seconds) = spec["leaseDurationSeconds"].as_i64()
        && seconds <= 0
    {
        return Err(format!(
            "spec.leaseDurationSeconds: Invalid value: {seconds}: must be greater than 0"
        ));
    }
    if let Some(transitions) = spec["leaseTransitions"].as_i64()
        && transitions < 0
    {
        return Err(format!(
            "spec.leaseTransitions: Invalid value: {transitions}: must be greater than or equal to 0"
        ));
    }
    if spec["preferredHolder"].is_string() && !spec["strategy"].is_string() {
        return Err(
            "spec.preferredHolder: Forbidden: may only be specified if `strategy` is defined"
                .into(),
        );
    }
    Ok(())
}

/// `MicroTime` as the API server stores and returns it: RFC 3339, UTC, exactly six fractional
/// digits (`metav1.MicroTime`'s `RFC3339Micro`), whatever precision or offset the client sent.
fn normalize_times(lease: &mut Value) -> Result<(), String> {
    for field in ["acquireTime", "renewTime"] {
        let Some(text) = lease["spec"][field].as_str() else {
            continue;
        };
        let time = chrono::DateTime::parse_from_rfc3339(text)
            .map_err(|err| format!("spec.{field}: {text:?}: {err}"))?;
        lease["spec"][field] = json!(
            time.with_timezone(&chrono::Utc)
                .format("%Y-%m-%dT%H:%M:%S%.6fZ")
                .to_string()
        );
    }
    Ok(())
}

fn invalid(name: &str, message: String) -> Response {
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!("Lease.coordination.k8s.io \"{name}\" is invalid: {message}"),
        name,
    )
}

fn conflict(name: &str) -> Response {
    status(
        StatusCode::CONFLICT,
        "Conflict",
        format!(
            "Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
        ),
        name,
    )
}

fn not_found(name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("leases.coordination.k8s.io \"{name}\" not found"),
        name,
    )
}

impl Objects {
    /// Stores `lease` as the registry store does after validation: type meta, namespace, a new
    /// `resourceVersion` (and `uid`, `creationTimestamp` on create), then records the event.
    fn store(&mut self, ns: &str, name: &str, mut lease: Value, kind: &str) -> Value {
        self.revision += 1;
        let previous = self.leases.get(&(ns.to_owned(), name.to_owned())).cloned();
        lease["apiVersion"] = json!("coordination.k8s.io/v1");
        lease["kind"] = json!("Lease");
        lease["metadata"]["name"] = json!(name);
        lease["metadata"]["namespace"] = json!(ns);
        lease["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        match previous {
            Some(previous) => {
                lease["metadata"]["uid"] = previous["metadata"]["uid"].clone();
                lease["metadata"]["creationTimestamp"] =
                    previous["metadata"]["creationTimestamp"].clone();
            }
            None => {
                lease["metadata"]["uid"] = json!(format!("uid-{}", self.revision));
                lease["metadata"]["creationTimestamp"] =
                    json!(chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string());
            }
        }
        self.leases
            .insert((ns.to_owned(), name.to_owned()), lease.clone());
        self.record(kind, lease.clone());
        lease
    }

    fn record(&mut self, kind: &str, object: Value) {
        self.history.push((self.revision, kind.to_owned(), object));
        if self.history.len() > 1000 {
            self.history.remove(0);
        }
    }
}

fn parse_body(name: &str, body: &Bytes) -> Result<Value, Box<Response>> {
    serde_json::from_slice::<Value>(body).map_err(|err| {
        Box::new(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!("invalid JSON: {err}"),
            name,
        ))
    })
}

async fn create(State(api): State<FakeApi>, Path(ns): Path<String>, body: Bytes) -> Response {
    let mut lease = match parse_body("", &body) {
        Ok(lease) => lease,
        Err(response) => return *response,
    };
    let name = lease["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if let Some(denied) = api.denied("create", &ns, &name) {
        return denied;
    }
    if let Err(message) = validate(&lease).and_then(|()| normalize_times(&mut lease)) {
        return invalid(&name, message);
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
    let stored = objects.store(&ns, &name, lease, "ADDED");
    drop(objects);
    let _ = api.changes.send(("ADDED".into(), stored.clone()));
    json_response(StatusCode::CREATED, &stored)
}

/// PUT, as the registry store's update path does for Leases (`pkg/registry/coordination/lease/
/// strategy.go`): `AllowCreateOnUpdate` is true, so a PUT of a missing Lease creates it (201);
/// `AllowUnconditionalUpdate` is false, so a PUT of an existing Lease without a
/// `resourceVersion` is 422, and one with another version is 409.
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
    let mut lease = match parse_body(&name, &body) {
        Ok(lease) => lease,
        Err(response) => return *response,
    };
    if let Err(message) = validate(&lease).and_then(|()| normalize_times(&mut lease)) {
        return invalid(&name, message);
    }
    let mut objects = api.objects.lock().unwrap();
    let current = objects.leases.get(&(ns.clone(), name.clone())).cloned();
    let (stored, code, kind) = match current {
        None => (
            objects.store(&ns, &name, lease, "ADDED"),
            StatusCode::CREATED,
            "ADDED",
        ),
        Some(current) => {
            let Some(expected) = lease["metadata"]["resourceVersion"].as_str() else {
                return invalid(
                    &name,
                    "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"
                        .into(),
                );
            };
            if Some(expected) != current["metadata"]["resourceVersion"].as_str() {
                return conflict(&name);
            }
            (
                objects.store(&ns, &name, lease, "MODIFIED"),
                StatusCode::OK,
                "MODIFIED",
            )
        }
    };
    drop(objects);
    let _ = api.changes.send((kind.into(), stored.clone()));
    json_response(code, &stored)
}

/// RFC 7386 JSON merge patch: objects merge key by key, `null` removes, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                if value.is_null() {
                    target.remove(key);
                } else {
                    merge(target.entry(key.clone()).or_insert(Value::Null), value);
                }
            }
        }
        (target, patch) => *target = patch.clone(),
    }
}

#[derive(serde::Deserialize)]
struct PatchQuery {
    #[serde(rename = "fieldManager")]
    field_manager: Option<String>,
}

/// PATCH in the forms Lease clients send (`staging/src/k8s.io/apiserver/pkg/endpoints/handlers/
/// patch.go`): `application/merge-patch+json` (RFC 7386), `application/strategic-merge-patch+json`
/// (for a Lease, whose spec has no lists, the same as a merge patch; `ownerReferences` are
/// replaced rather than merged by uid), and `application/apply-patch+yaml` (server-side apply,
/// which needs `fieldManager` and creates a missing Lease; field ownership conflicts are not
/// modelled). A `resourceVersion` in the patch is a precondition (409 if it differs). The
/// result is validated as an update is.
async fn patch(
    State(api): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
    Query(query): Query<PatchQuery>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(denied) = api.denied("patch", &ns, &name) {
        return denied;
    }
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let apply = match content_type.as_str() {
        "application/merge-patch+json" | "application/strategic-merge-patch+json" => false,
        "application/apply-patch+yaml" => true,
        other => {
            return status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                format!(
                    "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json, application/apply-patch+yaml (not {other:?})"
                ),
                &name,
            );
        }
    };
    if apply && query.field_manager.as_deref().is_none_or(str::is_empty) {
        return invalid(
            &name,
            "fieldManager: Required value: is required for apply patch".into(),
        );
    }
    let patch = match parse_body(&name, &body) {
        Ok(patch) => patch,
        Err(response) => return *response,
    };
    let mut objects = api.objects.lock().unwrap();
    let current = objects.leases.get(&(ns.clone(), name.clone())).cloned();
    let (mut lease, kind, code) = match current {
        Some(current) => {
            if let Some(expected) = patch["metadata"]["resourceVersion"].as_str()
                && Some(expected) != current["metadata"]["resourceVersion"].as_str()
            {
                return conflict(&name);
            }
            (current, "MODIFIED", StatusCode::OK)
        }
        None if apply => (
            json!({"metadata": {"name": name}}),
            "ADDED",
            StatusCode::CREATED,
        ),
        None => return not_found(&name),
    };
    merge(&mut lease, &patch);
    if let Err(message) = validate(&lease).and_then(|()| normalize_times(&mut lease)) {
        return invalid(&name, message);
    }
    let stored = objects.store(&ns, &name, lease, kind);
    drop(objects);
    let _ = api.changes.send((kind.into(), stored.clone()));
    json_response(code, &stored)
}

async fn remove(State(api): State<FakeApi>, Path((ns, name)): Path<(String, String)>) -> Response {
    let mut objects = api.objects.lock().unwrap();
    let removed = objects.leases.remove(&(ns, name.clone()));
    match removed {
        Some(lease) => {
            objects.revision += 1;
            let mut deleted = lease.clone();
            deleted["metadata"]["resourceVersion"] = json!(objects.revision.to_string());
            objects.record("DELETED", deleted.clone());
            drop(objects);
            let _ = api.changes.send(("DELETED".into(), deleted));
            json_response(StatusCode::OK, &lease)
        }
        None => not_found(&name),
    }
}

#[derive(serde::Deserialize, Default)]
struct ListQuery {
    watch: Option<String>,
    #[serde(rename = "fieldSelector")]
    field_selector: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
    #[serde(rename = "timeoutSeconds")]
    timeout_seconds: Option<u64>,
    #[serde(rename = "allowWatchBookmarks")]
    allow_watch_bookmarks: Option<bool>,
}

/// LIST and WATCH as the watch cache serves them (`staging/src/k8s.io/apiserver/pkg/storage/
/// cacher`): `resourceVersion=0` (or none) starts with the current state as `ADDED` events; a
/// numeric version replays every change after it, or, once it is older than the history kept,
/// sends one `ERROR` event with a 410 `Expired` status ("too old resource version") and ends.
/// `timeoutSeconds` ends the stream on the server's side; with `allowWatchBookmarks=true` a
/// `BOOKMARK` carrying the current `resourceVersion` is sent every [`FakeApi::bookmark_every`].
async fn list_or_watch(
    State(api): State<FakeApi>,
    Path(ns): Path<String>,
    Query(query): Query<ListQuery>,
) -> Response {
    let name = query
        .field_selector
        .as_deref()
        .and_then(|f| f.strip_prefix("metadata.name="))
        .map(str::to_owned);
    let verb = if query
        .watch
        .as_deref()
        .is_some_and(|w| w == "true" || w == "1")
    {
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
        let objects = api.objects.lock().unwrap();
        let items: Vec<Value> = objects
            .leases
            .values()
            .filter(|l| matches(l))
            .cloned()
            .collect();
        return json_response(
            StatusCode::OK,
            &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "LeaseList",
                "metadata": {"resourceVersion": objects.revision.to_string()}, "items": items}),
        );
    }
    let (initial, expired) = {
        let mut objects = api.objects.lock().unwrap();
        if objects.expire_watches > 0 {
            objects.expire_watches -= 1;
            (Vec::new(), true)
        } else {
            match query.resource_version.as_deref().unwrap_or("0") {
                "0" | "" => (
                    objects
                        .leases
                        .values()
                        .filter(|l| matches(l))
                        .map(|l| ("ADDED".to_owned(), l.clone()))
                        .collect::<Vec<_>>(),
                    false,
                ),
                from => {
                    let from: u64 = from.parse().unwrap_or(0);
                    let oldest = objects
                        .history
                        .first()
                        .map_or(objects.revision, |(rv, _, _)| *rv);
                    if from + 1 < oldest {
                        (Vec::new(), true)
                    } else {
                        (
                            objects
                                .history
                                .iter()
                                .filter(|(rv, _, object)| *rv > from && matches(object))
                                .map(|(_, kind, object)| (kind.clone(), object.clone()))
                                .collect(),
                            false,
                        )
                    }
                }
            }
        }
    };
    use futures_util::StreamExt;
    let line = |kind: &str, object: &Value| {
        Ok::<_, Infallible>(Bytes::from(format!(
            "{}\n",
            json!({"type": kind, "object": object})
        )))
    };
    if expired {
        let gone = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version", "reason": "Expired", "code": 410});
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(futures_util::stream::iter([line(
                "ERROR", &gone,
            )])))
            .expect("response");
    }
    let rx = api.changes.subscribe();
    let changes = futures_util::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(change) => return Some((change, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
    .filter(move |(_, lease)| std::future::ready(matches(lease)));
    let bookmarks = {
        let every = api.objects.lock().unwrap().bookmark_every;
        let api = api.clone();
        let enabled = query.allow_watch_bookmarks.unwrap_or(false);
        futures_util::stream::unfold((), move |()| {
            let api = api.clone();
            async move {
                if !enabled {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(every).await;
                let revision = api.objects.lock().unwrap().revision;
                let bookmark = json!({"kind": "Lease", "apiVersion": "coordination.k8s.io/v1",
                    "metadata": {"resourceVersion": revision.to_string()}});
                Some((("BOOKMARK".to_owned(), bookmark), ()))
            }
        })
    };
    let events = futures_util::stream::iter(initial)
        .chain(futures_util::stream::select(changes, bookmarks))
        .map(move |(kind, object)| line(&kind, &object));
    let deadline = api
        .objects
        .lock()
        .unwrap()
        .watch_timeout
        .or(query.timeout_seconds.map(std::time::Duration::from_secs));
    let events = futures_util::stream::StreamExt::take_until(events, async move {
        match deadline {
            Some(after) => tokio::time::sleep(after).await,
            None => std::future::pending().await,
        }
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(events))
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
