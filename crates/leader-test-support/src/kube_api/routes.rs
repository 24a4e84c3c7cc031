//! The HTTP surface: the Lease, LeaseCandidate and Pod endpoints as kube-apiserver serves them.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use serde_json::{Value, json};

use super::KubeApiServer;
use super::fields;
use super::objects::{Key, Objects, Resource, admit, decode};
use super::validation::Refusal;

mod patch;
mod watch;

use patch::patch;
use watch::list_or_watch;

/// The API group a request's path names: `coordination.k8s.io` under `/apis`, the core group
/// (`""`) under `/api`.
#[derive(Clone, Copy, Debug)]
struct Group(&'static str);

pub(super) fn router(server: KubeApiServer) -> Router {
    let objects = Router::new()
        .route(
            "/{version}/namespaces/{ns}/{resource}",
            post(create).get(list_or_watch),
        )
        .route(
            "/{version}/namespaces/{ns}/{resource}/{name}",
            get(read).put(replace).patch(patch).delete(remove),
        );
    Router::new()
        .nest(
            "/apis/coordination.k8s.io",
            objects
                .clone()
                .layer(Extension(Group("coordination.k8s.io"))),
        )
        .nest("/api", objects.layer(Extension(Group(""))))
        .route("/api/v1/namespaces/{ns}/events", post(event))
        .with_state(server)
}

/// The resource a path names, or the 404 the server answers for one it does not serve:
/// LeaseCandidates only when [`KubeApiServer::serve_lease_candidates`] asked for them.
fn resource_of(
    api: &KubeApiServer,
    Group(group): Group,
    version: &str,
    plural: &str,
) -> Result<Resource, Box<Response>> {
    let served = |resource: &Resource| {
        *resource != Resource::LeaseCandidate || api.shared.behaviour().lease_candidates
    };
    Resource::of_path(group, version, plural)
        .filter(served)
        .ok_or_else(|| {
            let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": "the server could not find the requested resource",
            "reason": "NotFound", "details": {}, "code": 404});
            Box::new(json_response(StatusCode::NOT_FOUND, &body))
        })
}

/// The resource of a request on the object `name`, or the answer the server gives instead:
/// 404 for a resource it does not serve ([`resource_of`]), 403 for a `verb` a test denied.
fn permitted(
    api: &KubeApiServer,
    group: Group,
    version: &str,
    plural: &str,
    verb: &str,
    ns: &str,
    name: &str,
) -> Result<Resource, Box<Response>> {
    let resource = resource_of(api, group, version, plural)?;
    match api.denied(resource, verb, ns, name) {
        Some(denied) => Err(Box::new(denied)),
        None => Ok(resource),
    }
}

/// A `Status` body with `code`, as the API server answers every error.
fn status(
    resource: Resource,
    code: StatusCode,
    reason: &str,
    message: &str,
    name: &str,
    details: Value,
) -> Response {
    let mut details = details;
    details["name"] = json!(name);
    details["group"] = json!(resource.group());
    details["kind"] = json!(resource.plural());
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "details": details, "code": code.as_u16(),
    });
    json_response(code, &body)
}

/// A write refused as a busy API server refuses it, by status code, which is all the lock reads
/// of it: a 429 as priority and fairness sends it, with `Retry-After: 1` (apiserver
/// `filters/priority-and-fairness.go`; `filters/maxinflight.go` sends the same code and header
/// with a plain-text body); a 504 as the timeout filter sends it (`filters/timeout.go`, a
/// `Timeout` Status), and a 500 or 503 without `Retry-After`. (A write storage does not answer
/// in time is a 500 `ServerTimeout` with `Retry-After: 2`, `InterpretUpdateError`: kube-rs
/// retries no 500 either way.)
fn rejection(resource: Resource, code: u16, name: &str) -> Response {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let reason = match code {
        StatusCode::TOO_MANY_REQUESTS => "TooManyRequests",
        StatusCode::GATEWAY_TIMEOUT => "Timeout",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        _ => "InternalError",
    };
    let mut response = status(
        resource,
        code,
        reason,
        "the server is busy",
        name,
        json!({}),
    );
    if code == StatusCode::TOO_MANY_REQUESTS {
        response
            .headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
    }
    response
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn refused(resource: Resource, name: &str, refusal: Refusal) -> Response {
    match refusal {
        Refusal::BadRequest(message) => status(
            resource,
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &message,
            name,
            json!({}),
        ),
        Refusal::Invalid(message) => status(
            resource,
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            &format!(
                "{} \"{name}\" is invalid: {message}",
                resource.qualified(resource.kind())
            ),
            name,
            json!({}),
        ),
    }
}

fn conflict(resource: Resource, name: &str) -> Response {
    conflict_because(
        resource,
        name,
        "the object has been modified; please apply your changes to the latest version and try again",
    )
}

/// 409 `Conflict` for `reason`, as `errors.NewConflict` words it.
fn conflict_because(resource: Resource, name: &str, reason: &str) -> Response {
    status(
        resource,
        StatusCode::CONFLICT,
        "Conflict",
        &format!(
            "Operation cannot be fulfilled on {} \"{name}\": {reason}",
            resource.qualified(resource.plural())
        ),
        name,
        json!({}),
    )
}

/// A failed storage precondition (`staging/src/k8s.io/apiserver/pkg/storage/interfaces.go`
/// `Preconditions.Check`): `field` (`UID` or `ResourceVersion`) of `current` (an empty one for
/// an object that does not exist) is not `expected`, a 409 `Conflict` (the storage's
/// `InvalidObj` error as `storeerr` turns it into one).
fn precondition_failed(
    resource: Resource,
    key: &Key,
    field: &str,
    expected: &str,
    current: Option<&Value>,
) -> Response {
    let meta_field = if field == "UID" {
        "uid"
    } else {
        "resourceVersion"
    };
    let actual = current.map_or("", |c| {
        c["metadata"][meta_field].as_str().unwrap_or_default()
    });
    let (_, ns, name) = key;
    conflict_because(
        resource,
        name,
        &format!(
            "StorageError: invalid object, Code: 4, Key: /registry/{}/{ns}/{name}, ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: {field} in precondition: {expected}, {field} in object meta: {actual}",
            resource.plural()
        ),
    )
}

fn not_found(resource: Resource, name: &str) -> Response {
    status(
        resource,
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!(
            "{} \"{name}\" not found",
            resource.qualified(resource.plural())
        ),
        name,
        json!({}),
    )
}

fn bad_json(resource: Resource, name: &str, body: &Bytes) -> Result<Value, Box<Response>> {
    serde_json::from_slice::<Value>(body).map_err(|err| {
        Box::new(status(
            resource,
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!("invalid JSON: {err}"),
            name,
            json!({}),
        ))
    })
}

impl KubeApiServer {
    /// Whether the `CoordinatedLeaderElection` feature gate is on.
    fn gate_on(&self) -> bool {
        self.shared.behaviour().coordinated_leader_election
    }

    /// 403 for a verb a test denied, in RBAC's words.
    fn denied(&self, resource: Resource, verb: &str, ns: &str, name: &str) -> Option<Response> {
        let plural = resource.plural();
        let denied = self
            .shared
            .behaviour()
            .denied
            .contains(&(plural.to_owned(), verb.to_owned()));
        denied.then(|| {
            status(
                resource,
                StatusCode::FORBIDDEN,
                "Forbidden",
                &format!(
                    "{} \"{name}\" is forbidden: User \"system:serviceaccount:{ns}:leader\" cannot {verb} resource \"{plural}\" in API group \"{}\" in the namespace \"{ns}\"",
                    resource.qualified(plural),
                    resource.group()
                ),
                name,
                json!({}),
            )
        })
    }
}

/// The request's field manager: its `fieldManager` parameter, else its User-Agent's prefix.
fn manager_of(query: &WriteQuery, headers: &HeaderMap) -> String {
    let agent = headers
        .get("user-agent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    fields::manager(query.field_manager.as_deref(), agent)
}

#[derive(serde::Deserialize, Default)]
struct WriteQuery {
    #[serde(rename = "fieldManager")]
    field_manager: Option<String>,
    force: Option<bool>,
}

/// Strips what a client may send but the server decides: the record of field ownership.
fn without_managed_fields(mut object: Value) -> Value {
    // `get_mut`, not indexing, which would add `"metadata": null` to a patch without metadata
    // (and a merge patch would then remove the object's metadata).
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("managedFields");
    }
    object
}

/// Stores a write and answers it: 200 with the object as stored, 201 when it created it.
/// Annotations a test strips ([`KubeApiServer::strip_annotation`]) go first.
fn stored(
    api: &KubeApiServer,
    objects: &mut Objects,
    key: &Key,
    mut object: Value,
    existed: bool,
) -> Response {
    if key.0 == Resource::Lease
        && let Some(annotations) = object
            .get_mut("metadata")
            .and_then(|m| m.get_mut("annotations"))
            .and_then(Value::as_object_mut)
    {
        for stripped in &api.shared.behaviour().stripped_annotations {
            annotations.remove(stripped);
        }
    }
    let write = objects.store(key, object);
    api.shared.written(objects, &write);
    let code = if existed {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    json_response(code, write.object())
}

async fn read(
    State(api): State<KubeApiServer>,
    Extension(group): Extension<Group>,
    Path((version, ns, plural, name)): Path<(String, String, String, String)>,
) -> Response {
    let resource = match permitted(&api, group, &version, &plural, "get", &ns, &name) {
        Ok(resource) => resource,
        Err(response) => return *response,
    };
    match api
        .shared
        .objects()
        .items
        .get(&(resource, ns, name.clone()))
    {
        Some(object) => json_response(StatusCode::OK, object),
        None => not_found(resource, &name),
    }
}

async fn create(
    State(api): State<KubeApiServer>,
    Extension(group): Extension<Group>,
    Path((version, ns, plural)): Path<(String, String, String)>,
    Query(query): Query<WriteQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let resource = match resource_of(&api, group, &version, &plural) {
        Ok(resource) => resource,
        Err(response) => return *response,
    };
    let mut object = match bad_json(resource, "", &body) {
        Ok(object) => without_managed_fields(object),
        Err(response) => return *response,
    };
    let name = object["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if let Some(denied) = api.denied(resource, "create", &ns, &name) {
        return denied;
    }
    if let Err(refusal) = decode(resource, &mut object)
        .and_then(|()| admit(resource, &mut object, &name, None, api.gate_on()))
    {
        return refused(resource, &name, refusal);
    }
    let key = (resource, ns, name.clone());
    let mut objects = api.shared.objects();
    if objects.items.contains_key(&key) {
        return status(
            resource,
            StatusCode::CONFLICT,
            "AlreadyExists",
            &format!(
                "{} \"{name}\" already exists",
                resource.qualified(resource.plural())
            ),
            &name,
            json!({}),
        );
    }
    fields::record_update(
        None,
        &mut object,
        &manager_of(&query, &headers),
        resource.api_version(),
    );
    stored(&api, &mut objects, &key, object, false)
}

/// PUT, as the registry store's update path does for Leases, LeaseCandidates and Pods
/// (`pkg/registry/coordination/lease/strategy.go`, `pkg/registry/coordination/leasecandidate/
/// strategy.go`, `pkg/registry/core/pod/strategy.go`,
/// `staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go` `Update`), in its
/// order:
///
/// - A `metadata.uid` in the body is a precondition (`staging/src/k8s.io/apiserver/pkg/
///   registry/rest/update.go` `defaultUpdatedObjectInfo.Preconditions`), checked against the
///   stored object before anything else (`GuaranteedUpdate`, [`precondition_failed`]): 409 when
///   it differs, also when the object was deleted (its uid is then empty), so a client that
///   sends back the object it read never recreates one that was deleted.
/// - For Leases and LeaseCandidates `AllowCreateOnUpdate` is true, so a PUT of a missing
///   object without a uid creates it (201); `AllowUnconditionalUpdate` is false, so a PUT of an
///   existing object without a `resourceVersion` is 422. For Pods it is the other way round: a
///   missing Pod is 404, and a PUT without `resourceVersion` overwrites. One with another
///   version is 409 for all.
/// - Then the strategy and validation ([`admit`]).
async fn replace(
    State(api): State<KubeApiServer>,
    Extension(group): Extension<Group>,
    Path((version, ns, plural, name)): Path<(String, String, String, String)>,
    Query(query): Query<WriteQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let resource = match permitted(&api, group, &version, &plural, "update", &ns, &name) {
        Ok(resource) => resource,
        Err(response) => return *response,
    };
    let (delay, rejected) = {
        let mut behaviour = api.shared.behaviour();
        let delay = if resource == Resource::Pod {
            behaviour.pod_write_delay
        } else {
            behaviour.write_delay
        };
        (delay, behaviour.reject_writes.pop_front())
    };
    tokio::time::sleep(delay).await;
    if let Some(code) = rejected {
        return rejection(resource, code, &name);
    }
    let mut object = match bad_json(resource, &name, &body) {
        Ok(object) => without_managed_fields(object),
        Err(response) => return *response,
    };
    if let Err(refusal) = decode(resource, &mut object) {
        return refused(resource, &name, refusal);
    }
    let key = (resource, ns, name.clone());
    let mut objects = api.shared.objects();
    let current = objects.items.get(&key).cloned();
    if let Some(uid) = object["metadata"]["uid"].as_str().filter(|u| !u.is_empty())
        && current.as_ref().map(|c| &c["metadata"]["uid"]) != Some(&json!(uid))
    {
        return precondition_failed(resource, &key, "UID", uid, current.as_ref());
    }
    match (&current, object["metadata"]["resourceVersion"].as_str()) {
        (None, _) if !resource.allows_create_on_update() => return not_found(resource, &name),
        (None, _) => {}
        (Some(_), None) if resource.allows_unconditional_update() => {}
        (Some(_), None) => {
            return refused(
                resource,
                &name,
                Refusal::Invalid(
                    "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"
                        .into(),
                ),
            );
        }
        (Some(current), Some(expected)) => {
            if Some(expected) != current["metadata"]["resourceVersion"].as_str() {
                return conflict(resource, &name);
            }
        }
    }
    if let Err(refusal) = admit(
        resource,
        &mut object,
        &name,
        current.as_ref(),
        api.gate_on(),
    ) {
        return refused(resource, &name, refusal);
    }
    fields::record_update(
        current.as_ref(),
        &mut object,
        &manager_of(&query, &headers),
        resource.api_version(),
    );
    if let Some(current) = current.as_ref().filter(|_| resource == Resource::Pod)
        && let Some(message) = api.pod_admission_refuses(&name, current, &object, &headers)
    {
        return policy_refused(resource, &name, &message);
    }
    stored(&api, &mut objects, &key, object, current.is_some())
}

/// 422 `Invalid` with `message`, the cause a ValidatingAdmissionPolicy's denial carries.
fn policy_refused(resource: Resource, name: &str, message: &str) -> Response {
    status(
        resource,
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        message,
        name,
        json!({"causes": [{"message": message}]}),
    )
}

/// DELETE (`staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go` `Delete`): 404
/// for a missing object; the body's `DeleteOptions` may carry `preconditions` (`uid`,
/// `resourceVersion`), checked against the stored object (`Preconditions.Check`, 409 when one
/// differs, [`precondition_failed`]); a body that is not JSON is 400.
async fn remove(
    State(api): State<KubeApiServer>,
    Extension(group): Extension<Group>,
    Path((version, ns, plural, name)): Path<(String, String, String, String)>,
    body: Bytes,
) -> Response {
    let resource = match permitted(&api, group, &version, &plural, "delete", &ns, &name) {
        Ok(resource) => resource,
        Err(response) => return *response,
    };
    let options = if body.is_empty() {
        json!({})
    } else {
        match bad_json(resource, &name, &body) {
            Ok(options) => options,
            Err(response) => return *response,
        }
    };
    let key = (resource, ns, name.clone());
    let mut objects = api.shared.objects();
    let Some(current) = objects.items.get(&key) else {
        return not_found(resource, &name);
    };
    let preconditions = &options["preconditions"];
    for (field, meta_field) in [("UID", "uid"), ("ResourceVersion", "resourceVersion")] {
        if let Some(expected) = preconditions[meta_field].as_str()
            && current["metadata"][meta_field].as_str() != Some(expected)
        {
            return precondition_failed(resource, &key, field, expected, Some(current));
        }
    }
    match objects.remove(&key) {
        Some((object, change)) => {
            api.shared.committed(&objects, change);
            json_response(StatusCode::OK, &object)
        }
        None => not_found(resource, &name),
    }
}

async fn event(State(api): State<KubeApiServer>, Path(ns): Path<String>, body: Bytes) -> Response {
    let mut event = match bad_json(Resource::Lease, "", &body) {
        Ok(event) => event,
        Err(response) => return *response,
    };
    let revision = {
        let mut objects = api.shared.objects();
        objects.revision += 1;
        objects.revision
    };
    let prefix = event["metadata"]["generateName"]
        .as_str()
        .unwrap_or("event.")
        .to_owned();
    event["metadata"]["name"] = json!(format!("{prefix}{revision}"));
    event["metadata"]["namespace"] = json!(ns);
    event["metadata"]["resourceVersion"] = json!(revision.to_string());
    api.shared
        .events
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(event.clone());
    json_response(StatusCode::CREATED, &event)
}
