//! Mapping of Redis errors onto the core's error kinds, with credentials removed.

use leader_core::LockError;
use leader_core::backend::read_only;
use redis::{ErrorKind, RedisError, ServerErrorKind};

pub(crate) const BACKEND: &str = "redis";

/// Whether the server refused a write as read-only (`READONLY`): a replica, or a primary that
/// a failover demoted, reached through a name or address that still leads there.
pub(crate) fn refused_as_read_only(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) || err.code() == Some("READONLY")
}

/// Maps a driver error by its kind and server error code. `context` names the server (redacted)
/// and the key.
pub(crate) fn map(context: &str, err: RedisError) -> LockError {
    let detail = || format!("{context}: {err}");
    match err.code() {
        Some("LEADER_CONFLICT") => return LockError::conflict(BACKEND),
        Some("LEADER_INVALID") => {
            return LockError::invalid_record(
                BACKEND,
                format!(
                    "{context}: {}",
                    err.detail().unwrap_or("invalid lock value")
                ),
            );
        }
        Some("WRONGTYPE") => {
            return LockError::invalid_record(
                BACKEND,
                format!("{context}: the key holds a value of another type, not a lock hash"),
            );
        }
        Some("NOPERM") => {
            return LockError::Forbidden {
                backend: BACKEND,
                message: format!(
                    "{}; the ACL user needs EVALSHA, EVAL, SUBSCRIBE and the key pattern of the locks",
                    detail()
                ),
            };
        }
        Some("WRONGPASS" | "NOAUTH") => {
            return LockError::Forbidden {
                backend: BACKEND,
                message: format!("{context}: authentication failed: {err}"),
            };
        }
        _ => {}
    }
    if refused_as_read_only(&err) {
        return read_only(BACKEND, detail(), "");
    }
    match err.kind() {
        ErrorKind::AuthenticationFailed => LockError::Forbidden {
            backend: BACKEND,
            message: format!("{context}: authentication failed: {err}"),
        },
        ErrorKind::InvalidClientConfig => LockError::Misconfigured {
            backend: BACKEND,
            message: detail(),
        },
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ClusterDown,
        )
        | ErrorKind::Io => LockError::unavailable(BACKEND, detail()),
        _ if err.is_io_error() || err.is_connection_dropped() || err.is_timeout() => {
            LockError::unavailable(BACKEND, detail())
        }
        _ => LockError::other(BACKEND, detail()),
    }
}
