//! LIST and WATCH of a namespace's objects.

use std::convert::Infallible;
use std::time::Duration;

use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::{Group, json_response, resource_of, status};
use crate::kube_api::KubeApiServer;
use crate::kube_api::selector::Selector;

#[derive(serde::Deserialize, Default)]
pub(super) struct ListQuery {
    watch: Option<String>,
    #[serde(rename = "fieldSelector")]
    field_selector: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
    #[serde(rename = "timeoutSeconds")]
    timeout_seconds: Option<u64>,
    #[serde(rename = "allowWatchBookmarks")]
    allow_watch_bookmarks: Option<bool>,
    #[serde(rename = "labelSelector")]
    label_selector: Option<String>,
}

/// LIST and WATCH as the watch cache serves them (`staging/src/k8s.io/apiserver/pkg/storage/
/// cacher`): `resourceVersion=0` (or none) starts with the current state as `ADDED` events; a
/// numeric version replays every change after it, or, once it is older than the history kept,
/// sends one `ERROR` event with a 410 `Expired` status ("too old resource version") and ends.
/// `timeoutSeconds` ends the stream on the server's side; with `allowWatchBookmarks=true` a
/// `BOOKMARK` carrying the current `resourceVersion` is sent every
/// [`KubeApiServer::bookmark_every`].
pub(super) async fn list_or_watch(
    State(api): State<KubeApiServer>,
    Extension(group): Extension<Group>,
    Path((version, ns, plural)): Path<(String, String, String)>,
    Query(query): Query<ListQuery>,
) -> Response {
    let resource = match resource_of(&api, group, &version, &plural) {
        Ok(resource) => resource,
        Err(response) => return *response,
    };
    let name = query
        .field_selector
        .as_deref()
        .and_then(|f| f.strip_prefix("metadata.name="))
        .map(str::to_owned);
    let watch = query
        .watch
        .as_deref()
        .is_some_and(|w| w == "true" || w == "1");
    let verb = if watch { "watch" } else { "list" };
    if let Some(denied) = api.denied(resource, verb, &ns, name.as_deref().unwrap_or("")) {
        return denied;
    }
    let selector = match Selector::parse(query.label_selector.as_deref().unwrap_or_default()) {
        Ok(selector) => selector,
        Err(message) => {
            return status(
                resource,
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &message,
                "",
                json!({}),
            );
        }
    };
    let matches = move |object: &Value| {
        object["kind"].as_str() == Some(resource.kind())
            && object["metadata"]["namespace"].as_str() == Some(ns.as_str())
            && name
                .as_deref()
                .is_none_or(|n| object["metadata"]["name"].as_str() == Some(n))
            && selector.matches(&object["metadata"]["labels"])
    };
    if !watch {
        api.shared.behaviour().lists += 1;
        let objects = api.shared.objects();
        let items: Vec<&Value> = objects.items.values().filter(|l| matches(l)).collect();
        return json_response(
            StatusCode::OK,
            &json!({"apiVersion": resource.api_version(), "kind": format!("{}List", resource.kind()),
                "metadata": {"resourceVersion": objects.revision.to_string()}, "items": items}),
        );
    }
    let (bookmark_every, deadline, expire) = {
        let mut behaviour = api.shared.behaviour();
        behaviour.watches += 1;
        let expire = behaviour.expire_watches > 0;
        if expire {
            behaviour.expire_watches -= 1;
        }
        let deadline = behaviour
            .watch_timeout
            .or(query.timeout_seconds.map(Duration::from_secs));
        (behaviour.bookmark_every, deadline, expire)
    };
    // Subscribed before the state is read, so that no change falls in between.
    let rx = api.shared.changes.subscribe();
    let initial = {
        let objects = api.shared.objects();
        match query.resource_version.as_deref().unwrap_or("0") {
            _ if expire => None,
            "0" | "" => Some((
                objects.revision,
                objects
                    .items
                    .values()
                    .filter(|l| matches(l))
                    .map(|l| ("ADDED", l.clone()))
                    .collect::<Vec<_>>(),
            )),
            from => match from.parse::<u64>() {
                Ok(from) if from >= objects.oldest_watchable() => Some((
                    objects.revision,
                    objects
                        .history
                        .iter()
                        .filter(|c| c.revision > from)
                        .filter_map(|c| c.seen_by(&matches))
                        .collect(),
                )),
                _ => None,
            },
        }
    };
    let line = |kind: &str, object: &Value| {
        Ok::<_, Infallible>(Bytes::from(format!(
            "{}\n",
            json!({"type": kind, "object": object})
        )))
    };
    let Some((seen, initial)) = initial else {
        let gone = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version", "reason": "Expired", "code": 410});
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(futures_util::stream::iter([line(
                "ERROR", &gone,
            )])))
            .expect("response");
    };
    let changes = futures_util::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(change) => return Some((change, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
    .filter_map(move |c| std::future::ready(c.seen_by(&matches).filter(|_| c.revision > seen)));
    let bookmarks = {
        let api = api.clone();
        let enabled = query.allow_watch_bookmarks.unwrap_or(false);
        futures_util::stream::unfold((), move |()| {
            let api = api.clone();
            async move {
                if !enabled {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(bookmark_every).await;
                let revision = api.shared.objects().revision;
                let bookmark = json!({"kind": resource.kind(), "apiVersion": resource.api_version(),
                    "metadata": {"resourceVersion": revision.to_string()}});
                Some((("BOOKMARK", bookmark), ()))
            }
        })
    };
    let events = futures_util::stream::iter(initial)
        .chain(futures_util::stream::select(changes, bookmarks))
        .map(move |(kind, object)| line(kind, &object))
        .take_until(async move {
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
