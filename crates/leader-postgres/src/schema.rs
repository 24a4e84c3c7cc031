//! The lock table: its statement, and the start-up step that makes it ready. The step looks at
//! the table of the configured name before it changes anything: a lock table of this version is
//! used as it is, one of the earlier version (which lacks exactly `extensions`) gains that
//! column, and any other table is refused and left as found (S8, S15).

use leader_core::LockError;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use crate::error::{BACKEND, map};
use crate::param::typed;
use crate::sql::TableName;

/// The lock table's columns, written once for [`SCHEMA`] and the statement the start-up step
/// runs; [`COLUMNS`] lists them as the server names their types.
macro_rules! table_columns {
    () => {
        "(
    name               text        PRIMARY KEY,
    holder_identity    text        NOT NULL DEFAULT '',
    lease_duration_ms  bigint      NOT NULL,
    acquire_time       timestamptz NOT NULL,
    renew_time         timestamptz NOT NULL,
    leader_transitions bigint      NOT NULL DEFAULT 0,
    strategy           text,
    preferred_holder   text,
    version            bigint      NOT NULL,
    expires_at         timestamptz NOT NULL,
    extensions         text
)"
    };
}

const TABLE_COLUMNS: &str = table_columns!();

/// The lock table in the default schema and name, as
/// [`PostgresStore::create_table`](crate::PostgresStore::create_table) creates it (and the
/// repository's `deploy/postgres/schema.sql` has it): for a migration tool, or a table owner who
/// creates it for a least-privilege role. For another schema or table name, replace
/// `"public"."leader_election"`.
pub const SCHEMA: &str = concat!(
    r#"CREATE TABLE IF NOT EXISTS "public"."leader_election" "#,
    table_columns!()
);

/// What a lock table made by an earlier version needs, in the default schema and name (replace
/// `"public"."leader_election"` for another): the `extensions` column, where features built on the
/// election keep their data. Run it on a lock table only.
/// [`PostgresStore::create_table`](crate::PostgresStore::create_table) runs it too, on a table
/// whose other columns it has checked.
pub const MIGRATION: &str =
    r#"ALTER TABLE "public"."leader_election" ADD COLUMN IF NOT EXISTS extensions text"#;

/// The column a lock table of the earlier version lacks.
const ADDED: &str = "extensions";

/// A lock table's columns and their types as `pg_catalog.format_type` names them, in the order
/// of [`SCHEMA`].
const COLUMNS: [(&str, &str); 11] = [
    ("name", "text"),
    ("holder_identity", "text"),
    ("lease_duration_ms", "bigint"),
    ("acquire_time", "timestamp with time zone"),
    ("renew_time", "timestamp with time zone"),
    ("leader_transitions", "bigint"),
    ("strategy", "text"),
    ("preferred_holder", "text"),
    ("version", "bigint"),
    ("expires_at", "timestamp with time zone"),
    (ADDED, "text"),
];

/// The relation `$1` names (a quoted `schema.table`), if any: its kind, then a row per column
/// with its type, whether an insert must name it (`NOT NULL`, no default, not an identity), and
/// whether it alone is a unique key that `ON CONFLICT (column)` can use. Read from the catalog,
/// so that it sees every column whatever the role's column privileges.
const SHAPE: &str = "SELECT c.relkind::text, a.attname::text,
       pg_catalog.format_type(a.atttypid, a.atttypmod),
       a.attnotnull AND NOT a.atthasdef AND a.attidentity = '',
       EXISTS (SELECT 1 FROM pg_catalog.pg_index i
               WHERE i.indrelid = c.oid AND i.indisunique AND i.indimmediate AND i.indisvalid
                 AND i.indpred IS NULL AND i.indexprs IS NULL
                 AND i.indnkeyatts = 1 AND i.indkey[0] = a.attnum)
FROM pg_catalog.pg_class c
LEFT JOIN pg_catalog.pg_attribute a
  ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE c.oid = pg_catalog.to_regclass($1)
ORDER BY a.attnum";

/// A column of the table found, as [`SHAPE`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Column {
    name: String,
    ty: String,
    required: bool,
    unique: bool,
}

/// What the table of the configured name is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Shape {
    Missing,
    Current,
    /// A lock table of the earlier version: every column but `extensions`.
    Earlier,
    /// Anything else, and what is wrong with it.
    Other(String),
}

/// What a relation of kind `kind` (`pg_class.relkind`) with these columns is.
fn classify(kind: Option<&str>, columns: &[Column]) -> Shape {
    let Some(kind) = kind else {
        return Shape::Missing;
    };
    let what = match kind {
        "r" | "p" => None,
        "v" => Some("a view"),
        "m" => Some("a materialized view"),
        "f" => Some("a foreign table"),
        "S" => Some("a sequence"),
        "i" | "I" => Some("an index"),
        "c" => Some("a composite type"),
        _ => Some("another kind of relation"),
    };
    if let Some(what) = what {
        return Shape::Other(format!("it is {what}, not a table"));
    }
    let found = |name: &str| columns.iter().find(|c| c.name == name);
    let mut missing = Vec::new();
    let mut problems = Vec::new();
    for (name, ty) in COLUMNS {
        match found(name) {
            None => missing.push(name),
            Some(column) if column.ty != ty => {
                problems.push(format!("column {name} is {}, not {ty}", column.ty));
            }
            Some(_) => {}
        }
    }
    let earlier = missing == [ADDED];
    if !missing.is_empty() && !earlier {
        problems.insert(0, format!("it has no column {}", missing.join(", ")));
    }
    if found("name").is_some_and(|name| !name.unique) {
        problems.push(
            "name is not its primary key (no unique index on name alone, which ON CONFLICT (name) needs)"
                .to_owned(),
        );
    }
    for column in columns {
        if column.required && !COLUMNS.iter().any(|(name, _)| *name == column.name) {
            problems.push(format!(
                "column {} is NOT NULL without a default, and the lock's inserts leave it out",
                column.name
            ));
        }
    }
    match (problems.is_empty(), earlier) {
        (false, _) => Shape::Other(problems.join("; ")),
        (true, true) => Shape::Earlier,
        (true, false) => Shape::Current,
    }
}

/// The table's shape, as the server has it now.
async fn shape(client: &Client, table: &TableName) -> Result<Shape, tokio_postgres::Error> {
    let rows = client.query_typed(SHAPE, &[typed(&table.quoted())]).await?;
    let kind: Option<String> = rows.first().map(|row| row.try_get(0)).transpose()?;
    let mut columns = Vec::with_capacity(rows.len());
    for row in &rows {
        // A table without columns has one row, of NULLs.
        if let Some(name) = row.try_get::<_, Option<String>>(1)? {
            columns.push(Column {
                name,
                ty: row.try_get(2)?,
                required: row.try_get(3)?,
                unique: row.try_get(4)?,
            });
        }
    }
    Ok(classify(kind.as_deref(), &columns))
}

/// Creates the table if it is missing, adds `extensions` to a lock table of the earlier version,
/// and refuses any other table of that name without touching it. A current lock table needs no
/// statement but the check, and so no right to create or alter.
pub(crate) async fn prepare(
    client: &Client,
    table: &TableName,
    context: &str,
) -> Result<(), LockError> {
    let t = table.quoted();
    let mut ran = 0;
    loop {
        let statement = match shape(client, table)
            .await
            .map_err(|err| map(context, err))?
        {
            Shape::Current => return Ok(()),
            Shape::Other(problems) => {
                return Err(LockError::Misconfigured {
                    backend: BACKEND,
                    message: format!(
                        "{context}: not a lock table of this or the earlier version: {problems}; it was left as it is: drop or rename it, or name another table (PostgresStoreBuilder::schema and ::table, or schema= and table= in a lock URL)"
                    ),
                });
            }
            _ if ran == 3 => {
                return Err(LockError::other(
                    BACKEND,
                    format!("{context}: the table is still not ready after three attempts"),
                ));
            }
            Shape::Earlier => format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {ADDED} text"),
            Shape::Missing => format!("CREATE TABLE IF NOT EXISTS {t} {TABLE_COLUMNS}"),
        };
        ran += 1;
        match client.batch_execute(&statement).await {
            Ok(()) => {}
            // `CREATE ... IF NOT EXISTS` is not safe against itself: when candidates create
            // the table at the same time, all but one may fail on the catalog's unique
            // indexes (23505 on pg_type) or find the table created meanwhile (42P07). The
            // other creator has committed by then: the next look finds its table.
            Err(err)
                if ran < 3
                    && err.code().is_some_and(|code| {
                        *code == SqlState::UNIQUE_VIOLATION
                            || *code == SqlState::DUPLICATE_TABLE
                            || *code == SqlState::DUPLICATE_OBJECT
                    }) => {}
            Err(err) => return Err(map(context, err)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current() -> Vec<Column> {
        COLUMNS
            .iter()
            .map(|(name, ty)| Column {
                name: (*name).to_owned(),
                ty: (*ty).to_owned(),
                required: false,
                unique: *name == "name",
            })
            .collect()
    }

    #[test]
    fn the_columns_are_the_ones_the_statement_creates() {
        let created: Vec<(String, String)> = TABLE_COLUMNS
            .trim_matches(|c| c == '(' || c == ')' || c == '\n')
            .split(",\n")
            .map(|line| {
                let mut words = line.split_whitespace();
                let name = words.next().expect("name").to_owned();
                let ty = match words.next().expect("type") {
                    "timestamptz" => "timestamp with time zone",
                    ty => ty,
                };
                (name, ty.to_owned())
            })
            .collect();
        let listed: Vec<(String, String)> = COLUMNS
            .iter()
            .map(|(name, ty)| ((*name).to_owned(), (*ty).to_owned()))
            .collect();
        assert_eq!(created, listed);
    }

    #[test]
    fn the_shipped_schema_is_the_one_the_code_creates() {
        let shipped = include_str!("../../../deploy/postgres/schema.sql");
        let statement: String = shipped
            .lines()
            .filter(|line| !line.starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(statement.trim().trim_end_matches(';'), SCHEMA);
        assert_eq!(
            format!(r#"CREATE TABLE IF NOT EXISTS "public"."leader_election" {TABLE_COLUMNS}"#),
            SCHEMA
        );
        assert_eq!(
            format!(
                r#"ALTER TABLE "public"."leader_election" ADD COLUMN IF NOT EXISTS {ADDED} text"#
            ),
            MIGRATION
        );
        let migration = include_str!("../../../deploy/postgres/migrate.sql");
        assert!(migration.contains(&format!("{MIGRATION};")), "{migration}");
    }

    #[test]
    fn a_lock_table_of_either_version_is_one() {
        assert_eq!(classify(None, &[]), Shape::Missing);
        assert_eq!(classify(Some("r"), &current()), Shape::Current);
        assert_eq!(classify(Some("p"), &current()), Shape::Current);
        let earlier: Vec<Column> = current().into_iter().filter(|c| c.name != ADDED).collect();
        assert_eq!(classify(Some("r"), &earlier), Shape::Earlier);
        let mut extra = current();
        extra.push(Column {
            name: "note".to_owned(),
            ty: "text".to_owned(),
            required: false,
            unique: false,
        });
        assert_eq!(classify(Some("r"), &extra), Shape::Current);
    }

    #[test]
    fn anything_else_is_refused_saying_why() {
        let refused =
            |kind: &str, columns: Vec<Column>, expected: &str| match classify(Some(kind), &columns)
            {
                Shape::Other(problems) => assert!(problems.contains(expected), "{problems}"),
                other => panic!("{expected}: {other:?}"),
            };
        refused("v", current(), "it is a view, not a table");
        refused("r", Vec::new(), "it has no column name, holder_identity");
        let mut earlier_of_other_types: Vec<Column> =
            current().into_iter().filter(|c| c.name != ADDED).collect();
        earlier_of_other_types[1].ty = "integer".to_owned();
        refused(
            "r",
            earlier_of_other_types,
            "column holder_identity is integer, not text",
        );
        let lacking: Vec<Column> = current()
            .into_iter()
            .filter(|c| c.name != ADDED && c.name != "version")
            .collect();
        refused("r", lacking, "it has no column version, extensions");
        let mut no_key = current();
        no_key[0].unique = false;
        refused("r", no_key, "name is not its primary key");
        let mut required = current();
        required.push(Column {
            name: "team".to_owned(),
            ty: "text".to_owned(),
            required: true,
            unique: false,
        });
        refused("r", required, "column team is NOT NULL without a default");
    }
}
