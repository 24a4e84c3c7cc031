//! Mapping of etcd client errors onto the core's error kinds.

use etcd_client::Error;
use leader_core::LockError;
use tonic::Code;

pub(crate) const BACKEND: &str = "etcd";

/// Maps a client error by its gRPC status; `context` names the endpoints and the key.
pub(crate) fn map(context: &str, err: Error) -> LockError {
    match &err {
        Error::GRpcStatus(status) => {
            let message = format!("{context}: {}", status.message());
            // etcd 3.4 sends failed authentication as InvalidArgument; its messages are stable.
            let text = status.message();
            if text.contains("authentication failed") || text.contains("invalid auth token") {
                return LockError::Forbidden {
                    backend: BACKEND,
                    message: format!("{context}: authentication failed: {text}"),
                };
            }
            // tonic reports a broken connection as a status of code Unknown.
            let transport = [
                "transport error",
                "connection",
                "broken pipe",
                "h2 protocol error",
            ]
            .iter()
            .any(|t| text.to_ascii_lowercase().contains(t));
            if status.code() == Code::Unknown && transport {
                return LockError::unavailable(BACKEND, message);
            }
            // A read at a revision compaction removed since (the pages of one range read):
            // the next read starts again at the latest.
            if text.contains("required revision has been compacted") {
                return LockError::unavailable(BACKEND, message);
            }
            match status.code() {
                Code::Unauthenticated => LockError::Forbidden {
                    backend: BACKEND,
                    message: format!("{context}: authentication failed: {}", status.message()),
                },
                Code::PermissionDenied => LockError::Forbidden {
                    backend: BACKEND,
                    message: format!("{message}; the user needs read and write on the lock's keys"),
                },
                Code::Unavailable
                | Code::DeadlineExceeded
                | Code::ResourceExhausted
                | Code::Aborted
                | Code::Cancelled => LockError::unavailable(BACKEND, message),
                Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                    LockError::Misconfigured {
                        backend: BACKEND,
                        message,
                    }
                }
                _ => LockError::other(BACKEND, message),
            }
        }
        Error::TransportError(_)
        | Error::IoError(_)
        | Error::LeaseKeepAliveError(_)
        | Error::WatchError(_) => LockError::unavailable(BACKEND, format!("{context}: {err}")),
        Error::InvalidArgs(_) | Error::InvalidUri(_) | Error::EndpointError(_) => {
            LockError::Misconfigured {
                backend: BACKEND,
                message: format!("{context}: {err}"),
            }
        }
        _ => LockError::other(BACKEND, format!("{context}: {err}")),
    }
}
