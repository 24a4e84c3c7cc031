//! Mapping of client errors onto the core's error kinds. The client's errors carry no
//! credentials (a digest password is sent once, at connect, and never echoed).

use leader_core::LockError;
use zookeeper_client as zk;

pub(crate) const BACKEND: &str = "zookeeper";

/// Whether `err` ends the session for good: the client cannot make another request on it, and
/// the store opens a new session for the next one.
pub(crate) fn ends_session(err: &zk::Error) -> bool {
    matches!(
        err,
        zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::AuthFailed
    )
}

/// Maps a client error on `context` (a path or the ensemble, never credentials) onto a
/// [`LockError`] kind. A version mismatch, a node that exists or vanished are conflicts.
pub(crate) fn map(context: &str, err: zk::Error) -> LockError {
    match err {
        zk::Error::BadVersion | zk::Error::NodeExists | zk::Error::NoNode => {
            LockError::conflict(BACKEND)
        }
        zk::Error::NoAuth => LockError::Forbidden {
            backend: BACKEND,
            message: format!(
                "{context}: the znode's ACL denies this session; give the lock's digest user (zk://user:password@...) create, read, write and delete rights on the prefix (setAcl)"
            ),
        },
        zk::Error::AuthFailed => LockError::Forbidden {
            backend: BACKEND,
            message: format!("{context}: the ensemble refused the session (authentication failed)"),
        },
        zk::Error::InvalidAcl => LockError::Misconfigured {
            backend: BACKEND,
            message: format!("{context}: the ensemble refused the znode's ACL"),
        },
        zk::Error::QuotaExceeded => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: a quota of the prefix is exceeded (setquota): raise it or move the prefix"
            ),
        },
        zk::Error::SessionExpired
        | zk::Error::ClientClosed
        | zk::Error::ConnectionLoss
        | zk::Error::Timeout
        | zk::Error::NoHosts
        | zk::Error::Throttled
        | zk::Error::NotReadOnly
        | zk::Error::SessionMoved => LockError::unavailable(BACKEND, Context::new(context, &err)),
        other => LockError::other(BACKEND, Context::new(context, &other)),
    }
}

/// The refusal of a session by authentication, saying what the session sent: `digest` when it
/// authenticated with the digest scheme, nothing otherwise. The lock speaks no SASL (Kerberos,
/// DIGEST-MD5), which ensembles with `enforce.auth.enabled` or `sessionRequireClientSASLAuth`
/// may ask for.
pub(crate) fn auth_failed(context: &str, digest: bool) -> LockError {
    let message = if digest {
        format!(
            "{context}: the ensemble refused the session's digest credentials (authentication failed); an ensemble that requires SASL (Kerberos, DIGEST-MD5) refuses every session of this lock, which authenticates with the digest scheme only"
        )
    } else {
        format!(
            "{context}: the ensemble refused the session, which sent no credentials: it requires authentication (enforce.auth.enabled or SASL); give the lock digest credentials (zk://user:password@...) if the ensemble takes the digest scheme, since the lock speaks no SASL"
        )
    };
    LockError::Forbidden {
        backend: BACKEND,
        message,
    }
}

/// A client error with the lock's context, for `source` fields.
#[derive(Debug)]
pub(crate) struct Context {
    message: String,
}

impl Context {
    pub(crate) fn new(context: &str, err: &dyn std::fmt::Display) -> Self {
        Self {
            message: format!("{context}: {err}"),
        }
    }
}

impl std::fmt::Display for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Context {}
