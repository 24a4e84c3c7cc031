//! A default identity for a candidate: one per process, as S13 asks.

/// An identity for this process: the pod name where Kubernetes gives it (`POD_NAME`, as the
/// Deployment in `deploy/kubernetes` sets from the downward API), else this host's name and
/// this process's id (`web-3-4711`).
///
/// Two processes must never share an identity (S13): a fixed string in a configuration shared by
/// every replica, or a host name alone where two replicas share a host, gives every replica the
/// same one. A process that restarts under the same identity (a container restarted in its pod)
/// waits for its predecessor's lease to run out unless that one released it.
///
/// ```
/// let identity = leader_core::default_identity();
/// assert!(!identity.is_empty());
/// ```
pub fn default_identity() -> String {
    if let Some(pod) = std::env::var("POD_NAME").ok().filter(|p| !p.is_empty()) {
        return pod;
    }
    format!("{}-{}", host_name(), std::process::id())
}

#[cfg(unix)]
fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned())
}

#[cfg(not(unix))]
fn host_name() -> String {
    std::env::var("COMPUTERNAME").unwrap_or_else(|_| "host".to_owned())
}
