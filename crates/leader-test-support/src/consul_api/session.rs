//! Sessions (`agent/session_endpoint.go`, `agent/consul/session_endpoint.go`,
//! `agent/consul/state/session.go`) and the catalog's deregistration of a node
//! (`agent/catalog_endpoint.go`, `agent/consul/state/catalog.go`).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};

use super::data::Session;
use super::{
    ConsulApiServer, DEFAULT_LOCK_DELAY, Params, SERF_HEALTH, SESSION_TTL_MAX, json_response, text,
};

/// `PUT /v1/session/create`.
///
/// `SessionCreate` starts from the agent's node, `serfHealth` in both `Checks` and
/// `NodeChecks`, a 15 s lock-delay and behaviour `release`, decodes the body over that (a
/// `LockDelay` number below 1000 is seconds, `structs.Session`'s decoding), then
/// `fixupEmptySessionChecks`: an empty `Checks` clears `NodeChecks` too, `Checks` left at its
/// default defers to `NodeChecks`, an empty `NodeChecks` clears the default `Checks`.
/// `Session.Apply` checks the token's `session:write` on the node (403), the behaviour and
/// the TTL (500 "Invalid Session TTL" outside `[session_ttl_min, 24h]`); `sessionCreateTxn`
/// wants the node registered and its checks there and not critical (500).
pub(super) async fn create(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Query(params): Params,
    body: Bytes,
) -> Response {
    if let Some(refused) = api.admit("PUT /v1/session/create", &params, &headers, "", "") {
        return refused;
    }
    let spec: Value = if body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(spec) => spec,
            Err(err) => return decode_failed(&err.to_string()),
        }
    };
    let node = match string_field(&spec, "Node") {
        Ok(node) => node.unwrap_or_else(|| api.node().to_owned()),
        Err(err) => return decode_failed(&err),
    };
    let name = match string_field(&spec, "Name") {
        Ok(name) => name.unwrap_or_default(),
        Err(err) => return decode_failed(&err),
    };
    let lock_delay = match spec.get("LockDelay").map(lock_delay).transpose() {
        Ok(delay) => delay.unwrap_or(DEFAULT_LOCK_DELAY),
        Err(err) => return decode_failed(&err),
    };
    let (checks, node_checks) = match (check_list(&spec, "Checks"), check_list(&spec, "NodeChecks"))
    {
        (Ok(checks), Ok(node_checks)) => fixup_empty_session_checks(checks, node_checks),
        (Err(err), _) | (_, Err(err)) => return decode_failed(&err),
    };
    let behavior = match string_field(&spec, "Behavior") {
        Ok(behavior) => behavior.unwrap_or_default(),
        Err(err) => return decode_failed(&err),
    };
    let ttl = match string_field(&spec, "TTL") {
        Ok(ttl) => ttl.unwrap_or_default(),
        Err(err) => return decode_failed(&err),
    };
    if let Some(message) = api.denied(&headers, "session:write", &node) {
        return text(StatusCode::FORBIDDEN, message);
    }
    let delete = match behavior.as_str() {
        "" | "release" => false,
        "delete" => true,
        other => return failed(&format!("Invalid Behavior setting '{other}'")),
    };
    let ttl = match ttl.as_str() {
        "" | "0" => None,
        given => match humantime::parse_duration(given) {
            Ok(ttl) if ttl.is_zero() => None,
            Ok(ttl) => {
                let min = api.session_ttl_min();
                if ttl < min || ttl > SESSION_TTL_MAX {
                    return failed(&format!(
                        "Invalid Session TTL '{}', must be between [{}={}]",
                        ttl.as_nanos(),
                        go_duration(min),
                        go_duration(SESSION_TTL_MAX)
                    ));
                }
                Some(ttl)
            }
            Err(err) => return failed(&format!("Session TTL '{given}' invalid: {err}")),
        },
    };
    let mut all_checks = checks;
    all_checks.extend(node_checks);
    all_checks.dedup();
    let mut data = api.data();
    if let Some(refused) = data.refuse_session(&node, &all_checks) {
        return failed(&refused);
    }
    let index = data.next_index();
    let id = uuid();
    let mut session = Session {
        name,
        node,
        checks: all_checks,
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

/// `fixupEmptySessionChecks` (`agent/session_endpoint.go`), on `Checks` and `NodeChecks` as
/// decoded over their defaults (`None`: not in the body).
fn fixup_empty_session_checks(
    checks: Option<Vec<String>>,
    node_checks: Option<Vec<String>>,
) -> (Vec<String>, Vec<String>) {
    let serf = || vec![SERF_HEALTH.to_owned()];
    let checks = checks.unwrap_or_else(serf);
    let node_checks = node_checks.unwrap_or_else(serf);
    if checks.is_empty() {
        return (Vec::new(), Vec::new());
    }
    if checks == serf() {
        return (Vec::new(), node_checks);
    }
    if node_checks.is_empty() {
        return (Vec::new(), node_checks);
    }
    (checks, node_checks)
}

/// `PUT /v1/session/renew/ID`: the session, or 404 once it is gone (`SessionRenew`).
pub(super) async fn renew(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit("PUT /v1/session/renew", &params, &headers, "", "") {
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
    if let Some(message) = api.denied(&headers, "session:write", &session.node) {
        return text(StatusCode::FORBIDDEN, message);
    }
    session.reset_timer();
    let body = json!([session.to_json(&id)]);
    json_response(StatusCode::OK, index, &body)
}

/// `PUT /v1/session/destroy/ID`: invalidates it; `true` whether or not it existed.
pub(super) async fn destroy(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit("PUT /v1/session/destroy", &params, &headers, "", "") {
        return refused;
    }
    let mut data = api.data();
    if let Some(session) = data.sessions.get(&id) {
        if let Some(message) = api.denied(&headers, "session:write", &session.node) {
            return text(StatusCode::FORBIDDEN, message);
        }
        let index = data.next_index();
        data.invalidate(index, &id);
        api.written(&data);
    }
    json_response(StatusCode::OK, data.index, &json!(true))
}

/// `GET /v1/session/info/ID`: the session in a list, or an empty list. A session on a node
/// the token may not read (`session:read`) is left out of the list, with no error, as
/// `Session.Get` filters its reply (`filterACLWithAuthorizer`), and the answer says so in
/// `X-Consul-Results-Filtered-By-ACLs`.
pub(super) async fn info(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit("GET /v1/session/info", &params, &headers, "", "") {
        return refused;
    }
    let data = api.data();
    let session = data.sessions.get(&id);
    let filtered = session.is_some_and(|s| api.denied(&headers, "session:read", &s.node).is_some());
    let body = match session {
        Some(s) if !filtered => json!([s.to_json(&id)]),
        _ => json!([]),
    };
    let mut response = json_response(StatusCode::OK, data.index, &body);
    if filtered {
        response.headers_mut().insert(
            "x-consul-results-filtered-by-acls",
            axum::http::HeaderValue::from_static("true"),
        );
    }
    response
}

/// `GET /v1/session/list`: every session (`SessionList`).
pub(super) async fn list(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit("GET /v1/session/list", &params, &headers, "", "") {
        return refused;
    }
    let data = api.data();
    let body = listed(data.sessions.iter());
    json_response(StatusCode::OK, data.index, &body)
}

/// `GET /v1/session/node/NODE`: the sessions of one node (`SessionsForNode` in
/// `agent/session_endpoint.go`, `Session.NodeSessions`), an empty list when it has none.
pub(super) async fn node(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Path(node): Path<String>,
    Query(params): Params,
) -> Response {
    if let Some(refused) = api.admit("GET /v1/session/node", &params, &headers, "", "") {
        return refused;
    }
    let data = api.data();
    let body = listed(data.sessions.iter().filter(|(_, s)| s.node == node));
    json_response(StatusCode::OK, data.index, &body)
}

/// Sessions as a list answers them: in the order they were created.
fn listed<'a>(sessions: impl Iterator<Item = (&'a String, &'a Session)>) -> Value {
    let mut sessions: Vec<(&String, &Session)> = sessions.collect();
    sessions.sort_by_key(|(_, s)| s.create_index);
    let body: Vec<Value> = sessions.iter().map(|(id, s)| s.to_json(id)).collect();
    json!(body)
}

/// `PUT /v1/catalog/deregister` with `{"Node": NODE}` and no service or check: the node goes
/// with its sessions (`Catalog.Deregister` → `deleteNodeTxn`); needs `node:write`.
pub(super) async fn deregister(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Query(params): Params,
    body: Bytes,
) -> Response {
    if let Some(refused) = api.admit("PUT /v1/catalog/deregister", &params, &headers, "", "") {
        return refused;
    }
    let spec: Value = match serde_json::from_slice(&body) {
        Ok(spec) => spec,
        Err(err) => return decode_failed(&err.to_string()),
    };
    let Some(node) = spec.get("Node").and_then(Value::as_str) else {
        return text(StatusCode::BAD_REQUEST, "Must provide node");
    };
    if let Some(message) = api.denied(&headers, "node:write", node) {
        return text(StatusCode::FORBIDDEN, message);
    }
    api.deregister_node(node);
    json_response(StatusCode::OK, api.data().index, &json!(true))
}

fn decode_failed(err: &str) -> Response {
    text(
        StatusCode::BAD_REQUEST,
        format!("Request decode failed: {err}"),
    )
}

/// An error of the servers' RPC endpoint, which the HTTP layer answers with 500.
fn failed(err: &str) -> Response {
    text(StatusCode::INTERNAL_SERVER_ERROR, err.to_owned())
}

fn string_field(spec: &Value, field: &str) -> Result<Option<String>, String> {
    match spec.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!("{field}: expected a string, got {other}")),
    }
}

fn check_list(spec: &Value, field: &str) -> Result<Option<Vec<String>>, String> {
    match spec.get(field) {
        None => Ok(None),
        Some(Value::Null) => Ok(Some(Vec::new())),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                item.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("{field}: expected strings, got {item}"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(other) => Err(format!("{field}: expected a list, got {other}")),
    }
}

/// A `LockDelay` as `structs.Session` decodes it: a Go duration string or a number of
/// nanoseconds, either taken as seconds when below 1000 (`lockDelayMinThreshold`).
fn lock_delay(value: &Value) -> Result<Duration, String> {
    let delay = match value {
        Value::Number(n) => n
            .as_f64()
            .filter(|n| *n >= 0.0)
            .map(|n| Duration::from_nanos(n as u64))
            .ok_or_else(|| format!("invalid duration {n}"))?,
        Value::String(s) if s == "0" || s.is_empty() => Duration::ZERO,
        Value::String(s) => {
            humantime::parse_duration(s).map_err(|err| format!("invalid duration {s:?}: {err}"))?
        }
        other => return Err(format!("invalid duration {other}")),
    };
    Ok(if delay < Duration::from_nanos(1000) {
        Duration::from_secs(delay.as_nanos() as u64)
    } else {
        delay
    })
}

/// A duration as Go prints it (`time.Duration.String`) for whole seconds and above: `10s`,
/// `1m30s`, `24h0m0s`; below a second, in milliseconds.
fn go_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if secs == 0 {
        return format!("{}ms", d.as_millis());
    }
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_checks_clear_node_checks_as_consul_fixes_them_up() {
        let list = |items: &[&str]| Some(items.iter().map(|s| (*s).to_owned()).collect());
        // What the lock used to send for `node_checks(["serfHealth"])`: no checks at all.
        assert_eq!(
            fixup_empty_session_checks(list(&[]), list(&["serfHealth"])),
            (vec![], vec![])
        );
        // Nothing sent: serfHealth.
        assert_eq!(
            fixup_empty_session_checks(None, None),
            (vec![], vec!["serfHealth".to_owned()])
        );
        // NodeChecks alone are kept.
        assert_eq!(
            fixup_empty_session_checks(None, list(&["serfHealth", "disk"])),
            (vec![], vec!["serfHealth".to_owned(), "disk".to_owned()])
        );
        assert_eq!(
            fixup_empty_session_checks(None, list(&[])),
            (vec![], vec![])
        );
    }

    #[test]
    fn go_durations_read_as_consul_prints_them() {
        assert_eq!(go_duration(Duration::from_secs(10)), "10s");
        assert_eq!(go_duration(Duration::from_secs(24 * 3600)), "24h0m0s");
        assert_eq!(go_duration(Duration::from_secs(90)), "1m30s");
    }

    #[test]
    fn small_lock_delays_are_seconds() {
        assert_eq!(lock_delay(&json!(5)), Ok(Duration::from_secs(5)));
        assert_eq!(lock_delay(&json!("15000ms")), Ok(Duration::from_secs(15)));
        assert_eq!(
            lock_delay(&json!(2_000_000_000u64)),
            Ok(Duration::from_secs(2))
        );
    }
}
