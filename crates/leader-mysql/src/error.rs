//! Mapping of driver errors onto the core's error kinds, with credentials removed.

use std::fmt;

use leader_core::LockError;
use leader_core::backend::read_only;

pub(crate) const BACKEND: &str = "mysql";

/// What to use where the `GET_LOCK` lock cannot work (a Galera cluster).
pub(crate) const USE_THE_TABLE_LOCK: &str =
    "use the table lock (leave out lock=named; MysqlStore::lock)";

/// A driver error with the server's message, for `source` fields. The driver never puts the
/// password in its errors; `context` is a redacted URL or a table name.
#[derive(Debug)]
pub(crate) struct DriverError {
    context: String,
    source: mysql_async::Error,
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            mysql_async::Error::Server(server) => write!(
                f,
                "{}: {} (error {}, SQLSTATE {})",
                self.context, server.message, server.code, server.state
            ),
            other => write!(f, "{}: {other}", self.context),
        }
    }
}

impl std::error::Error for DriverError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Server error codes (the same on MySQL and MariaDB for these), from the servers'
/// `mysqld_error.h`.
mod code {
    pub(super) const DBACCESS_DENIED: u16 = 1044;
    pub(super) const ACCESS_DENIED: u16 = 1045;
    /// MySQL's `ER_ACCESS_DENIED_NO_PASSWORD_ERROR`, what MariaDB also answers to a user who
    /// may log in only through the server's Unix socket.
    pub(super) const ACCESS_DENIED_NO_PASSWORD: u16 = 1698;
    pub(super) const BAD_DB: u16 = 1049;
    pub(super) const BAD_FIELD: u16 = 1054;
    pub(super) const DUP_ENTRY: u16 = 1062;
    pub(super) const TABLEACCESS_DENIED: u16 = 1142;
    pub(super) const COLUMNACCESS_DENIED: u16 = 1143;
    pub(super) const NO_SUCH_TABLE: u16 = 1146;
    pub(super) const SPECIFIC_ACCESS_DENIED: u16 = 1227;
    pub(super) const WRONG_VALUE_COUNT_ON_ROW: u16 = 1136;
    pub(super) const DATA_OUT_OF_RANGE: u16 = 1264;
    pub(super) const TRUNCATED_WRONG_VALUE: u16 = 1292;
    pub(super) const DATA_TOO_LONG: u16 = 1406;
    pub(super) const TRUNCATED_WRONG_VALUE_FOR_FIELD: u16 = 1366;
    /// `ER_NOT_SUPPORTED_YET`: "This version of MariaDB doesn't yet support '%s'".
    pub(super) const NOT_SUPPORTED_YET: u16 = 1235;
    /// Too many connections, a Galera node that is not primary, server shutdown, lock wait
    /// timeout, deadlock, query interrupted, a statement to prepare again, a connection
    /// killed, a statement timeout (MariaDB, MySQL), an idle connection closed by MySQL 8, a
    /// deadlock between user-level locks (MySQL).
    pub(super) const TRANSIENT: &[u16] = &[
        1040, 1047, 1053, 1205, 1213, 1317, 1615, 1927, 1969, 3024, 3058, 4031,
    ];
    /// A write refused as read-only: `ER_OPTION_PREVENTS_STATEMENT` (a server running with
    /// `read_only` or `super_read_only`: a replica, a writer that a failover demoted, a cluster
    /// member that lost quorum), `ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION` (a session or
    /// transaction set read-only) and `ER_READ_ONLY_MODE` (a server in read-only mode).
    pub(super) const READ_ONLY: &[u16] = &[1290, 1792, 1836];
}

/// Maps the error of a statement that calls `GET_LOCK` as [`map`] does, except that the server
/// refusing it means this server cannot run the `GET_LOCK` lock at all.
pub(crate) fn map_get_lock(context: &str, err: mysql_async::Error) -> LockError {
    match &err {
        // MariaDB with Galera replication on refuses GET_LOCK (MDEV-30473) with error 1235,
        // SQLSTATE 42000: "This version of MariaDB doesn't yet support 'GET_LOCK in cluster
        // (WSREP_ON=ON)'". Retrying cannot help.
        mysql_async::Error::Server(server) if server.code == code::NOT_SUPPORTED_YET => {
            LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "{context}: {} (error {}); the GET_LOCK lock does not work on Galera: {USE_THE_TABLE_LOCK}",
                    server.message, server.code
                ),
            }
        }
        _ => map(context, err),
    }
}

/// Maps a driver error onto a [`LockError`] kind by the server's error code.
pub(crate) fn map(context: &str, err: mysql_async::Error) -> LockError {
    let wrap = |err| DriverError {
        context: context.to_owned(),
        source: err,
    };
    let server = match &err {
        mysql_async::Error::Server(server) => server,
        // An I/O error, a closed connection, a TLS failure, a pool that timed out.
        mysql_async::Error::Io(_) | mysql_async::Error::Driver(_) => {
            return LockError::unavailable(BACKEND, wrap(err));
        }
        mysql_async::Error::Url(_) => {
            return LockError::Misconfigured {
                backend: BACKEND,
                message: wrap(err).to_string(),
            };
        }
        mysql_async::Error::Other(_) => return LockError::other(BACKEND, wrap(err)),
    };
    let message = format!("{context}: {} (error {})", server.message, server.code);
    match server.code {
        code::NO_SUCH_TABLE => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{message}; create it with MysqlStore::create_table (MysqlStoreBuilder::create_table(true)), or run leader_mysql::SCHEMA as the table's owner"
            ),
        },
        code::BAD_FIELD => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{message}; the table is not a lock table of this version: compare it with leader_mysql::SCHEMA"
            ),
        },
        code::TABLEACCESS_DENIED | code::COLUMNACCESS_DENIED | code::SPECIFIC_ACCESS_DENIED => {
            LockError::Forbidden {
                backend: BACKEND,
                message: format!(
                    "{message}; grant this user SELECT, INSERT, UPDATE on the lock table (GRANT SELECT, INSERT, UPDATE ON db.table TO 'user'@'host')"
                ),
            }
        }
        code::ACCESS_DENIED | code::ACCESS_DENIED_NO_PASSWORD | code::DBACCESS_DENIED => {
            LockError::Forbidden {
                backend: BACKEND,
                message: format!("{context}: authentication failed: {}", server.message),
            }
        }
        code::BAD_DB => LockError::Misconfigured {
            backend: BACKEND,
            message,
        },
        code::DUP_ENTRY => LockError::conflict(BACKEND),
        code::DATA_OUT_OF_RANGE
        | code::TRUNCATED_WRONG_VALUE
        | code::TRUNCATED_WRONG_VALUE_FOR_FIELD
        | code::DATA_TOO_LONG
        | code::WRONG_VALUE_COUNT_ON_ROW => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{message}; the table's columns do not take the lock's values: compare it with leader_mysql::SCHEMA"
            ),
        },
        code if code::READ_ONLY.contains(&code) => read_only(BACKEND, wrap(err), ""),
        code if code::TRANSIENT.contains(&code) => LockError::unavailable(BACKEND, wrap(err)),
        _ => LockError::other(BACKEND, wrap(err)),
    }
}

/// Checks that `err` is a [`LockError::Misconfigured`] whose message, on one line, blames
/// Galera, points to the table lock instead of `lock=named`, and says each of `words`.
#[cfg(test)]
pub(crate) fn assert_galera_refusal(err: &LockError, words: &[&str]) {
    let LockError::Misconfigured { message, .. } = err else {
        panic!("not Misconfigured: {err:?}");
    };
    let advice = ["Galera", "table lock", "lock=named"];
    assert!(
        words
            .iter()
            .chain(&advice)
            .all(|word| message.contains(word)),
        "{message}"
    );
    assert!(!message.contains('\n'), "one line: {message}");
}

#[cfg(test)]
mod tests {
    use mysql_async::ServerError;

    use leader_core::backend::is_read_only;

    use super::*;

    fn server(code: u16, state: &str, message: &str) -> mysql_async::Error {
        mysql_async::Error::Server(ServerError {
            code,
            message: message.to_owned(),
            state: state.to_owned(),
        })
    }

    /// No Galera cluster runs here: the error is the one MariaDB answers to `GET_LOCK` with
    /// `WSREP_ON=ON` since MDEV-30473, as its users report it.
    #[test]
    fn a_server_refusing_get_lock_is_misconfigured_for_the_get_lock_lock() {
        let refused = || {
            server(
                1235,
                "42000",
                "This version of MariaDB doesn't yet support 'GET_LOCK in cluster (WSREP_ON=ON)'",
            )
        };
        let err = map_get_lock("mysql://app:***@db/app election \"jobs\"", refused());
        assert_galera_refusal(
            &err,
            &[
                "GET_LOCK in cluster (WSREP_ON=ON)",
                "error 1235",
                "election \"jobs\"",
            ],
        );
        // Elsewhere 1235 stays what it was (a statement of another kind the server lacks).
        assert!(!matches!(
            map("ctx", refused()),
            LockError::Misconfigured { .. }
        ));
        // Other errors of a GET_LOCK statement map as every statement's do.
        assert!(matches!(
            map_get_lock("ctx", server(1146, "42S02", "Table 'app.t' doesn't exist")),
            LockError::Misconfigured { .. }
        ));
        assert!(matches!(
            map_get_lock("ctx", server(1205, "HY000", "Lock wait timeout exceeded")),
            LockError::Unavailable { .. }
        ));
    }

    /// A server running `read_only` answers a write with error 1290; a read-only session or
    /// transaction with 1792 (the second is also tried against MariaDB in `bad_input.rs`). Both
    /// are outages that close the connection; other outages keep theirs.
    #[test]
    fn writes_refused_as_read_only_close_the_connection() {
        let running_read_only = server(
            1290,
            "HY000",
            "The MariaDB server is running with the --read-only option so it cannot execute this statement",
        );
        let read_only_transaction = server(
            1792,
            "25006",
            "Cannot execute statement in a READ ONLY transaction",
        );
        for err in [running_read_only, read_only_transaction] {
            let err = map("mysql://app:***@db/app table leader_election", err);
            assert!(is_read_only(&err), "{err:?}");
            let message = err.to_string();
            assert!(message.contains("connection is given up"), "{message}");
            assert!(message.contains("table leader_election"), "{message}");
        }
        let busy = map("ctx", server(1205, "HY000", "Lock wait timeout exceeded"));
        assert!(matches!(busy, LockError::Unavailable { .. }) && !is_read_only(&busy));
    }
}
