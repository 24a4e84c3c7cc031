//! The statements. Expiry is decided with the server's clock (`UTC_TIMESTAMP(6)`, free of the
//! session's time zone and of daylight saving) inside the statement that acts on it (S1).

use chrono::{DateTime, NaiveDateTime, Utc};
use leader_core::backend::RecordColumns;
use leader_core::{LeaderElectionRecord, LockError, Observed, Version};
use mysql_async::{Row, Value};

use crate::error::BACKEND;

/// The longest name, identity or strategy the table stores, in bytes.
pub(crate) const MAX_TEXT: usize = 512;

/// A validated, quoted table name, optionally qualified by its database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TableName {
    pub(crate) database: Option<String>,
    pub(crate) table: String,
}

impl TableName {
    /// `table` or `database.table`.
    pub(crate) fn parse(name: &str) -> Result<Self, LockError> {
        let (database, table) = match name.split_once('.') {
            Some((database, table)) => (Some(database), table),
            None => (None, name),
        };
        for part in database.into_iter().chain([table]) {
            if !leader_core::backend::is_plain_sql_identifier(part, 64) {
                return Err(LockError::Misconfigured {
                    backend: BACKEND,
                    message: format!(
                        "invalid table name {name:?}: use `table` or `database.table`, each 1 to 64 letters, digits, '_' or '$', not starting with a digit"
                    ),
                });
            }
        }
        Ok(Self {
            database: database.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// `` `database`.`table` ``: quoted, so names are taken exactly as given.
    pub(crate) fn quoted(&self) -> String {
        match &self.database {
            Some(database) => format!("`{database}`.`{}`", self.table),
            None => format!("`{}`", self.table),
        }
    }

    pub(crate) fn display(&self) -> String {
        match &self.database {
            Some(database) => format!("{database}.{}", self.table),
            None => self.table.clone(),
        }
    }
}

/// The lock table's columns. Names and identities are byte strings (`VARBINARY`): compared
/// exactly, with no collation that would take `a` and `A `, or `a` and `a `, for one name.
macro_rules! table_columns {
    () => {
        "(
    name               VARBINARY(512) NOT NULL PRIMARY KEY,
    holder_identity    VARBINARY(512) NOT NULL DEFAULT '',
    lease_duration_ms  BIGINT         NOT NULL,
    acquire_time       DATETIME(6)    NOT NULL,
    renew_time         DATETIME(6)    NOT NULL,
    leader_transitions BIGINT         NOT NULL DEFAULT 0,
    strategy           VARBINARY(512) NULL,
    preferred_holder   VARBINARY(512) NULL,
    version            BIGINT         NOT NULL,
    expires_at         DATETIME(6)    NOT NULL,
    extensions         MEDIUMBLOB     NULL
) ENGINE=InnoDB"
    };
}

/// The lock table under its default name, as
/// [`MysqlStore::create_table`](crate::MysqlStore::create_table) creates it (and the repository's
/// `deploy/mysql/schema.sql` has it): for a migration tool, or a table owner who creates it for a
/// least-privilege user. For another name, replace `` `leader_election` ``.
pub const SCHEMA: &str = concat!(
    "CREATE TABLE IF NOT EXISTS `leader_election` ",
    table_columns!()
);

/// The record's columns, in the order of the statements' parameters and of [`decode`].
pub(crate) const COLUMNS: &str = "holder_identity, lease_duration_ms, acquire_time, renew_time, leader_transitions, strategy, preferred_holder, extensions, version";

/// A row that [`decode`] can read: a write never overwrites a row it could not read, and odd
/// values that decode (a zero lease, a renewal before the acquisition) do not block it (S8).
/// Zero dates, which a server in a lax SQL mode may hold, do not decode.
pub(crate) const VALID: &str = "lease_duration_ms >= 0 AND leader_transitions >= 0 \
    AND acquire_time >= '1000-01-01' AND renew_time >= '1000-01-01'";

/// The server's clock, in UTC whatever the session's time zone.
const NOW: &str = "UTC_TIMESTAMP(6)";

/// True when the session running the statement holds the user-level lock named by a parameter.
const SESSION_HOLDS: &str = "IS_USED_LOCK(?) = CONNECTION_ID()";

/// The statements on one table.
#[derive(Clone, Debug)]
pub(crate) struct Statements {
    pub(crate) create_table: String,
    /// `name`: the record's columns.
    pub(crate) get: String,
    /// `name`, the record's 8 columns, the new version, the lease in ms again (for expiry).
    pub(crate) create: String,
    /// The record's 8 columns, the new version, the lease in ms again, `name`, the expected
    /// version: the holder's own write (a renewal, a takeover by compare-and-swap, a release).
    pub(crate) update: String,
    /// A write on the current holder's behalf (a handover request): the record's 8 columns, the
    /// new version, `name`, the expected version. The holder must stay the same and its expiry
    /// is kept: the request renews nobody's lease.
    pub(crate) request: String,
    /// Takes the record at the version read (and decoded) if it is free or expired by the
    /// server's clock and not reserved for another candidate: the record's 8 columns, the new
    /// version, the lease in ms again, `name`, the expected version, the new holder (whom a
    /// reservation may name).
    pub(crate) take: String,
    /// `name`: the record's columns, then the holder's microseconds left by the server's clock.
    pub(crate) observe: String,
    /// `name`: the holder's microseconds left by the server's clock, if someone holds it.
    pub(crate) time_left: String,
    /// `name`, a version: the fencing token stored at that version, if the row is at it.
    pub(crate) token_at: String,
}

impl Statements {
    pub(crate) fn new(table: &TableName) -> Self {
        let t = table.quoted();
        let expires = format!("{NOW} + INTERVAL (? * 1000) MICROSECOND");
        let set_record = "holder_identity = ?, lease_duration_ms = ?, acquire_time = ?, \
            renew_time = ?, leader_transitions = ?, strategy = ?, preferred_holder = ?, \
            extensions = ?, version = ?";
        let left = format!("GREATEST(0, TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at))");
        Self {
            create_table: format!("CREATE TABLE IF NOT EXISTS {t} {}", table_columns!()),
            get: format!("SELECT {COLUMNS} FROM {t} WHERE name = ?"),
            create: format!(
                "INSERT INTO {t} (name, {COLUMNS}, expires_at) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {expires})"
            ),
            update: format!(
                "UPDATE {t} SET {set_record}, expires_at = {expires} \
                 WHERE name = ? AND version = ? AND {VALID}"
            ),
            request: format!(
                "UPDATE {t} SET {set_record} \
                 WHERE name = ? AND version = ? AND holder_identity = ? AND {VALID}"
            ),
            // Free or expired, and not reserved for another candidate by a handover request. A
            // lease of this identity is no exception: another process may run with it (S13).
            take: format!(
                "UPDATE {t} SET {set_record}, expires_at = {expires} \
                 WHERE name = ? AND version = ? AND (holder_identity = '' OR expires_at <= {NOW}) \
                 AND COALESCE(preferred_holder, '') IN ('', ?) AND {VALID}"
            ),
            observe: format!("SELECT {COLUMNS}, {left} FROM {t} WHERE name = ?"),
            time_left: format!("SELECT {left} FROM {t} WHERE name = ? AND holder_identity <> ''"),
            token_at: format!(
                "SELECT leader_transitions FROM {t} WHERE name = ? AND version = ? AND {VALID}"
            ),
        }
    }
}

/// The statements of the `GET_LOCK` lock ([`NamedLock`](crate::NamedLock)) on one table: the
/// table lock's writes, each also requiring that the session running it holds the record's
/// user-level lock (its name is the last parameter).
#[derive(Clone, Debug)]
pub(crate) struct NamedStatements {
    /// `key`, `key`: 1 when this session holds the user-level lock, taking it when it is free.
    /// Never a second time: a lock taken twice by one session would need two releases.
    pub(crate) hold: String,
    /// `key`, `name`, the expected version, this identity, `key`: as `hold`, but takes a free
    /// lock only for a takeover (the record at that version names nobody or another holder,
    /// and decodes). A holder whose session lost the lock never gets it back this way.
    pub(crate) hold_to_take: String,
    /// [`Statements::create`]'s parameters, then `key`.
    pub(crate) create: String,
    /// [`Statements::update`]'s parameters, then `key`: the holder's own write.
    pub(crate) update: String,
    /// [`Statements::take`]'s parameters, then `key`.
    pub(crate) take: String,
    /// `key`: lets go of the user-level lock (1 when this session held it).
    pub(crate) release: String,
    /// `name`: the holder, preferred holder and fencing term, what a follower's watch compares.
    pub(crate) summary: String,
    /// `key`, the seconds to wait, `key`: 1 when the lock was obtained, and let go of in the
    /// same statement. The server runs the whole statement whatever the client does, so a
    /// follower whose process stops while it waits never keeps the lock it is given.
    pub(crate) wait: String,
}

impl NamedStatements {
    pub(crate) fn new(table: &TableName, statements: &Statements) -> Self {
        let t = table.quoted();
        let expires = format!("{NOW} + INTERVAL (? * 1000) MICROSECOND");
        Self {
            hold: format!("SELECT IF({SESSION_HOLDS}, 1, GET_LOCK(?, 0))"),
            hold_to_take: format!(
                "SELECT IF({SESSION_HOLDS}, 1, IF(EXISTS (SELECT 1 FROM {t} \
                 WHERE name = ? AND version = ? AND holder_identity <> ? AND {VALID}), \
                 GET_LOCK(?, 0), 0))"
            ),
            create: format!(
                "INSERT INTO {t} (name, {COLUMNS}, expires_at) \
                 SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {expires} FROM DUAL WHERE {SESSION_HOLDS}"
            ),
            update: format!("{} AND {SESSION_HOLDS}", statements.update),
            take: format!("{} AND {SESSION_HOLDS}", statements.take),
            release: "SELECT RELEASE_LOCK(?)".to_owned(),
            summary: format!(
                "SELECT holder_identity, preferred_holder, leader_transitions FROM {t} WHERE name = ?"
            ),
            // IF evaluates its condition first, then only the branch it picks.
            wait: "SELECT IF(GET_LOCK(?, ?) = 1, RELEASE_LOCK(?), 0)".to_owned(),
        }
    }
}

/// A new version: random, so that a row deleted and created again, or written by a batch, never
/// matches a version read before.
pub(crate) fn next_version() -> i64 {
    fastrand::i64(1..i64::MAX)
}

/// The record's columns as parameters, in the order of `COLUMNS` (`version` aside), checked
/// against what the columns hold.
pub(crate) fn columns(record: &LeaderElectionRecord) -> Result<RecordColumns, LockError> {
    for (what, text) in [
        ("holder identity", Some(&record.holder_identity)),
        ("strategy", record.strategy.as_ref()),
        ("preferred holder", record.preferred_holder.as_ref()),
    ] {
        if text.is_some_and(|t| t.len() > MAX_TEXT) {
            return Err(LockError::invalid_record(
                BACKEND,
                format!("{what} is too large to store (over {MAX_TEXT} bytes)"),
            ));
        }
    }
    RecordColumns::new(record, BACKEND)
}

/// The 8 columns of `COLUMNS` before `version`, as parameters.
pub(crate) fn values(c: &RecordColumns) -> Vec<Value> {
    vec![
        c.holder.clone().into(),
        c.lease_ms.into(),
        stored_time(c.acquire).into(),
        stored_time(c.renew).into(),
        c.transitions.into(),
        c.strategy.clone().into(),
        c.preferred.clone().into(),
        c.extensions.clone().into(),
    ]
}

/// A time as `DATETIME(6)` holds it: UTC, within the column's range (1000 to 9999).
fn stored_time(time: DateTime<Utc>) -> NaiveDateTime {
    let min = NaiveDateTime::parse_from_str("1000-01-01 00:00:00", "%Y-%m-%d %H:%M:%S")
        .unwrap_or_default();
    let max = NaiveDateTime::parse_from_str("9999-12-31 23:59:59", "%Y-%m-%d %H:%M:%S")
        .unwrap_or_default();
    time.naive_utc().clamp(min, max)
}

/// Decodes the 9 columns of `COLUMNS` starting at column `at`, checking what the types cannot.
pub(crate) fn decode(
    row: &Row,
    at: usize,
    context: impl std::fmt::Display + Copy,
) -> Result<Observed, LockError> {
    let bad = |reason: String| LockError::invalid_record(BACKEND, format!("{context}: {reason}"));
    let column = |i: usize| {
        row.columns_ref()
            .get(i)
            .map(|c| c.name_str().into_owned())
            .unwrap_or_default()
    };
    let text = |i: usize| -> Result<String, LockError> {
        match row.as_ref(i) {
            Some(Value::Bytes(bytes)) => String::from_utf8(bytes.clone())
                .map_err(|_| bad(format!("column {}: not UTF-8", column(i)))),
            other => Err(bad(format!("column {}: not text: {other:?}", column(i)))),
        }
    };
    let optional_text = |i: usize| -> Result<Option<String>, LockError> {
        match row.as_ref(i) {
            Some(Value::NULL) => Ok(None),
            _ => text(i).map(Some),
        }
    };
    let int = |i: usize| -> Result<i64, LockError> {
        row.get_opt::<i64, _>(i)
            .and_then(Result::ok)
            .ok_or_else(|| bad(format!("column {}: not an integer", column(i))))
    };
    let time = |i: usize| -> Result<DateTime<Utc>, LockError> {
        row.get_opt::<NaiveDateTime, _>(i)
            .and_then(Result::ok)
            .map(|t| t.and_utc())
            .ok_or_else(|| bad(format!("column {}: not a date and time", column(i))))
    };
    let record = RecordColumns {
        holder: text(at)?,
        lease_ms: int(at + 1)?,
        acquire: time(at + 2)?,
        renew: time(at + 3)?,
        transitions: int(at + 4)?,
        strategy: optional_text(at + 5)?,
        preferred: optional_text(at + 6)?,
        extensions: optional_text(at + 7)?,
    }
    .into_record(BACKEND, context)?;
    Ok(Observed {
        record,
        version: Version::from(int(at + 8)?),
    })
}

/// A version this table issued; anything else can match no row.
pub(crate) fn parse_version(version: &Version) -> Option<i64> {
    version.as_str().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_validated() {
        assert_eq!(
            TableName::parse("leader_election").expect("valid").quoted(),
            "`leader_election`"
        );
        assert_eq!(
            TableName::parse("app.locks").expect("valid").quoted(),
            "`app`.`locks`"
        );
        for bad in [
            "",
            "1abc",
            "a b",
            "x`; drop table y; --",
            &"a".repeat(65),
            "a.b.c",
            ".t",
        ] {
            assert!(TableName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_shipped_schema_is_the_one_the_code_creates() {
        let shipped = include_str!("../../../deploy/mysql/schema.sql");
        let statement: String = shipped
            .lines()
            .filter(|line| !line.starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        let created =
            Statements::new(&TableName::parse("leader_election").expect("name")).create_table;
        assert_eq!(statement.trim().trim_end_matches(';'), SCHEMA);
        assert_eq!(created, SCHEMA);
    }

    #[test]
    fn times_outside_the_column_range_are_clamped() {
        let early = DateTime::<Utc>::MIN_UTC;
        assert_eq!(stored_time(early).format("%Y").to_string(), "1000");
        let now = Utc::now();
        assert_eq!(stored_time(now), now.naive_utc());
    }
}
