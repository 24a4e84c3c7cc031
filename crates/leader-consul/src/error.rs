//! Mapping of HTTP answers and client errors onto the core's error kinds.

use leader_core::LockError;
use reqwest::StatusCode;
use serde_json::Value;

pub(crate) const BACKEND: &str = "consul";

/// What an ACL token needs for the lock, for 403 messages.
pub(crate) fn acl_rules(prefix: &str) -> String {
    format!(
        "the ACL token needs `key_prefix \"{prefix}\" {{ policy = \"write\" }}` and `session_prefix \"\" {{ policy = \"write\" }}`"
    )
}

/// Maps a failed request; `context` names the agent and the key, never the token.
pub(crate) fn transport(context: &str, err: &reqwest::Error) -> LockError {
    // The error's text names the URL, which holds no credentials (the token is a header).
    let what = if err.is_timeout() {
        "timed out"
    } else if err.is_connect() {
        "could not connect to the agent"
    } else {
        "request failed"
    };
    let mut message = format!("{context}: {what}: {err}");
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    LockError::unavailable(BACKEND, message)
}

/// Maps an answer that is not a success; `body` is Consul's plain-text error.
pub(crate) fn status(context: &str, prefix: &str, code: StatusCode, body: &str) -> LockError {
    let body = body.trim();
    match code.as_u16() {
        403 => LockError::Forbidden {
            backend: BACKEND,
            message: format!("{context}: {body}; {}", acl_rules(prefix)),
        },
        401 => LockError::Forbidden {
            backend: BACKEND,
            message: format!("{context}: {body}"),
        },
        409 => LockError::conflict(BACKEND),
        400 | 404 | 413 => LockError::Misconfigured {
            backend: BACKEND,
            message: format!("{context}: {body} ({code})"),
        },
        // A datacenter the servers know no path to (`?dc=`), or a session whose node is not
        // registered in the datacenter (`sessionCreateTxn`: the agent's node, in a datacenter
        // other than the agent's own): settings, not an outage.
        500 if body.contains("No path to datacenter") => LockError::Misconfigured {
            backend: BACKEND,
            message: format!("{context}: {body}; is dc= a datacenter of this cluster?"),
        },
        500 if body.contains("Missing node registration") => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: {body}: the session's node is not registered in the datacenter; in a datacenter other than the agent's own, name one of its nodes with session_node="
            ),
        },
        429 | 500.. => LockError::unavailable(BACKEND, format!("{context}: {body} ({code})")),
        _ => LockError::other(BACKEND, format!("{context}: {body} ({code})")),
    }
}

/// Why Consul refused a transaction with 409 (`Errors`, each naming the operation that
/// failed and what happened).
pub(crate) enum Refusal {
    /// An operation was denied by the ACL token: Consul's `Txn.preCheck` answers a denial with
    /// 409 and "Permission denied", not with 403.
    Denied(LockError),
    /// The session named in a `lock` or `unlock` no longer exists.
    InvalidSession,
    /// Consul does not know an operation (a version before the verbs the lock uses).
    Unsupported(LockError),
    /// A check failed, a lock was held or under lock-delay: someone else wrote first.
    Conflict,
}

/// Reads a 409 answer to the transaction `ops`.
pub(crate) fn refusal(context: &str, prefix: &str, ops: &[Value], body: &str) -> Refusal {
    let answer: Value = serde_json::from_str(body).unwrap_or_default();
    let errors = answer["Errors"].as_array().cloned().unwrap_or_default();
    let what = |e: &Value| e["What"].as_str().unwrap_or_default().to_owned();
    if let Some(denied) = errors
        .iter()
        .find(|e| what(e).contains("Permission denied"))
    {
        let op = &ops
            .get(denied["OpIndex"].as_u64().unwrap_or(0) as usize)
            .cloned()
            .unwrap_or_default()["KV"];
        let verb = op["Verb"].as_str().unwrap_or("an operation");
        let key = op["Key"].as_str().unwrap_or_default();
        let rule = if verb.starts_with("get") || verb == "check-index" || verb == "check-session" {
            "key:read"
        } else {
            "key:write"
        };
        return Refusal::Denied(LockError::Forbidden {
            backend: BACKEND,
            message: format!(
                "{context}: {} (the transaction's {verb} of {key:?} needs {rule}); {}",
                what(denied),
                acl_rules(prefix)
            ),
        });
    }
    if let Some(unknown) = errors.iter().find(|e| what(e).contains("unknown KV verb")) {
        return Refusal::Unsupported(LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: {}; the lock needs Consul 1.14 or later (the transaction verb get-or-empty)",
                what(unknown)
            ),
        });
    }
    if errors.iter().any(|e| what(e).contains("invalid session")) {
        return Refusal::InvalidSession;
    }
    Refusal::Conflict
}
