//! PATCH, in the four forms Lease clients send.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::{
    Group, WriteQuery, bad_json, conflict, manager_of, not_found, permitted, policy_refused,
    refused, status, stored, without_managed_fields,
};
use crate::kube_api::objects::{Key, Resource, admit, decode};
use crate::kube_api::validation::Refusal;
use crate::kube_api::{KubeApiServer, fields};

/// PATCH in the forms Lease clients send (`staging/src/k8s.io/apiserver/pkg/endpoints/handlers/
/// patch.go`): `application/json-patch+json` (RFC 6902, `jsonPatcher.applyJSPatch`: a body
/// that is not a patch is 400, an operation that fails, such as a `test` of
/// `/metadata/resourceVersion` that does not hold, is 422; see [`fields::json_patch`]),
/// `application/merge-patch+json` (RFC 7386), `application/strategic-merge-patch+json` (see
/// [`fields::strategic_merge_patch`]), and `application/apply-patch+yaml` (server-side apply:
/// needs `fieldManager`, creates a missing Lease, conflicts on fields other managers own unless
/// `force=true`; a JSON body, which is YAML too). Only apply creates: the other forms answer 404
/// for a missing object (`createNewObject`). A `resourceVersion` in the patched object other
/// than the stored one is a precondition that fails (409): the patch is applied to the stored
/// object, and `staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go` `Update`
/// answers `NewConflict` when the result's version is not the stored one.
/// The result is decoded and admitted as an update is. Field ownership follows [`fields`].
/// A Pod PATCH that a test holds ([`KubeApiServer::hold_next_pod_write`]) waits before all of
/// this, and is then done whether or not its client still waits for the answer.
pub(super) async fn patch(
    State(api): State<KubeApiServer>,
    Extension(group): Extension<Group>,
    Path(path): Path<(String, String, String, String)>,
    Query(query): Query<WriteQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (_, _, plural, _) = &path;
    let held = (plural == "pods")
        .then(|| api.shared.behaviour().held_pod_write.take())
        .flatten();
    // Nothing of the PATCH runs until this is awaited.
    let patched = apply(api, group, path, query, headers, body);
    let Some(held) = held else {
        return patched.await;
    };
    // Its own task: a request the server has received goes on when its client goes away.
    let task = tokio::spawn(async move {
        let _ = held.arrived.send(());
        let _ = held.release.await;
        let response = patched.await;
        let _ = held.answered.send(response.status().as_u16());
        response
    });
    task.await
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The PATCH itself, once the request is let through; `path` is the request's version,
/// namespace, resource and name.
async fn apply(
    api: KubeApiServer,
    group: Group,
    path: (String, String, String, String),
    query: WriteQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (version, ns, plural, name) = path;
    let resource = match permitted(&api, group, &version, &plural, "patch", &ns, &name) {
        Ok(resource) => resource,
        Err(response) => return *response,
    };
    if resource == Resource::Pod {
        let delay = api.shared.behaviour().pod_write_delay;
        tokio::time::sleep(delay).await;
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
    #[derive(PartialEq)]
    enum Form {
        Json,
        Merge,
        Strategic,
        Apply,
    }
    let form = match content_type.as_str() {
        "application/json-patch+json" => Form::Json,
        "application/merge-patch+json" => Form::Merge,
        "application/strategic-merge-patch+json" => Form::Strategic,
        "application/apply-patch+yaml" => Form::Apply,
        other => {
            return status(
                resource,
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                &format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (not {other:?})"
                ),
                &name,
                json!({}),
            );
        }
    };
    if form == Form::Apply && query.field_manager.as_deref().is_none_or(str::is_empty) {
        return refused(
            resource,
            &name,
            Refusal::Invalid("fieldManager: Required value: is required for apply patch".into()),
        );
    }
    let patch = match bad_json(resource, &name, &body) {
        Ok(patch) if patch.is_object() => without_managed_fields(patch),
        Ok(patch) => patch,
        Err(response) => return *response,
    };
    let key: Key = (resource, ns, name.clone());
    let mut objects = api.shared.objects();
    let current = objects.items.get(&key).cloned();
    if let Some(current) = &current
        && let Some(expected) = patch
            .get("metadata")
            .and_then(|m| m["resourceVersion"].as_str())
        && Some(expected) != current["metadata"]["resourceVersion"].as_str()
    {
        return conflict(resource, &name);
    }
    let manager = manager_of(&query, &headers);
    let api_version = resource.api_version();
    let mut object = match (form, &current) {
        (Form::Apply, _) => {
            let force = query.force.unwrap_or(false);
            match fields::apply(current.as_ref(), &patch, &manager, force, api_version) {
                Ok(object) => object,
                Err(conflicts) => {
                    let (message, details) = conflicts.status();
                    return status(
                        resource,
                        StatusCode::CONFLICT,
                        "Conflict",
                        &message,
                        &name,
                        details,
                    );
                }
            }
        }
        (_, None) => return not_found(resource, &name),
        (Form::Json, Some(current)) => {
            let patched = match fields::json_patch(current, &patch) {
                Ok(patched) => patched,
                Err(fields::JsonPatchError::Decode(message)) => {
                    return refused(resource, &name, Refusal::BadRequest(message));
                }
                Err(fields::JsonPatchError::Apply(message)) => {
                    return status(
                        resource,
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        &message,
                        &name,
                        json!({}),
                    );
                }
            };
            if patched["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"] {
                return conflict(resource, &name);
            }
            let mut object = without_managed_fields(patched);
            fields::record_update(Some(current), &mut object, &manager, api_version);
            object
        }
        (form, Some(current)) => {
            let mut object = current.clone();
            if form == Form::Merge {
                fields::merge_patch(&mut object, &patch);
            } else {
                fields::strategic_merge_patch(&mut object, &patch);
            }
            fields::record_update(Some(current), &mut object, &manager, api_version);
            object
        }
    };
    if let Err(refusal) = decode(resource, &mut object).and_then(|()| {
        admit(
            resource,
            &mut object,
            &name,
            current.as_ref(),
            api.gate_on(),
        )
    }) {
        return refused(resource, &name, refusal);
    }
    if let Some(current) = current.as_ref().filter(|_| resource == Resource::Pod)
        && let Some(message) = api.pod_admission_refuses(&name, current, &object, &headers)
    {
        return policy_refused(resource, &name, &message);
    }
    stored(&api, &mut objects, &key, object, current.is_some())
}
