//! The KV endpoint (`agent/kvs_endpoint.go`, `agent/consul/kvs_endpoint.go`,
//! `agent/blockingquery/blockingquery.go`).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};

use super::data::{Write, entry_json};
use super::{ConsulApiServer, Params, json_response, text};

/// The extensions `validateKVKey` refuses at the end of a key ("may be cached by proxies").
const SUSPICIOUS_EXTENSIONS: &[&str] = &[
    ".js", ".css", ".html", ".htm", ".xml", ".json", ".txt", ".log", ".php", ".asp", ".jsp",
    ".cgi", ".pl", ".py", ".rb", ".sh", ".exe", ".dll", ".bat", ".cmd", ".com", ".scr", ".vbs",
    ".pdf", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".zip", ".rar", ".tar", ".gz",
    ".7z", ".bz2", ".jpg", ".jpeg", ".png", ".gif", ".svg", ".ico", ".bmp", ".mp3", ".mp4", ".avi",
    ".mov", ".wmv", ".flv", ".swf", ".woff", ".woff2", ".ttf", ".eot", ".otf",
];

/// Why the KV endpoint refuses `key` (400), if it does: `KVSEndpoint`'s check of the path
/// for traversal, then `validateKVKey` (`agent/kvs_endpoint.go`): letters, digits and `,-_./`
/// only, no leading `/`, no `../`, none of [`SUSPICIOUS_EXTENSIONS`] at the end. Transactions
/// (`/v1/txn`) check none of this.
pub(super) fn refuse_key(key: &str) -> Option<String> {
    if key.contains("../") || key.contains("..\\") {
        return Some("URL path contains invalid traversal sequence".to_owned());
    }
    if key.is_empty() {
        return None;
    }
    if key.starts_with('/') {
        return Some("key must not begin with a '/'".to_owned());
    }
    if let Some((i, c)) = key
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, ',' | '-' | '_' | '.' | '/')))
    {
        return Some(format!(
            "key contains invalid character '{c}' at position {i}. Only alphanumeric characters and ,-_./ are allowed"
        ));
    }
    let lower = key.to_ascii_lowercase();
    SUSPICIOUS_EXTENSIONS
        .iter()
        .find(|ext| lower.ends_with(*ext))
        .map(|ext| {
            format!("key contains suspicious file extension '{ext}' that may be cached by proxies")
        })
}

/// Counts a request and answers it at once for a key the endpoint refuses (400), another
/// datacenter (500) or a token that lacks `rule` on the key (403).
fn admit(
    api: &ConsulApiServer,
    endpoint: &str,
    params: &std::collections::HashMap<String, String>,
    headers: &HeaderMap,
    rule: &str,
    key: &str,
) -> Option<Response> {
    if let Some(refused) = refuse_key(key) {
        api.count(endpoint);
        return Some(text(StatusCode::BAD_REQUEST, refused));
    }
    api.admit(endpoint, params, headers, rule, key)
}

/// `GET /v1/kv/KEY`, blocking with `?index=&wait=` (default 5 min, at most 10 min, plus up to
/// `wait/16` of jitter: `RPCQueryTimeout`).
///
/// As `blockingquery.Query` runs `KVS.Get`: the query returns once the index it reports passes
/// the one asked for; for a missing key that is the KV table's index (deletions included),
/// but once the key has been seen missing, a later check that finds it still missing moves
/// the index waited on (`errNotFound`), so writes to other keys do not end the wait: only the
/// key's creation, the end of the wait or a restored snapshot (the state store abandoned) do.
pub(super) async fn get(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = admit(&api, "GET /v1/kv", &params, &headers, "key:read", &key) {
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
        let restores = written.borrow_and_update().restores;
        let _ = tokio::time::timeout(wait, async {
            let mut min = wanted;
            let mut not_found = false;
            loop {
                {
                    let data = api.data();
                    let index = data.read_index(&key);
                    if !data.kv.contains_key(&key) {
                        if not_found {
                            min = index;
                        }
                        not_found = true;
                    }
                    if index > min {
                        return;
                    }
                }
                if written.changed().await.is_err() || written.borrow().restores != restores {
                    return;
                }
            }
        })
        .await;
    }
    let data = api.data();
    let index = data.read_index(&key);
    match data.kv.get(&key) {
        Some(entry) => json_response(
            StatusCode::OK,
            index,
            &json!([entry_json(&key, entry, true)]),
        ),
        None => json_response(StatusCode::NOT_FOUND, index, &Value::Null),
    }
}

/// `PUT /v1/kv/KEY` with `?flags=` and one of `?cas=`, `?acquire=`, `?release=`: `true` or
/// `false` (`KVSPut`, `KVS.Apply`); an acquire during the key's lock-delay is `false`
/// (`kvsPreApply`).
pub(super) async fn put(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(params): Params,
    body: Bytes,
) -> Response {
    if let Some(refused) = admit(&api, "PUT /v1/kv", &params, &headers, "key:write", &key) {
        return refused;
    }
    if ["cas", "acquire", "release"]
        .iter()
        .filter(|f| params.contains_key(**f))
        .count()
        > 1
    {
        return text(StatusCode::BAD_REQUEST, "Conflicting flags");
    }
    let flags = match params.get("flags").map(|f| f.parse::<u64>()) {
        Some(Ok(flags)) => flags,
        Some(Err(err)) => return text(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
        None => 0,
    };
    let write = if let Some(id) = params.get("acquire") {
        Write::Lock(id)
    } else if let Some(id) = params.get("release") {
        Write::Unlock(id)
    } else {
        match params.get("cas").map(|c| c.parse::<u64>()) {
            Some(Ok(index)) => Write::Cas(index),
            Some(Err(err)) => return text(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
            None => Write::Set,
        }
    };
    write_key(&api, &key, &body, flags, &write)
}

/// `DELETE /v1/kv/KEY`, with `?cas=`.
pub(super) async fn delete(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = admit(&api, "DELETE /v1/kv", &params, &headers, "key:write", &key) {
        return refused;
    }
    let write = match params.get("cas").map(|c| c.parse::<u64>()) {
        Some(Ok(index)) => Write::DeleteCas(index),
        Some(Err(err)) => return text(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
        None => Write::Delete,
    };
    write_key(&api, &key, &[], 0, &write)
}

/// One KV write of a `PUT` or `DELETE`: `true` once stored, `false` when its condition failed
/// or a lock met the key's lock-delay; an unknown session is the 500 Consul answers.
fn write_key(
    api: &ConsulApiServer,
    key: &str,
    value: &[u8],
    flags: u64,
    write: &Write<'_>,
) -> Response {
    let mut data = api.data();
    if matches!(write, Write::Lock(_)) && data.lock_delayed(key) {
        return json_response(StatusCode::OK, data.index, &json!(false));
    }
    let index = data.index + 1;
    // `apply` changes nothing unless it succeeds.
    match data.apply(index, key, value, flags, write) {
        Ok(true) => {
            data.index = index;
            api.written(&data);
            json_response(StatusCode::OK, index, &json!(true))
        }
        Ok(false) => json_response(StatusCode::OK, data.index, &json!(false)),
        Err(err) => text(StatusCode::INTERNAL_SERVER_ERROR, err),
    }
}

#[cfg(test)]
mod tests {
    use super::refuse_key;

    #[test]
    fn keys_as_validate_kv_key_checks_them() {
        for good in ["leader/job", "a,b", "x-1_2.3/y", "leader/job/.renewal"] {
            assert_eq!(refuse_key(good), None, "{good}");
        }
        for bad in [
            "/leader",
            "a~b",
            "a b",
            "jobs/../x",
            "job.json",
            "JOB.JSON",
            "example.com",
        ] {
            assert!(refuse_key(bad).is_some(), "{bad}");
        }
    }
}
