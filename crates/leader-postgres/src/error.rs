//! Mapping of driver and pool errors onto the core's error kinds, with credentials removed.

use std::fmt;

use deadpool_postgres::PoolError;
use leader_core::LockError;
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
                "{context}: {}; create it with PostgresStore::create_table or deploy/postgres/schema.sql",
                message(&err)
            ),
        },
        SqlState::INSUFFICIENT_PRIVILEGE => LockError::Forbidden {
            backend: BACKEND,
            message: format!(
                "{context}: {}; the role needs SELECT, INSERT and UPDATE on the table (deploy/postgres/grants.sql)",
                message(&err)
            ),
        },
        SqlState::INVALID_PASSWORD | SqlState::INVALID_AUTHORIZATION_SPECIFICATION => {
            LockError::Forbidden {
                backend: BACKEND,
                message: format!("{context}: authentication failed: {}", message(&err)),
            }
        }
        SqlState::INVALID_CATALOG_NAME
        | SqlState::UNDEFINED_COLUMN
        | SqlState::UNDEFINED_FUNCTION => LockError::Misconfigured {
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

/// A connection string with its password replaced by `***`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let redacted = redact_keyword_password(url);
    let Some(scheme_end) = redacted.find("://") else {
        return redacted;
    };
    let rest = &redacted[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return redacted;
    };
    let userinfo = &authority[..at];
    let Some(colon) = userinfo.find(':') else {
        return redacted;
    };
    format!(
        "{}{}:***{}",
        &redacted[..scheme_end + 3],
        &userinfo[..colon],
        &redacted[scheme_end + 3 + at..]
    )
}

/// Redacts `password=...` in key-value connection strings and URL query parameters.
fn redact_keyword_password(conn: &str) -> String {
    let lower = conn.to_ascii_lowercase();
    let mut out = String::with_capacity(conn.len());
    let mut rest = 0;
    let mut search = 0;
    while let Some(found) = lower[search..].find("password=") {
        let start = search + found;
        let boundary =
            start == 0 || matches!(conn.as_bytes()[start - 1], b' ' | b'?' | b'&' | b'\t');
        let value_start = start + "password=".len();
        if !boundary {
            search = value_start;
            continue;
        }
        let value_end = conn[value_start..]
            .find([' ', '&', '\t'])
            .map_or(conn.len(), |end| value_start + end);
        out.push_str(&conn[rest..value_start]);
        out.push_str("***");
        rest = value_end;
        search = value_end;
    }
    out.push_str(&conn[rest..]);
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cr%40t@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(redact_url("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(
            redact_url("postgres://db/x?user=a&password=hunter2&sslmode=require"),
            "postgres://db/x?user=a&password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("host=db password=hunter2 user=a"),
            "host=db password=*** user=a"
        );
        assert_eq!(redact_url("host=db user=a"), "host=db user=a");
        assert_eq!(redact_url("postgres://a:b@c@db/x"), "postgres://a:***@db/x");
    }
}
