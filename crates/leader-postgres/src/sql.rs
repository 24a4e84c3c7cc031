//! The statements, one round trip each. Expiry is decided with the server's `now()` inside the
//! statement that acts on it (S1): `pg_catalog.now()`, the start of the statement's own
//! transaction, which no session setting moves.

use leader_core::backend::RecordColumns;
use leader_core::{LockError, Observed, Version};
use tokio_postgres::Row;

use crate::error::BACKEND;

/// A validated, quoted `schema.table`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TableName {
    pub(crate) schema: String,
    pub(crate) table: String,
}

impl TableName {
    pub(crate) fn new(schema: &str, table: &str) -> Result<Self, LockError> {
        for (what, name) in [("schema", schema), ("table", table)] {
            if !leader_core::backend::is_plain_sql_identifier(name, 63) {
                return Err(LockError::Misconfigured {
                    backend: BACKEND,
                    message: format!(
                        "invalid {what} name {name:?}: use 1 to 63 letters, digits, '_' or '$', not starting with a digit"
                    ),
                });
            }
        }
        Ok(Self {
            schema: schema.to_owned(),
            table: table.to_owned(),
        })
    }

    /// `"schema"."table"`: quoted, so names are taken exactly as given.
    pub(crate) fn quoted(&self) -> String {
        format!("\"{}\".\"{}\"", self.schema, self.table)
    }

    pub(crate) fn display(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }
}

/// The server's clock: the start of the statement's transaction, which for the locks' statements
/// is the statement's start (each runs as its own transaction; a pooled connection left inside
/// one is refused, see `PostgresStore::client`). Named in `pg_catalog`, so that a `now()` of
/// another schema that a session's `search_path` puts first (a test's clock, say) is never the
/// one called.
const NOW: &str = "pg_catalog.now()";

const COLUMNS: &str = "holder_identity, lease_duration_ms, acquire_time, renew_time, leader_transitions, strategy, preferred_holder, version, extensions";

/// A row that [`decode`] can read: an acquisition never overwrites a row it could not read, and
/// odd values that decode (a zero lease, a renewal before the acquisition) do not block it (S8).
const VALID: &str = "l.lease_duration_ms >= 0 AND l.leader_transitions >= 0 \
    AND isfinite(l.acquire_time) AND isfinite(l.renew_time)";

/// True when this session holds the advisory lock on key `k` (a parameter).
fn held(k: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() \
         AND classid = (({k}::bigint >> 32) & 4294967295)::oid AND objid = ({k}::bigint & 4294967295)::oid \
         AND objsubid = 1 AND granted)"
    )
}

/// This session holds the advisory lock on `k`, taking it if it is free; never twice, so it
/// never stacks.
fn hold(k: &str) -> String {
    format!("({} OR pg_try_advisory_lock({k}::bigint))", held(k))
}

/// Which lock the statements are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The table lock: the row alone.
    Table,
    /// The advisory lock: every write naming a holder also needs this session's advisory lock,
    /// whose key is the last parameter.
    Advisory,
}

/// The statements of one lock kind on one table. Each kind gets only its own SQL, so the table
/// lock's renewal stays a bare single-row `UPDATE`.
#[derive(Clone, Debug)]
pub(crate) struct Statements {
    /// `$1` name.
    pub(crate) get: String,
    /// `$1` name, `$2..$9` record; advisory: `$10` key.
    pub(crate) create: String,
    /// `$1` name, `$2..$9` record, `$10` expected version; advisory: `$11` key. For a record
    /// with a holder; see `release`.
    pub(crate) update: String,
    /// [`update`](Self::update) of a record with an empty holder, which also notifies followers on
    /// channel `$11`; advisory: `$12` key.
    pub(crate) release: String,
    /// A write on the current holder's behalf (a handover request): `$1` name, `$2..$9` record,
    /// `$10` expected version, `$11` channel. The holder must stay the same; its expiry is kept
    /// (the request renews nobody's lease) and followers and the holder are notified. Needs no
    /// advisory lock.
    pub(crate) request: String,
    /// `$1` name, `$2` holder, `$3` lease ms, `$4` time, `$5` the lowest fencing token wanted;
    /// advisory: `$6` key.
    pub(crate) try_acquire: String,
    /// `$1` name: the holder's milliseconds left by the server's clock, if someone holds it.
    pub(crate) time_left: String,
    /// Advisory only: `$1` key, `$2` name, `$3` identity.
    pub(crate) unlock: String,
    /// Many records at once (a shard set's read): `$1` names; each row is the name, then the
    /// columns.
    pub(crate) get_many: String,
    /// Many holders' renewals at once (a shard set's round), each as `update` would make it:
    /// `$1` names, `$2..$9` the records' columns and `$10` the expected versions, as arrays.
    /// Returns the name and new version of each row written; a row not returned lost its
    /// compare-and-swap.
    pub(crate) renew_many: String,
    /// `renew_many`, then `get_many` of `$11` names, in one statement: each row is whether it
    /// is a renewal's (true: as written, which the read of that name sees too), the name, then
    /// the columns.
    pub(crate) renew_and_read: String,
}

impl Statements {
    pub(crate) fn new(table: &TableName, kind: Kind) -> Self {
        let t = table.quoted();
        let advisory = kind == Kind::Advisory;
        let get = format!("SELECT {COLUMNS} FROM {t} WHERE name = $1");
        // A random first version: a row deleted and created again never matches an old version.
        let first_version = "(floor(random() * 4503599627370496))::bigint + 1";
        let expires = format!("{NOW} + $3::bigint * interval '1 millisecond'");

        // An acquisition by this session takes the advisory lock (if it is free).
        let create_guard = if advisory {
            format!(
                "WHERE CASE WHEN $2::text = '' THEN true ELSE {} END",
                hold("$10")
            )
        } else {
            String::new()
        };
        let create = format!(
            "INSERT INTO {t} (name, {COLUMNS}, expires_at)
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, {first_version}, $9, {expires} {create_guard}
             ON CONFLICT (name) DO NOTHING
             RETURNING version"
        );

        // A renewal by the holder needs the advisory lock of the *same* session; an acquisition
        // may take it. An unreadable row is never overwritten (S8). `key` is the advisory key's
        // parameter, which differs between the two statements below.
        let update = |key: &str| {
            let guard = if advisory {
                format!(
                    "CASE WHEN l.version <> $10 OR NOT ({VALID}) THEN false
                          WHEN $2::text = '' THEN true
                          WHEN l.holder_identity = $2 THEN {}
                          ELSE {} END",
                    held(key),
                    hold(key)
                )
            } else {
                format!("l.version = $10 AND {VALID}")
            };
            format!(
                "UPDATE {t} AS l SET holder_identity = $2, lease_duration_ms = $3, acquire_time = $4,
                   renew_time = $5, leader_transitions = $6, strategy = $7, preferred_holder = $8,
                   extensions = $9, version = l.version + 1, expires_at = {expires}
                 WHERE l.name = $1 AND {guard}
                 RETURNING l.version"
            )
        };
        // A release (empty holder) also notifies followers on channel `$11`, and lets go of the
        // advisory lock (`$12`), in the same statement.
        let unlock = if advisory {
            format!(
                "LEFT JOIN LATERAL (SELECT pg_advisory_unlock($12::bigint) WHERE {}) a ON true",
                held("$12")
            )
        } else {
            String::new()
        };
        let release = format!(
            "WITH updated AS ({})
             SELECT u.version FROM updated u
             LEFT JOIN LATERAL (SELECT pg_notify($11, '')) n ON true
             {unlock}",
            update("$12")
        );
        // Renewals and takeovers: a bare UPDATE, the cheapest committed write there is.
        let update = update("$11");

        // Free or expired, and not reserved for another candidate by a handover request. A lease
        // of this identity is no exception: another process may run with it (S13).
        let takeable = format!(
            "(l.holder_identity = '' OR l.expires_at <= {NOW}) \
             AND coalesce(l.preferred_holder, '') IN ('', EXCLUDED.holder_identity)"
        );
        let (insert_guard, takeover_guard) = if advisory {
            (
                // The insert's guard runs before the conflict with an existing row is found:
                // it must not take the advisory lock of a lease reserved for another candidate.
                format!(
                    "WHERE CASE WHEN EXISTS (SELECT 1 FROM {t} r WHERE r.name = $1 \
                       AND coalesce(r.preferred_holder, '') NOT IN ('', $2)) THEN false ELSE {} END",
                    hold("$6")
                ),
                format!(
                    "CASE WHEN {takeable} AND {VALID} THEN {} ELSE false END",
                    hold("$6")
                ),
            )
        } else {
            (String::new(), format!("{takeable} AND {VALID}"))
        };
        let try_acquire = format!(
            "WITH acquired AS (
               INSERT INTO {t} AS l (name, {COLUMNS}, expires_at)
               SELECT $1, $2, $3, $4, $4, greatest(1, $5::bigint), NULL, NULL, {first_version},
                 NULL, {expires} {insert_guard}
               ON CONFLICT (name) DO UPDATE SET holder_identity = EXCLUDED.holder_identity,
                 lease_duration_ms = EXCLUDED.lease_duration_ms, acquire_time = EXCLUDED.acquire_time,
                 renew_time = EXCLUDED.renew_time,
                 leader_transitions = greatest(l.leader_transitions + 1, EXCLUDED.leader_transitions),
                 preferred_holder = NULL, version = l.version + 1, expires_at = EXCLUDED.expires_at
               WHERE {takeover_guard}
               RETURNING true AS acquired, {COLUMNS}, NULL::bigint AS left_ms
             )
             SELECT * FROM acquired
             UNION ALL
             SELECT false, {COLUMNS},
               greatest(0, ceil(extract(epoch FROM expires_at - {NOW}) * 1000))::bigint
             FROM {t} WHERE name = $1 AND NOT EXISTS (SELECT 1 FROM acquired)"
        );
        let request = format!(
            "WITH updated AS (
               UPDATE {t} AS l SET holder_identity = $2, lease_duration_ms = $3, acquire_time = $4,
                 renew_time = $5, leader_transitions = $6, strategy = $7, preferred_holder = $8,
                 extensions = $9, version = l.version + 1
               WHERE l.name = $1 AND l.version = $10 AND {VALID} AND l.holder_identity = $2
               RETURNING l.version)
             SELECT u.version FROM updated u
             LEFT JOIN LATERAL (SELECT pg_notify($11, '')) n ON true"
        );
        let time_left = format!(
            "SELECT greatest(0, ceil(extract(epoch FROM expires_at - {NOW}) * 1000))::bigint \
             FROM {t} WHERE name = $1 AND holder_identity <> ''"
        );
        let unlock_unless_holder = format!(
            "SELECT pg_advisory_unlock($1::bigint) WHERE {} \
             AND NOT EXISTS (SELECT 1 FROM {t} WHERE name = $2 AND holder_identity = $3)",
            held("$1")
        );
        let get_many = format!("SELECT name, {COLUMNS} FROM {t} WHERE name = ANY($1::text[])");
        let renewals = format!(
            "UPDATE {t} AS l SET holder_identity = v.holder, lease_duration_ms = v.lease_ms,
               acquire_time = v.acquire, renew_time = v.renew, leader_transitions = v.transitions,
               strategy = v.strategy, preferred_holder = v.preferred, extensions = v.extensions,
               version = l.version + 1,
               expires_at = {NOW} + v.lease_ms * interval '1 millisecond'
             FROM unnest($1::text[], $2::text[], $3::bigint[], $4::timestamptz[], $5::timestamptz[],
                         $6::bigint[], $7::text[], $8::text[], $9::text[], $10::bigint[])
               AS v(name, holder, lease_ms, acquire, renew, transitions, strategy, preferred,
                    extensions, expected)
             WHERE l.name = v.name AND l.version = v.expected AND l.holder_identity = v.holder
               AND {VALID}"
        );
        let renew_many = format!("{renewals} RETURNING l.name, l.version");
        // A statement's reads see the table as it began: a renewed row is answered as written.
        let written: Vec<String> = COLUMNS.split(", ").map(|c| format!("l.{c}")).collect();
        let renew_and_read = format!(
            "WITH renewed AS ({renewals} RETURNING l.name, {written})
             SELECT true, name, {COLUMNS} FROM renewed
             UNION ALL
             SELECT false, name, {COLUMNS} FROM {t}
             WHERE name = ANY($11::text[]) AND name NOT IN (SELECT name FROM renewed)",
            written = written.join(", ")
        );
        Self {
            get_many,
            renew_many,
            renew_and_read,
            get,
            create,
            update,
            release,
            request,
            try_acquire,
            time_left,
            unlock: unlock_unless_holder,
        }
    }
}

/// Where the version is among a record's columns from `at` on, as [`decode`] reads them.
pub(crate) const VERSION: usize = 7;

/// Where `try_acquire`'s row has the holder's time left: after whether it acquired and the
/// record's columns.
pub(crate) const TIME_LEFT: usize = 10;

/// Decodes a row of `COLUMNS` starting at column `at`, checking what the types cannot.
pub(crate) fn decode(
    row: &Row,
    at: usize,
    context: impl std::fmt::Display + Copy,
) -> Result<Observed, LockError> {
    fn get<'a, T: tokio_postgres::types::FromSql<'a>>(
        row: &'a Row,
        i: usize,
        context: impl std::fmt::Display,
    ) -> Result<T, LockError> {
        row.try_get(i).map_err(|err| {
            LockError::invalid_record(
                BACKEND,
                format!("{context}: column {}: {err}", row.columns()[i].name()),
            )
        })
    }
    let record = RecordColumns {
        holder: get(row, at, context)?,
        lease_ms: get(row, at + 1, context)?,
        acquire: get(row, at + 2, context)?,
        renew: get(row, at + 3, context)?,
        transitions: get(row, at + 4, context)?,
        strategy: get(row, at + 5, context)?,
        preferred: get(row, at + 6, context)?,
        extensions: get(row, at + 8, context)?,
    }
    .into_record(BACKEND, context)?;
    let version: i64 = get(row, at + VERSION, context)?;
    Ok(Observed {
        record,
        version: Version::from(version),
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
    fn identifiers_are_validated() {
        assert!(TableName::new("public", "leader_election").is_ok());
        for bad in ["", "1abc", "a b", "x\"; drop table y; --", &"a".repeat(64)] {
            assert!(TableName::new("public", bad).is_err(), "{bad}");
            assert!(TableName::new(bad, "t").is_err(), "{bad}");
        }
    }

    #[test]
    fn the_time_left_follows_the_record() {
        assert_eq!(TIME_LEFT, 1 + COLUMNS.split(", ").count());
        let try_acquire = Statements::new(
            &TableName::new("public", "leader_election").expect("name"),
            Kind::Table,
        )
        .try_acquire;
        assert!(try_acquire.contains(&format!("{COLUMNS}, NULL::bigint AS left_ms")));
    }

    #[test]
    fn every_now_is_pg_catalog_s() {
        for kind in [Kind::Table, Kind::Advisory] {
            let s = Statements::new(&TableName::new("public", "t").expect("name"), kind);
            for sql in [
                &s.create,
                &s.update,
                &s.release,
                &s.request,
                &s.try_acquire,
                &s.time_left,
                &s.renew_many,
                &s.renew_and_read,
            ] {
                assert!(
                    !sql.replace(NOW, "").contains("now()"),
                    "an unqualified now(): {sql}"
                );
            }
        }
    }
}
