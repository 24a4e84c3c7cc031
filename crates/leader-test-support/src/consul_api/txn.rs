//! Transactions (`agent/txn_endpoint.go`, `agent/consul/txn_endpoint.go`,
//! `agent/consul/state/txn.go`).

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};

use super::data::{Data, Write, entry_json};
use super::{ConsulApiServer, Params, text};

/// The most operations a transaction may hold (`maxTxnOps`).
const MAX_OPS: usize = 128;

/// One KV operation of a transaction (`api.TxnKVOp`).
struct Op {
    verb: String,
    key: String,
    value: Vec<u8>,
    flags: u64,
    index: u64,
    session: String,
}

impl Op {
    /// Whether it writes (`isWrite`): a transaction with none is served as a read.
    fn writes(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "set" | "delete" | "delete-cas" | "delete-tree" | "cas" | "lock" | "unlock"
        )
    }

    /// The ACL rule `kvsPreApply` checks before the transaction runs: none for reads (their
    /// results are filtered instead), `key:read` for the checks that could reveal a value, and
    /// `key:write` for every other verb, `check-not-exists` included.
    fn rule(&self) -> Option<&'static str> {
        match self.verb.as_str() {
            "get" | "get-tree" | "get-or-empty" => None,
            "check-index" | "check-session" => Some("key:read"),
            _ => Some("key:write"),
        }
    }
}

fn parse(body: &[u8]) -> Result<Vec<Option<Op>>, String> {
    let ops: Vec<Value> = serde_json::from_slice(body).map_err(|err| err.to_string())?;
    ops.iter()
        .map(|op| {
            let Some(kv) = op.get("KV") else {
                return Ok(None);
            };
            let value = match &kv["Value"] {
                Value::Null => Vec::new(),
                Value::String(encoded) => BASE64
                    .decode(encoded)
                    .map_err(|err| format!("failed to decode value: {err}"))?,
                other => return Err(format!("unexpected value type: {other}")),
            };
            Ok(Some(Op {
                verb: kv["Verb"].as_str().unwrap_or_default().to_owned(),
                key: kv["Key"].as_str().unwrap_or_default().to_owned(),
                value,
                flags: kv["Flags"].as_u64().unwrap_or(0),
                index: kv["Index"].as_u64().unwrap_or(0),
                session: kv["Session"].as_str().unwrap_or_default().to_owned(),
            }))
        })
        .collect()
}

/// `PUT /v1/txn`: KV operations, all or none.
///
/// `Txn.preCheck` first runs `kvsPreApply` on every operation: the token's rule for it (a
/// denial is the operation's error, "Permission denied", so the answer is a 409, not a 403)
/// and, for a `lock`, the key's lock-delay ("failed to lock key ... due to lock delay"). Then
/// `txnDispatch` runs the operations in order on one state store transaction; any error rolls
/// all of them back and the answer is 409 with `Errors` (`OpIndex`, `What`). Reads answer
/// their entries with values, writes and checks theirs without; `get-or-empty` answers the
/// operation itself for a missing key; `FilterTxnResults` drops entries the token may not
/// read.
pub(super) async fn txn(
    State(api): State<ConsulApiServer>,
    headers: HeaderMap,
    Query(params): Params,
    body: Bytes,
) -> Response {
    if let Some(refused) = api.admit("PUT /v1/txn", &params, &headers, "", "") {
        return refused;
    }
    let ops = match parse(&body) {
        Ok(ops) => ops,
        Err(err) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("Failed to parse body: {err}"),
            );
        }
    };
    if ops.len() > MAX_OPS {
        return text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "Transaction contains too many operations ({} > {MAX_OPS})",
                ops.len()
            ),
        );
    }
    let mut data = api.data();
    let fail = |op_index: usize, what: String| json!({"OpIndex": op_index, "What": what});
    let mut errors = Vec::new();
    for (op_index, op) in ops.iter().enumerate() {
        let Some(op) = op else {
            errors.push(fail(op_index, "only KV operations are served".to_owned()));
            continue;
        };
        if op.key.is_empty() && op.verb != "delete-tree" {
            errors.push(fail(op_index, "Must provide key".to_owned()));
        } else if op
            .rule()
            .is_some_and(|rule| api.denied(&headers, rule, &op.key).is_some())
        {
            errors.push(fail(op_index, "Permission denied".to_owned()));
        } else if op.verb == "lock" && data.lock_delayed(&op.key) {
            errors.push(fail(
                op_index,
                format!("failed to lock key {:?} due to lock delay", op.key),
            ));
        }
    }
    if !errors.is_empty() {
        return conflict(&errors);
    }
    let writes = ops.iter().flatten().any(Op::writes);
    let mut next = data.clone();
    let index = data.index + 1;
    let mut results = Vec::new();
    for (op_index, op) in ops.iter().flatten().enumerate() {
        match run(&mut next, index, op) {
            Ok(entries) => results.extend(entries),
            Err(what) => errors.push(fail(op_index, what)),
        }
    }
    if !errors.is_empty() {
        return conflict(&errors);
    }
    if writes {
        next.index = index;
        *data = next;
        api.written(&data);
    }
    results.retain(|result| {
        let key = result["KV"]["Key"].as_str().unwrap_or_default();
        api.denied(&headers, "key:read", key).is_none()
    });
    answer(StatusCode::OK, &json!({"Results": results, "Errors": null}))
}

/// Runs one operation (`txnKVS`): the results it answers, or its error.
fn run(data: &mut Data, index: u64, op: &Op) -> Result<Vec<Value>, String> {
    let key = op.key.as_str();
    let found = |data: &Data, with_value: bool| {
        data.kv
            .get(key)
            .map(|entry| json!({"KV": entry_json(key, entry, with_value)}))
    };
    let write = match op.verb.as_str() {
        "get" => {
            return found(data, true)
                .map(|r| vec![r])
                .ok_or_else(|| format!("key {key:?} doesn't exist"));
        }
        "get-or-empty" => {
            return Ok(vec![found(data, true).unwrap_or_else(|| {
                json!({"KV": {
                    "LockIndex": 0, "Key": key, "Flags": op.flags, "Value": null,
                    "Session": op.session, "CreateIndex": 0, "ModifyIndex": op.index,
                }})
            })]);
        }
        "get-tree" => {
            return Ok(data
                .kv
                .range(key.to_owned()..)
                .take_while(|(k, _)| k.starts_with(key))
                .map(|(k, entry)| json!({"KV": entry_json(k, entry, true)}))
                .collect());
        }
        "check-index" => {
            return match data.kv.get(key) {
                Some(e) if e.modify_index == op.index => {
                    Ok(found(data, false).into_iter().collect())
                }
                Some(e) => Err(format!(
                    "failed index check for key {key:?}, current modify index {} != {}",
                    e.modify_index, op.index
                )),
                None => Err(format!("failed to check index, key {key:?} doesn't exist")),
            };
        }
        "check-session" => {
            return match data.kv.get(key) {
                Some(e) if e.session.as_deref().unwrap_or_default() == op.session => {
                    Ok(found(data, false).into_iter().collect())
                }
                Some(e) => Err(format!(
                    "failed session check for key {key:?}, current session {:?} != {:?}",
                    e.session.clone().unwrap_or_default(),
                    op.session
                )),
                None => Err(format!(
                    "failed to check session, key {key:?} doesn't exist"
                )),
            };
        }
        "check-not-exists" => {
            return if data.kv.contains_key(key) {
                Err(format!("key {key:?} exists"))
            } else {
                Ok(Vec::new())
            };
        }
        "set" => Write::Set,
        "cas" => Write::Cas(op.index),
        "lock" => Write::Lock(&op.session),
        "unlock" => Write::Unlock(&op.session),
        "delete" => Write::Delete,
        "delete-cas" => Write::DeleteCas(op.index),
        other => return Err(format!("unknown KV verb {other:?}")),
    };
    match data.apply(index, key, &op.value, op.flags, &write) {
        Ok(true) => Ok(found(data, false).into_iter().collect()),
        Ok(false) => Err(match op.verb.as_str() {
            "lock" => format!("failed to lock key {key:?}, lock is already held"),
            "unlock" => format!(
                "failed to unlock key {key:?}, lock isn't held, or is held by another session"
            ),
            "delete-cas" => format!("failed to delete key {key:?}, index is stale"),
            _ => format!("failed to set key {key:?}, index is stale"),
        }),
        Err(err) => Err(err),
    }
}

fn conflict(errors: &[Value]) -> Response {
    answer(
        StatusCode::CONFLICT,
        &json!({"Results": null, "Errors": errors}),
    )
}

/// A transaction's answer: JSON, without the `X-Consul-Index` of blocking endpoints.
fn answer(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}
