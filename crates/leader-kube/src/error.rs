//! Mapping of API errors onto the core's error kinds.

use kube::core::Status;
use leader_core::LockError;

pub(crate) const BACKEND: &str = "kubernetes";

/// Maps a client error for `verb` on the Lease named in `context`.
pub(crate) fn map(context: &str, verb: &str, err: kube::Error) -> LockError {
    map_on("leases", context, verb, err)
}

/// Maps a client error for `verb` on the object of `resource` (`leases`, `leasecandidates`)
/// named in `context`.
pub(crate) fn map_on(resource: &str, context: &str, verb: &str, err: kube::Error) -> LockError {
    match err {
        kube::Error::Api(status) => map_status(resource, context, verb, &status),
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::HttpError(_) => {
            LockError::unavailable(BACKEND, format!("{context}: {err}"))
        }
        kube::Error::SerdeError(_) => {
            LockError::invalid_record(BACKEND, format!("{context}: {err}"))
        }
        other => LockError::other(BACKEND, format!("{context}: {other}")),
    }
}

fn map_status(resource: &str, context: &str, verb: &str, status: &Status) -> LockError {
    if status.is_conflict()
        || status.is_already_exists()
        || (status.is_not_found() && verb == "update")
    {
        return LockError::conflict(BACKEND);
    }
    if status.is_forbidden() {
        return LockError::Forbidden {
            backend: BACKEND,
            message: format!(
                "{context}: {}; grant the service account a Role with the verb {verb:?} on {resource} in API group coordination.k8s.io (leader-kube's README lists every verb the lock needs)",
                status.message,
            ),
        };
    }
    match status.code {
        401 => LockError::Forbidden {
            backend: BACKEND,
            message: format!("{context}: authentication failed: {}", status.message),
        },
        404 if resource == "leasecandidates" => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: {} (coordinated leader election needs coordination.k8s.io/v1beta1 LeaseCandidates, a beta API that kube-apiserver serves only with --runtime-config=coordination.k8s.io/v1beta1=true, and its coordinator, which runs only with --feature-gates=CoordinatedLeaderElection=true; does the namespace exist?)",
                status.message
            ),
        },
        404 => LockError::Misconfigured {
            backend: BACKEND,
            message: format!("{context}: {} (does the namespace exist?)", status.message),
        },
        422 => LockError::invalid_record(BACKEND, format!("{context}: {}", status.message)),
        429 | 500.. => LockError::unavailable(BACKEND, format!("{context}: {}", status.message)),
        _ => LockError::other(
            BACKEND,
            format!("{context}: {} ({})", status.message, status.reason),
        ),
    }
}
