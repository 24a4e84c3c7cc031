//! Mapping of HTTP answers and client errors onto the core's error kinds.

use leader_core::LockError;
use reqwest::StatusCode;

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
        429 | 500.. => LockError::unavailable(BACKEND, format!("{context}: {body} ({code})")),
        _ => LockError::other(BACKEND, format!("{context}: {body} ({code})")),
    }
}
