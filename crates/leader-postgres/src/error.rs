//! Mapping of driver and pool errors onto the core's error kinds, with credentials removed.

use std::fmt;

use deadpool_postgres::PoolError;
use leader_core::LockError;
use leader_core::backend::read_only;
use tokio_postgres::error::SqlState;

pub(crate) const BACKEND: &str = "postgres";

/// A driver error with the server's message, for `source` fields. tokio-postgres never puts the
/// password in its errors; `context` is a redacted connection string or a table name.
#[derive(Debug)]
pub(crate) struct DriverError {
    context: String,
    source: tokio_postgres::Error,
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source.as_db_error() {
            Some(db) => write!(
                f,
                "{}: {} (SQLSTATE {})",
                self.context,
                db.message(),
                db.code().code()
            ),
            None => {
                write!(f, "{}: {}", self.context, self.source)?;
                // tokio-postgres keeps the reason ("Connection refused") in its source.
                match std::error::Error::source(&self.source) {
                    Some(cause) => write!(f, ": {cause}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl std::error::Error for DriverError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Maps a driver error onto a [`LockError`] kind by its SQLSTATE.
pub(crate) fn map(context: &str, err: tokio_postgres::Error) -> LockError {
    let message = |err: &tokio_postgres::Error| {
        err.as_db_error()
            .map(|db| db.message().to_owned())
            .unwrap_or_else(|| err.to_string())
    };
    let Some(code) = err.code().cloned() else {
        // No SQLSTATE: an I/O error, a closed connection, a TLS failure.
        return LockError::unavailable(
            BACKEND,
            DriverError {
                context: context.to_owned(),
                source: err,
            },
        );
    };
    match code {
        SqlState::UNDEFINED_TABLE | SqlState::INVALID_SCHEMA_NAME => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: {}; create it with PostgresStore::create_table (PostgresStoreBuilder::create_table(true)), or run leader_postgres::SCHEMA as the table's owner",
                message(&err)
            ),
        },
        SqlState::INSUFFICIENT_PRIVILEGE => LockError::Forbidden {
            backend: BACKEND,
            message: format!(
                "{context}: {}; as the table's owner, GRANT SELECT, INSERT, UPDATE ON the table (and USAGE ON its schema) TO this role",
                message(&err)
            ),
        },
        SqlState::UNDEFINED_COLUMN => LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: {}; a table made by an earlier version lacks a column: as the table's owner, run leader_postgres::MIGRATION (ALTER TABLE ... ADD COLUMN IF NOT EXISTS extensions text), or PostgresStore::create_table, which runs it",
                message(&err)
            ),
        },
        SqlState::INVALID_PASSWORD | SqlState::INVALID_AUTHORIZATION_SPECIFICATION => {
            LockError::Forbidden {
                backend: BACKEND,
                message: format!("{context}: authentication failed: {}", message(&err)),
            }
        }
        SqlState::READ_ONLY_SQL_TRANSACTION => read_only(
            BACKEND,
            DriverError {
                context: context.to_owned(),
                source: err,
            },
            "; with several hosts in the connection string, add target_session_attrs=read-write so that only the primary is chosen",
        ),
        SqlState::INVALID_CATALOG_NAME | SqlState::UNDEFINED_FUNCTION => LockError::Misconfigured {
            backend: BACKEND,
            message: format!("{context}: {}", message(&err)),
        },
        code if code.code().starts_with("22") => LockError::invalid_record(
            BACKEND,
            format!(
                "{context}: the stored row holds values out of range: {}",
                message(&err)
            ),
        ),
        code if ["08", "53", "57", "40", "55"]
            .iter()
            .any(|class| code.code().starts_with(class)) =>
        {
            LockError::unavailable(
                BACKEND,
                DriverError {
                    context: context.to_owned(),
                    source: err,
                },
            )
        }
        _ => LockError::other(
            BACKEND,
            DriverError {
                context: context.to_owned(),
                source: err,
            },
        ),
    }
}

/// Maps a pool error: a timeout or a failed connection is an outage.
pub(crate) fn map_pool(context: &str, err: PoolError) -> LockError {
    match err {
        PoolError::Backend(err) => map(context, err),
        PoolError::Timeout(kind) => LockError::unavailable(
            BACKEND,
            format!("{context}: timed out waiting for a pooled connection ({kind:?})"),
        ),
        other => LockError::unavailable(BACKEND, format!("{context}: {other}")),
    }
}
