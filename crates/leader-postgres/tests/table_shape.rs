//! The start-up schema step against a real Postgres: a table of the configured name that is not
//! a lock table is refused and left exactly as it was (S8, S15); a lock table of the earlier
//! version (without `extensions`) is upgraded, and a current one is used as it is. A later
//! release's column is kept by every write of this one (S16).

mod common;

use common::unique;
use leader_core::conformance::record;
use leader_core::{LockError, LockTarget, ResourceLock};
use leader_postgres::{LockUrl, PostgresStore};
use leader_test_support::later_column::{LATER, LaterColumn, LaterTable};
use tokio_postgres::Client;

/// A schema of its own for one test, so that each table can be called `leader_election`.
async fn fresh_schema(admin: &Client, prefix: &str) -> String {
    let schema = unique(prefix).replace('-', "_");
    admin
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await
        .expect("schema");
    schema
}

/// Drops `schema` and everything in it.
async fn drop_schema(admin: &Client, schema: &str) {
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("drop");
}

/// The table's columns and their types, in order.
async fn columns(admin: &Client, schema: &str, table: &str) -> Vec<(String, String)> {
    admin
        .query(
            "SELECT column_name::text, data_type::text FROM information_schema.columns \
             WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
            &[&schema, &table],
        )
        .await
        .expect("columns")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Everything the table holds, as text.
async fn rows(admin: &Client, schema: &str, table: &str) -> Vec<String> {
    admin
        .query(
            &format!("SELECT t::text FROM {schema}.{table} t ORDER BY 1"),
            &[],
        )
        .await
        .expect("rows")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// The lock URL of `schema.leader_election` on the test server, if `DATABASE_URL` is a URL.
fn lock_url(schema: &str, advisory: bool) -> Option<LockUrl> {
    let base = common::database_url();
    if !base.starts_with("postgres") {
        return None;
    }
    let separator = if base.contains('?') { '&' } else { '?' };
    let advisory = if advisory { "&advisory=true" } else { "" };
    Some(
        LockUrl::parse(&format!(
            "{base}{separator}schema={schema}&table=leader_election{advisory}"
        ))
        .expect("lock URL"),
    )
}

/// The current lock table's statement, for `schema.leader_election`.
fn current_layout(schema: &str) -> String {
    leader_postgres::SCHEMA.replace(r#""public"."#, &format!(r#""{schema}"."#))
}

/// The statement of the earlier version, without `extensions`, for `schema.leader_election`.
fn earlier_layout(schema: &str) -> String {
    let layout = current_layout(schema).replace(",\n    extensions         text", "");
    assert!(!layout.contains("extensions"), "{layout}");
    layout
}

/// Statements that make `schema.leader_election`.
type Layout = Box<dyn Fn(&str) -> String>;

fn assert_refused(err: &LockError, schema: &str, what: &str, expected: &str) {
    match err {
        LockError::Misconfigured { message, .. } => {
            assert!(
                message.contains(&format!("{schema}.leader_election")),
                "{what}: the table is not named: {message}"
            );
            assert!(message.contains(expected), "{what}: {expected}: {message}");
            assert!(!message.contains('\n'), "{what}: not one line: {message}");
        }
        other => panic!("{what}: not Misconfigured: {other:?}"),
    }
}

/// Tables of the configured name that are not lock tables, each with a row: every way of
/// starting (the builder's `create_table(true)`, `create_table`, the lock URL's table lock,
/// advisory lock and shard set) refuses it in one line naming the table and what is wrong, and
/// the table keeps its columns and rows exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_that_is_not_a_lock_table_is_refused_and_left_as_it_was() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let earlier_with = |schema: &str, from: &str, to: &str| {
        let layout = earlier_layout(schema);
        assert!(layout.contains(from), "{from}");
        layout.replace(from, to)
    };
    // What the table is, its statements for a schema, what the refusal says, and a row for it.
    let cases: Vec<(&str, Layout, &str, &str)> = vec![
        (
            "an unrelated table",
            Box::new(|schema| {
                format!(
                    "CREATE TABLE {schema}.leader_election (id serial PRIMARY KEY, payload jsonb, \
                     created timestamptz DEFAULT now()); \
                     INSERT INTO {schema}.leader_election (payload) VALUES ('{{\"keep\": 1}}')"
                )
            }),
            "it has no column name, holder_identity",
            "",
        ),
        (
            "the lock's column names with other types, and no extensions",
            Box::new(move |schema| {
                earlier_with(
                    schema,
                    "holder_identity    text        NOT NULL DEFAULT ''",
                    "holder_identity    integer     NOT NULL DEFAULT 0",
                )
                .replace(
                    "version            bigint      NOT NULL",
                    "version            text        NOT NULL",
                )
            }),
            "holder_identity is integer",
            "('jobs', 1, 15000, now(), now(), 7, NULL, NULL, 'v1', now())",
        ),
        (
            "an earlier lock table but for a missing column",
            Box::new(move |schema| {
                earlier_with(schema, "    lease_duration_ms  bigint      NOT NULL,\n", "")
            }),
            "no column lease_duration_ms",
            "('jobs', 'a', now(), now(), 7, NULL, NULL, 1, now())",
        ),
        (
            "a lock table whose extensions are of another type",
            Box::new(|schema| {
                current_layout(schema)
                    .replace("extensions         text", "extensions         jsonb")
            }),
            "extensions is jsonb",
            "('jobs', 'a', 15000, now(), now(), 7, NULL, NULL, 1, now(), '{}')",
        ),
        (
            "a lock table without a unique name",
            Box::new(|schema| current_layout(schema).replace(" PRIMARY KEY", "")),
            "unique",
            "('jobs', 'a', 15000, now(), now(), 7, NULL, NULL, 1, now(), NULL)",
        ),
        (
            "a lock table with a required column of the user's",
            Box::new(|schema| {
                current_layout(schema).replace(
                    "extensions         text",
                    "extensions         text,\n    owner_team text NOT NULL",
                )
            }),
            "owner_team",
            "('jobs', 'a', 15000, now(), now(), 7, NULL, NULL, 1, now(), NULL, 'ops')",
        ),
        (
            "a view",
            Box::new(|schema| {
                format!(
                    "CREATE TABLE {schema}.base (x int); INSERT INTO {schema}.base VALUES (1); \
                     CREATE VIEW {schema}.leader_election AS SELECT x FROM {schema}.base"
                )
            }),
            "view",
            "",
        ),
    ];
    for (what, create, expected, row) in cases {
        let schema = fresh_schema(&admin, "foreign").await;
        admin
            .batch_execute(&create(&schema))
            .await
            .unwrap_or_else(|err| panic!("{what}: {err}"));
        if !row.is_empty() {
            admin
                .batch_execute(&format!(
                    "INSERT INTO {schema}.leader_election VALUES {row}"
                ))
                .await
                .unwrap_or_else(|err| panic!("{what}: {err}"));
        }
        let before = columns(&admin, &schema, "leader_election").await;
        let rows_before = rows(&admin, &schema, "leader_election").await;
        assert!(!before.is_empty(), "{what}");

        let err = creating_store(common::database_url(), &schema)
            .await
            .expect_err(what);
        assert_refused(&err, &schema, what, expected);
        let store = PostgresStore::builder(common::database_url())
            .schema(&schema)
            .build()
            .await
            .expect("a store that creates nothing");
        let err = store.create_table().await.expect_err(what);
        assert_refused(&err, &schema, what, expected);
        for advisory in [false, true] {
            if let Some(url) = lock_url(&schema, advisory) {
                let err = url.open("jobs", "b").await.expect_err(what);
                assert_refused(&err, &schema, what, expected);
                if !advisory {
                    let err = url.open_set("shards", "b").await.expect_err(what);
                    assert_refused(&err, &schema, what, expected);
                }
            }
        }

        assert_eq!(
            columns(&admin, &schema, "leader_election").await,
            before,
            "{what}: the columns changed"
        );
        assert_eq!(
            rows(&admin, &schema, "leader_election").await,
            rows_before,
            "{what}: the rows changed"
        );
        drop_schema(&admin, &schema).await;
    }
}

/// A lock table made by the earlier version, with a row it wrote: the start-up step adds
/// `extensions` and nothing else, the row is kept, and the table, advisory and shard-set locks
/// work on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_table_of_the_earlier_version_is_upgraded_and_works() {
    let Some(admin) = common::admin().await else {
        return;
    };
    for via_url in [false, true] {
        let schema = fresh_schema(&admin, "earlier").await;
        admin
            .batch_execute(&earlier_layout(&schema))
            .await
            .expect("the earlier table");
        admin
            .batch_execute(&format!(
                "INSERT INTO {schema}.leader_election \
                 VALUES ('jobs', 'a', 15000, now(), now(), 7, NULL, NULL, 1, now() - interval '1 second')"
            ))
            .await
            .expect("a row the earlier version wrote");
        let before = columns(&admin, &schema, "leader_election").await;
        assert!(!before.iter().any(|(name, _)| name == "extensions"));

        let store = PostgresStore::builder(common::database_url())
            .schema(&schema)
            .build()
            .await
            .expect("store");
        let lock: Box<dyn ResourceLock> = match lock_url(&schema, false) {
            Some(url) if via_url => url.open("jobs", "b").await.expect("opened and upgraded"),
            _ => {
                store.create_table().await.expect("upgraded");
                Box::new(store.lock("jobs", "b"))
            }
        };
        let mut after = before.clone();
        after.push(("extensions".to_owned(), "text".to_owned()));
        assert_eq!(columns(&admin, &schema, "leader_election").await, after);
        store.create_table().await.expect("a second start");
        assert_eq!(columns(&admin, &schema, "leader_election").await, after);

        let kept = lock.get().await.expect("readable").expect("the row");
        assert_eq!(kept.record.holder_identity, "a");
        assert_eq!(kept.record.leader_transitions, 7);
        assert!(kept.record.extensions.is_empty());
        let acquired = lock
            .try_acquire(&record("b", 0))
            .await
            .expect("the expired lease is taken");
        assert!(
            matches!(acquired, Some(leader_core::Acquisition::Acquired(_))),
            "{acquired:?}"
        );
        works(&store).await;
        drop_schema(&admin, &schema).await;
    }
}

/// A current lock table is used as it is: no statement alters it, so a role with only
/// `SELECT, INSERT, UPDATE` (no right to create or alter) starts on it too; a nullable column
/// the user added is no obstacle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_current_lock_table_works_as_it_is() {
    let Some(admin) = common::admin().await else {
        return;
    };
    for extra in ["", ",\n    note text"] {
        let schema = fresh_schema(&admin, "current").await;
        let layout = current_layout(&schema).replace(
            "extensions         text",
            &format!("extensions         text{extra}"),
        );
        admin.batch_execute(&layout).await.expect("the table");
        let before = columns(&admin, &schema, "leader_election").await;

        let store = creating_store(common::database_url(), &schema)
            .await
            .expect("a current table");
        assert_eq!(columns(&admin, &schema, "leader_election").await, before);
        works(&store).await;
        if let Some(url) = lock_url(&schema, true) {
            let lock = url.open("advisory-jobs", "c").await.expect("opened");
            lock.get().await.expect("read");
        }

        let role = unique("leader_user").replace('-', "_");
        admin
            .batch_execute(&format!(
                "CREATE ROLE {role} LOGIN PASSWORD 'pw'; GRANT USAGE ON SCHEMA {schema} TO {role}; \
                 GRANT SELECT, INSERT, UPDATE ON {schema}.leader_election TO {role};"
            ))
            .await
            .expect("role");
        let least = creating_store(common::conn_as(&role, "pw"), &schema)
            .await
            .expect("a role that may not create or alter starts on a current table");
        works(&least).await;
        assert_eq!(columns(&admin, &schema, "leader_election").await, before);
        drop(least);
        admin
            .batch_execute(&format!(
                "DROP SCHEMA {schema} CASCADE; DROP OWNED BY {role}; DROP ROLE {role};"
            ))
            .await
            .expect("drop");
    }
}

/// The current lock table plus a nullable column this release does not know, as a later
/// release's migration would add it.
fn later_layout(schema: &str) -> String {
    let layout = current_layout(schema).replace(
        "extensions         text",
        "extensions         text,\n    holder_release     text",
    );
    assert!(layout.contains("holder_release"), "{layout}");
    layout
}

/// `schema.leader_election` with a later release's column, through an admin connection.
struct LaterTableOf<'a> {
    admin: &'a Client,
    schema: &'a str,
}

impl LaterTable for LaterTableOf<'_> {
    async fn write(&self, name: &str) {
        self.admin
            .execute(
                &format!(
                    "INSERT INTO {}.leader_election (name, holder_identity, lease_duration_ms, \
                     acquire_time, renew_time, leader_transitions, version, expires_at, \
                     holder_release) VALUES ($1, '', 15000, now(), now(), 3, 1, now(), $2)",
                    self.schema
                ),
                &[&name, &LATER],
            )
            .await
            .expect("a later release's record");
    }

    async fn column(&self, name: &str) -> Result<Option<String>, String> {
        let row = self
            .admin
            .query_one(
                &format!(
                    "SELECT holder_release FROM {}.leader_election WHERE name = $1",
                    self.schema
                ),
                &[&name],
            )
            .await
            .map_err(|err| err.to_string())?;
        Ok(row.get(0))
    }
}

/// A lock table with a later release's column, holding a value that release wrote: every write
/// this release makes (the table lock's, the advisory lock's and a shard set's batched renewals)
/// leaves the column as it was, and `get` and `get_many` read the record beside it (S16).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_release_s_column_is_kept_by_every_write() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let schema = fresh_schema(&admin, "later").await;
    admin
        .batch_execute(&later_layout(&schema))
        .await
        .expect("the table");
    let before = columns(&admin, &schema, "leader_election").await;
    let store = creating_store(common::database_url(), &schema)
        .await
        .expect("a lock table with a later release's column");
    let later = LaterColumn {
        table: LaterTableOf {
            admin: &admin,
            schema: &schema,
        },
        reader: store.lock_set("reader"),
    };

    later
        .every_write("jobs", &store.lock("jobs", "a"), &store.lock("jobs", "b"))
        .await;
    later
        .every_write(
            "advisory-jobs",
            &store.advisory_lock("advisory-jobs", "a"),
            &store.advisory_lock("advisory-jobs", "b"),
        )
        .await;
    later.every_shard_write(&store.lock_set("m")).await;

    assert_eq!(columns(&admin, &schema, "leader_election").await, before);
    drop_schema(&admin, &schema).await;
}

/// A store on `schema` that creates its lock table when it is missing, connected by `conn`.
async fn creating_store(conn: String, schema: &str) -> Result<PostgresStore, LockError> {
    PostgresStore::builder(conn)
        .schema(schema)
        .create_table(true)
        .build()
        .await
}

/// `lock` (`what`) takes its fresh record.
async fn takes_a_fresh_record(lock: &dyn ResourceLock, what: &str) {
    assert!(
        matches!(
            lock.try_acquire(&record("w", 0)).await.expect(what),
            Some(leader_core::Acquisition::Acquired(_))
        ),
        "{what}"
    );
}

/// The table lock, the advisory lock and a shard set each take a fresh record.
async fn works(store: &PostgresStore) {
    let name = unique("works");
    takes_a_fresh_record(&store.lock(format!("{name}-table"), "w"), "table lock").await;
    takes_a_fresh_record(
        &store.advisory_lock(format!("{name}-advisory"), "w"),
        "advisory lock",
    )
    .await;
    let set = store.lock_set("w");
    let keys = [format!("{name}-0"), format!("{name}-1")];
    for read in leader_core::LockSet::get_many(&set, &keys).await {
        assert!(read.expect("shard set").is_none());
    }
}
