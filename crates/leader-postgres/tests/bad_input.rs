//! Bad input against a real Postgres: each gives a clear typed error, the elector keeps running
//! and recovers once the fault is gone, and nothing panics or overwrites what it cannot read.

mod common;

use std::time::Duration;

use common::{Running, conn_as, query_value, unique};
use leader_core::backend::Renewal;
use leader_core::conformance::{self, record};
use leader_core::{LockError, LockSet, ResourceLock, Version};
use leader_postgres::PostgresStore;
use leader_test_support::secrets::assert_wrong_password;
use leader_test_support::unreadable;
use leader_test_support::{
    assert_acquired, assert_forbidden_saying, assert_misconfigured_saying,
    assert_unavailable_saying,
};

/// Candidates that start together on a fresh database all create the table at once: every one
/// of them gets a store (Postgres's `CREATE TABLE IF NOT EXISTS` races on its own catalog).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn candidates_creating_the_table_at_once_all_succeed() {
    let Some(admin) = common::admin().await else {
        return;
    };
    for _ in 0..5 {
        let table = unique("together").replace('-', "_");
        let builds = (0..8).map(|_| {
            PostgresStore::builder(common::database_url())
                .table(&table)
                .create_table(true)
                .build()
        });
        for built in futures_util::future::join_all(builds).await {
            built.expect("every candidate gets a store");
        }
        drop_table(&admin, &table).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_reported_and_the_elector_recovers_once_it_exists() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let table = unique("missing").replace('-', "_");
    let store = PostgresStore::builder(common::database_url())
        .table(&table)
        .build()
        .await
        .expect("store without auto-create");
    conformance::missing_storage_is_reported_until_it_exists(
        store.lock("jobs", "a"),
        &[&table, "create_table"],
        async { store.create_table().await.expect("create the table") },
    )
    .await;
    drop_table(&admin, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_rows_are_reported_never_overwritten_and_the_elector_recovers() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await.expect("server");
    for (garbage, expected) in [
        ("-5, now(), now(), 1", "negative lease duration"),
        ("5000, 'infinity', 'infinity', 1", "acquire_time"),
        ("5000, now(), now(), -3", "negative leader transitions"),
    ] {
        let name = unique("garbage");
        admin
            .execute(
                &format!(
                    "INSERT INTO public.leader_election (name, holder_identity, lease_duration_ms, acquire_time, \
                     renew_time, leader_transitions, version, expires_at) VALUES ($1, 'x', {garbage}, 7, now() - interval '1 hour')"
                ),
                &[&name],
            )
            .await
            .expect("write garbage");
        let mut elector = unreadable::reported_while_the_elector_waits(
            store.lock(&name, "a"),
            expected,
            expected,
        )
        .await;
        let version: i64 = query_value(
            &admin,
            "SELECT version FROM public.leader_election WHERE name = $1",
            &[&name],
        )
        .await;
        assert_eq!(version, 7, "{expected}: the garbage row was overwritten");
        admin
            .execute(
                "DELETE FROM public.leader_election WHERE name = $1",
                &[&name],
            )
            .await
            .expect("delete");
        assert_eq!(elector.wait_leading(Duration::from_secs(5)).await, 1);
        elector.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_update_rights_gets_a_clear_error_and_recovers_when_granted() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let role = table_and_role(&admin, "leader_ro", "SELECT, INSERT", "").await;
    let store = store_as(&role).await;
    let lock = store.lock("jobs", "a");
    assert_forbidden_saying(
        lock.try_acquire(&record("a", 0)).await,
        &["permission denied", "UPDATE"],
    );
    // A shard set's renewals, refused as one statement, are a refusal for each record: not an
    // outage to retry.
    let renewals: Vec<Renewal> = ["jobs-0", "jobs-1"]
        .into_iter()
        .map(|key| Renewal {
            key: key.to_owned(),
            version: Version::from(1_i64),
            record: record("a", 1),
        })
        .collect();
    for result in store.lock_set("a").renew_many(&renewals).await {
        let err = result.expect_err("no UPDATE right");
        assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    }

    let mut elector = Running::start(lock);
    elector
        .stays_alive_without_leading(Duration::from_millis(1500))
        .await;
    admin
        .batch_execute(&format!("GRANT UPDATE ON public.{role} TO {role}"))
        .await
        .expect("grant");
    elector.wait_leading(Duration::from_secs(5)).await;
    elector.stop().await;
    drop(store);
    drop_table_and_role(&admin, &role).await;
}

/// A server that takes no writes (a standby, or a primary that a failover demoted or fenced,
/// still reached through its old name): each write fails as an outage that says so and how to
/// choose the primary, and the connection that answered is closed, so that the next request
/// connects again. The role's default makes its new sessions read-only until it is reset, and
/// the sessions opened before stay read-only, as connections to a demoted primary do: only a
/// new connection reaches "the primary".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_a_read_only_server_answered_are_closed_and_replaced() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let role = table_and_role(
        &admin,
        "leader_standby",
        "SELECT, INSERT, UPDATE",
        "SET default_transaction_read_only = on",
    )
    .await;
    let store = store_as(&role).await;
    let table_lock = store.lock("jobs", "a");
    let advisory = store.advisory_lock("jobs-advisory", "a");
    let locks: [&dyn ResourceLock; 2] = [&table_lock, &advisory];
    let says = [
        "read-only transaction",
        "25006",
        "target_session_attrs=read-write",
    ];
    for lock in locks {
        // Reads pass: the connection stays in use until a write is refused.
        assert!(lock.get().await.expect("a read").is_none());
        assert_unavailable_saying(lock.try_acquire(&record("a", 0)).await, &says);
    }
    admin
        .batch_execute(&format!(
            "ALTER ROLE {role} RESET default_transaction_read_only"
        ))
        .await
        .expect("the primary");
    for lock in locks {
        assert_acquired(lock.try_acquire(&record("a", 0)).await);
    }
    drop((table_lock, advisory, store));
    drop_table_and_role(&admin, &role).await;
}

/// Drops `table` (in schema `public`), made by the test.
async fn drop_table(admin: &tokio_postgres::Client, table: &str) {
    admin
        .batch_execute(&format!("DROP TABLE public.\"{table}\""))
        .await
        .expect("drop");
}

/// A lock table of its own and a role of the same name that may log in (with password `pw`)
/// and has `grants` on it; `alter`, if not empty, is an `ALTER ROLE` of it.
async fn table_and_role(
    admin: &tokio_postgres::Client,
    prefix: &str,
    grants: &str,
    alter: &str,
) -> String {
    let role = unique(prefix).replace('-', "_");
    PostgresStore::builder(common::database_url())
        .table(&role)
        .create_table(true)
        .build()
        .await
        .expect("create table");
    let mut sql = format!(
        "CREATE ROLE {role} LOGIN PASSWORD 'pw'; GRANT USAGE ON SCHEMA public TO {role}; \
         GRANT {grants} ON public.{role} TO {role};"
    );
    if !alter.is_empty() {
        sql.push_str(&format!("ALTER ROLE {role} {alter};"));
    }
    admin.batch_execute(&sql).await.expect("role");
    role
}

/// A store on `role`'s table, as `role`.
async fn store_as(role: &str) -> PostgresStore {
    PostgresStore::builder(conn_as(role, "pw"))
        .table(role)
        .build()
        .await
        .expect("store")
}

async fn drop_table_and_role(admin: &tokio_postgres::Client, role: &str) {
    admin
        .batch_execute(&format!(
            "DROP TABLE public.{role}; DROP OWNED BY {role}; DROP ROLE {role};"
        ))
        .await
        .expect("cleanup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_a_clear_error_that_never_shows_the_password() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let rule: i64 = query_value(
        &admin,
        "SELECT count(*) FROM pg_hba_file_rules WHERE 'leader_password_test' = ANY(user_name) \
         AND auth_method IN ('scram-sha-256', 'md5', 'password')",
        &[],
    )
    .await;
    if rule == 0 {
        leader_test_support::skip_or_fail!(
            "the server does not ask role leader_password_test for a password (scripts/test adds that rule)"
        );
    }
    // The table first: the grant below names it, and nothing else may have created it yet.
    PostgresStore::builder(common::database_url())
        .create_table(true)
        .build()
        .await
        .expect("table");
    admin
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE leader_password_test LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
             ALTER ROLE leader_password_test PASSWORD 'the-right-one'; \
             GRANT SELECT, INSERT, UPDATE ON public.leader_election TO leader_password_test;",
        )
        .await
        .expect("role");
    let secret = "wr0ng-Pa55word";
    for conn in [conn_as("leader_password_test", secret), {
        let config: tokio_postgres::Config = conn_as("x", "y").parse().expect("config");
        let host = match &config.get_hosts()[0] {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            _ => unreachable!("tcp"),
        };
        format!(
            "postgres://leader_password_test:{secret}@{host}:{}/postgres",
            config.get_ports()[0]
        )
    }] {
        let store = PostgresStore::connect(&conn)
            .await
            .expect("a lazy pool connects on use");
        assert!(
            !format!("{store:?}").contains(secret),
            "Debug shows the password"
        );
        assert_wrong_password(store.lock("jobs", "a").get().await, secret);
    }

    // The elector keeps trying, and recovers when the password becomes right.
    let store = PostgresStore::connect(conn_as("leader_password_test", secret))
        .await
        .expect("store");
    let mut elector = Running::start(store.lock(unique("password"), "a"));
    elector
        .stays_alive_without_leading(Duration::from_millis(1500))
        .await;
    admin
        .batch_execute(&format!(
            "ALTER ROLE leader_password_test PASSWORD '{secret}'"
        ))
        .await
        .expect("alter");
    elector.wait_leading(Duration::from_secs(5)).await;
    elector.stop().await;
    admin
        .batch_execute("ALTER ROLE leader_password_test PASSWORD 'the-right-one'")
        .await
        .expect("reset");
}

#[tokio::test]
async fn invalid_settings_are_rejected_before_connecting() {
    let bad_table_name = PostgresStore::builder("postgres://u:secret@h/db")
        .table("bad name; drop table x")
        .build()
        .await;
    assert_misconfigured_saying(bad_table_name, &["invalid table name"]);
    let err = PostgresStore::connect("postgres://u:secret@h:notaport/db")
        .await
        .expect_err("bad URL");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("secret"), "{err:?}");
}

/// A table made by an earlier version (no `extensions` column): a role that cannot alter it is
/// told what to run, once, clearly; `create_table` (the owner's) adds the column, and the
/// record as stored is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_of_an_earlier_version_is_migrated_or_explained() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let table = unique("earlier").replace('-', "_");
    let old_layout = leader_postgres::SCHEMA
        .replace(
            r#""public"."leader_election""#,
            &format!(r#""public"."{table}""#),
        )
        .replace(",\n    extensions         text", "");
    assert!(!old_layout.contains("extensions"), "{old_layout}");
    admin.batch_execute(&old_layout).await.expect("old table");
    admin
        .batch_execute(&format!(
            "INSERT INTO {table} VALUES ('jobs', 'a', 15000, now(), now(), 7, NULL, NULL, 1, now())"
        ))
        .await
        .expect("a row written by the earlier version");
    let store = PostgresStore::builder(common::database_url())
        .table(&table)
        .build()
        .await
        .expect("store without auto-create");
    let err = store.lock("jobs", "b").get().await.expect_err("no column");
    match &err {
        LockError::Misconfigured { message, .. } => {
            assert!(message.contains("MIGRATION"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    store.create_table().await.expect("the owner migrates");
    let kept = store
        .lock("jobs", "b")
        .get()
        .await
        .expect("readable")
        .expect("the row");
    assert_eq!(kept.record.holder_identity, "a");
    assert_eq!(kept.record.leader_transitions, 7);
    assert!(kept.record.extensions.is_empty());
    drop_table(&admin, &table).await;
}

/// S15: connections on which a crash can undo a commit the server acknowledged
/// (`synchronous_commit = off`, here from the URL's `options`, as from an `ALTER ROLE` or
/// `ALTER DATABASE ... SET`) are refused at `check_lease`, by both locks and a shard set's,
/// naming the setting; the server's defaults pass.
#[tokio::test]
async fn commits_a_crash_can_undo_are_refused() {
    let Some(store) = common::store().await else {
        return;
    };
    let lease = Duration::from_secs(15);
    let name = unique("durable");
    store
        .lock(&name, "a")
        .check_lease(lease)
        .await
        .expect("durable");
    let url = common::database_url();
    let glue = if url.contains('?') { '&' } else { '?' };
    let lax = PostgresStore::builder(format!("{url}{glue}options=-c%20synchronous_commit%3Doff"))
        .build()
        .await
        .expect("store");
    let words = ["synchronous_commit = off", "ALTER ROLE"];
    assert_misconfigured_saying(lax.lock(&name, "a").check_lease(lease).await, &words);
    assert_misconfigured_saying(
        lax.advisory_lock(&name, "a").check_lease(lease).await,
        &words,
    );
    let set = lax.lock_set("a");
    assert_misconfigured_saying(set.lock(&name).check_lease(lease).await, &words);
}

/// S15 under a running lock: `synchronous_commit` turned off for the lock's role (an `ALTER
/// ROLE`, which its next connections get) after the candidates started is refused at the next
/// term's start: the lease taken is released at once, and the candidate never leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_made_undoable_under_running_locks_end_the_next_term_at_its_start() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let role = table_and_role(&admin, "lax", "SELECT, INSERT, UPDATE", "").await;
    let store = store_as(&role).await;
    let name = unique("undoable");
    let (first, _) = leader_test_support::started_leading(store.lock(&name, "a")).await;
    let second = Running::start(store.lock(&name, "b"));
    // Two statements: a batch is one transaction, and a session started after the terminate
    // but before that transaction's commit would keep the old setting.
    let change = async {
        for statement in [
            format!("ALTER ROLE {role} SET synchronous_commit = off"),
            format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
            ),
        ] {
            admin.batch_execute(&statement).await.expect("alter role");
        }
    };
    let lock = store.lock(&name, "b");
    leader_test_support::assert_next_term_refused_and_released(first, second, change, lock).await;
    drop_table_and_role(&admin, &role).await;
}
