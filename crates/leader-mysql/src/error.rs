//! Mapping of driver errors onto the core's error kinds, with credentials removed.

use std::fmt;

use leader_core::LockError;

pub(crate) const BACKEND: &str = "mysql";

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
    /// Too many connections, a Galera node that is not primary, server shutdown, lock wait
    /// timeout, deadlock, read-only (a replica or a cluster member that lost quorum), query
    /// interrupted, a statement to prepare again, a connection killed, a statement timeout
    /// (MariaDB, MySQL), an idle connection closed by MySQL 8, a deadlock between user-level
    /// locks (MySQL).
    pub(super) const TRANSIENT: &[u16] = &[
        1040, 1047, 1053, 1205, 1213, 1290, 1317, 1615, 1836, 1927, 1969, 3024, 3058, 4031,
    ];
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
                    "{message}; grant SELECT, INSERT, UPDATE ON the lock table to this user (deploy/mysql/grants.sql)"
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
        code if code::TRANSIENT.contains(&code) => LockError::unavailable(BACKEND, wrap(err)),
        _ => LockError::other(BACKEND, wrap(err)),
    }
}
