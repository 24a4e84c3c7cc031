//! Mapping of Redis errors onto the core's error kinds, with credentials removed.

use leader_core::LockError;
use leader_core::backend::read_only;
use redis::{ErrorKind, RedisError, ServerErrorKind};

pub(crate) const BACKEND: &str = "redis";

/// Whether the server refused a write as read-only (`READONLY`): a replica, or a primary that
/// a failover demoted, reached through a name or address that still leads there. Redis 7
/// answers a script's refused write so; before 7, the script's error (`ERR Error running
/// script ...`) carries it in its message.
pub(crate) fn refused_as_read_only(err: &RedisError) -> bool {
    match err.code() {
        Some("READONLY") => true,
        Some("ERR") => err
            .detail()
            .is_some_and(|detail| detail.contains("-READONLY ")),
        _ => false,
    }
}

/// A cluster's refusal of a request whose keys lie in more than one hash slot (`CROSSSLOT`):
/// a cluster-mode server (Redis Cluster, MemoryDB, ElastiCache with cluster mode on, even with
/// one shard) runs a script only over keys of one slot. The source of the
/// [`LockError::Other`] [`map`] makes of it, so that a lock set tells it from other failures
/// ([`is_cross_slot`]) and sends a request per record instead.
#[derive(Debug, thiserror::Error)]
#[error("{0}; the server is in cluster mode and runs a request only over keys of one slot")]
pub(crate) struct CrossSlot(String);

/// Whether `err` is a cluster's refusal of keys in several slots ([`CrossSlot`]).
pub(crate) fn is_cross_slot(err: &LockError) -> bool {
    match err {
        LockError::Other { source, .. } => source.is::<CrossSlot>(),
        _ => false,
    }
}

/// What the lock's ACL user needs, as the README's `ACL SETUSER` line grants it.
const ACL_NEEDS: &str = "the ACL user needs the locks' key and channel patterns (`~leader:*` \
    and `&leader:*` for the default prefix; channels are refused by default since Redis 7), \
    the commands EVALSHA, EVAL, SUBSCRIBE, PING, INFO and SELECT (for a database other than \
    0), and those the lock's scripts run: \
    HGET, HMGET, HSET, GET, SET, DEL, EXISTS, INCR, PEXPIRE, PTTL, TYPE and PUBLISH";

/// Whether the server's ACL refused the request: a command, key or channel refused outright
/// (`NOPERM`), or one a script ran (`ERR`: Redis 7.0 says "The user executing the script
/// can't ...", later releases "ACL failure in script").
fn refused_by_acl(err: &RedisError) -> bool {
    match err.code() {
        Some("NOPERM") => true,
        Some("ERR") => err.detail().is_some_and(|detail| {
            detail.contains("The user executing the script can't")
                || detail.contains("ACL failure in script")
        }),
        _ => false,
    }
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
        _ if refused_by_acl(&err) => {
            return LockError::Forbidden {
                backend: BACKEND,
                message: format!("{}; {ACL_NEEDS}", detail()),
            };
        }
        Some("CROSSSLOT") => return LockError::other(BACKEND, CrossSlot(detail())),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The server's error reply `line`, as the driver reads it.
    fn reply(line: &str) -> RedisError {
        match redis::parse_redis_value(format!("-{line}\r\n").as_bytes()) {
            Ok(redis::Value::ServerError(err)) => err.into(),
            other => panic!("not an error reply: {other:?}"),
        }
    }

    /// Redis 7 refuses a script's write on a replica with `READONLY`; Redis 6 wraps it in the
    /// script's `ERR`. Both are read-only refusals; another script error is not.
    #[test]
    fn read_only_refusals_of_every_version_are_told_apart() {
        for line in [
            "READONLY You can't write against a read only replica. script: 9a1b, on @user_script:47.",
            "ERR Error running script (call to f_9a1b): @user_script:47: -READONLY You can't write against a read only replica.",
        ] {
            let err = reply(line);
            assert!(refused_as_read_only(&err), "{line}");
            assert!(
                leader_core::backend::is_read_only(&map("ctx", err)),
                "{line}"
            );
        }
        let other =
            reply("ERR Error running script (call to f_9a1b): @user_script:3: bad argument");
        assert!(!refused_as_read_only(&other));
    }

    /// A cluster's refusal of keys in several slots is told apart by its code, whatever the
    /// driver's text of it (`CrossSlot: ...`): a lock set then sends a request per record.
    #[test]
    fn a_refusal_of_keys_in_several_slots_is_told_apart() {
        let err = map(
            "ctx",
            reply("CROSSSLOT Keys in request don't hash to the same slot"),
        );
        assert!(is_cross_slot(&err), "{err:?}");
        assert!(err.to_string().contains("cluster mode"), "{err}");
        assert!(!is_cross_slot(&map("ctx", reply("ERR something else"))));
    }

    /// A refusal by the server's ACL is `Forbidden` saying what the user needs, whether it
    /// refused the request itself or a command a script ran.
    #[test]
    fn acl_refusals_are_forbidden_and_say_what_the_user_needs() {
        for line in [
            "NOPERM this user has no permissions to access one of the channels used as arguments",
            "ERR The user executing the script can't run this command or subcommand script: 2248, on @user_script:1.",
            "ERR The user executing the script can't publish to the channel mentioned in the command script: 38be, on @user_script:1.",
            "ERR ACL failure in script: this user has no permissions to run the 'hset' command script: 2248, on @user_script:1.",
        ] {
            let err = map("ctx", reply(line));
            assert!(
                matches!(err, LockError::Forbidden { .. }),
                "{line}: {err:?}"
            );
            assert!(err.to_string().contains("&leader:*"), "{err}");
        }
        let other = map("ctx", reply("ERR Error running script: bad argument"));
        assert!(matches!(other, LockError::Other { .. }), "{other:?}");
    }
}
