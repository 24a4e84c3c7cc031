//! Bad input against a real MySQL or MariaDB: each gives a clear typed error, the elector keeps
//! running and recovers once the fault is gone, and nothing panics or overwrites what it cannot
//! read.

mod common;

use std::time::Duration;

use common::{Running, admin_exec, one_connection_store, unique};
use leader_core::conformance::{self, record};
use leader_core::{LockError, ResourceLock};
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_test_support::held_lease::{
    assert_renewal_in_an_open_transaction_commits_nothing, renew,
};
use leader_test_support::secrets::assert_wrong_password;
use leader_test_support::unreadable;
use leader_test_support::{assert_acquired, assert_forbidden_saying, assert_unavailable_saying};

/// A store on `MYSQL_URL` as another user; its pool connects lazily.
async fn store_as(user: &str, password: &str) -> MysqlStore {
    let mut url = url::Url::parse(&common::mysql_url()).expect("MYSQL_URL");
    url.set_username(user).expect("user");
    url.set_password(Some(password)).expect("password");
    MysqlStore::builder(String::from(url))
        .build()
        .await
        .expect("the pool connects lazily")
}

/// A new user named after `prefix`, with password `pw` and `grants` on the default table.
async fn user_with(prefix: &str, grants: &str) -> String {
    let user = unique(prefix).replace('-', "_");
    admin_exec(&format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")).await;
    admin_exec(&format!(
        "GRANT {grants} ON `{}`.`leader_election` TO '{user}'@'%'",
        database()
    ))
    .await;
    user
}

fn database() -> String {
    url::Url::parse(&common::mysql_url())
        .expect("MYSQL_URL")
        .path()
        .trim_start_matches('/')
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_reported_and_the_elector_recovers_once_it_exists() {
    if common::admin().await.is_none() {
        return;
    }
    let table = unique("missing").replace('-', "_");
    let store = MysqlStore::builder(common::mysql_url())
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
    admin_exec(&format!("DROP TABLE `{table}`")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_rows_are_reported_never_overwritten_and_the_elector_recovers() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    for (garbage, expected) in [
        (
            "'x', -5, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), 1, NULL",
            "negative lease duration",
        ),
        (
            "'x', 5000, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), -3, NULL",
            "negative leader transitions",
        ),
        (
            "x'ff00', 5000, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), 1, NULL",
            "not UTF-8",
        ),
        (
            "'x', 5000, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), 1, '[1'",
            "not a JSON object",
        ),
    ] {
        let name = unique("garbage");
        admin
            .exec_drop(
                format!(
                    "INSERT INTO leader_election (name, holder_identity, lease_duration_ms, acquire_time, \
                     renew_time, leader_transitions, extensions, version, expires_at) \
                     VALUES (?, {garbage}, 7, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR)"
                ),
                (&name,),
            )
            .await
            .expect("write garbage");
        let mut elector = unreadable::reported_while_the_elector_waits(
            store.lock(&name, "a"),
            expected,
            expected,
        )
        .await;
        let version: Option<i64> = admin
            .exec_first(
                "SELECT version FROM leader_election WHERE name = ?",
                (&name,),
            )
            .await
            .expect("row");
        assert_eq!(
            version,
            Some(7),
            "{expected}: the garbage row was overwritten"
        );
        admin
            .exec_drop("DELETE FROM leader_election WHERE name = ?", (&name,))
            .await
            .expect("delete");
        assert_eq!(elector.wait_leading(Duration::from_secs(5)).await, 1);
        elector.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_update_rights_gets_a_clear_error_and_recovers_when_granted() {
    let Some(store) = common::store().await else {
        return;
    };
    let user = user_with("leader_ro", "SELECT, INSERT").await;
    let limited = store_as(&user, "pw").await;
    let name = unique("rights");
    // Someone else holds it, so that taking it over needs an UPDATE.
    let other = store.lock(&name, "other");
    let mut expired = record("other", 0);
    expired.lease_duration = Duration::from_millis(1);
    other.create(&expired).await.expect("create");
    let lock = limited.lock(&name, "a");
    tokio::time::sleep(Duration::from_millis(20)).await;
    // No UPDATE right.
    assert_forbidden_saying(lock.try_acquire(&record("a", 0)).await, &["grant"]);

    let mut elector = Running::start(lock);
    elector
        .stays_alive_without_leading(Duration::from_millis(1500))
        .await;
    admin_exec(&format!(
        "GRANT UPDATE ON `{}`.`leader_election` TO '{user}'@'%'",
        database()
    ))
    .await;
    elector.wait_leading(Duration::from_secs(5)).await;
    elector.stop().await;
    admin_exec(&format!("DROP USER '{user}'@'%'")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_a_clear_error_that_never_shows_the_password() {
    if common::admin().await.is_none() {
        return;
    }
    let user = unique("leader_pw").replace('-', "_");
    admin_exec(&format!(
        "CREATE USER '{user}'@'%' IDENTIFIED BY 'right-one'"
    ))
    .await;
    let store = store_as(&user, "wrong-secret").await;
    assert_wrong_password(store.lock("jobs", "a").get().await, "wrong-secret");
    assert!(!format!("{store:?}").contains("wrong-secret"), "{store:?}");
    admin_exec(&format!("DROP USER '{user}'@'%'")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_server_is_an_outage_and_the_elector_keeps_trying() {
    // A port nothing listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    let store = MysqlStore::builder(format!("mysql://u:secret@127.0.0.1:{port}/db"))
        .build()
        .await
        .expect("the pool connects lazily");
    let err = store.lock("jobs", "a").get().await.expect_err("no server");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(!err.to_string().contains("secret"), "{err}");
    let elector = Running::start(store.lock("jobs", "a"));
    elector
        .stays_alive_without_leading(Duration::from_millis(1500))
        .await;
    elector.stop().await;
}

#[tokio::test]
async fn invalid_settings_are_rejected_before_connecting() {
    for (url, table, expected) in [
        ("mysql://u:secret@h/db", "bad name", "invalid table name"),
        (
            "mysql://u:secret@h/db?no_such_option=1",
            "t",
            "invalid connection URL",
        ),
        ("not a url", "t", "invalid connection URL"),
    ] {
        let err = MysqlStore::builder(url)
            .table(table)
            .build()
            .await
            .expect_err(url);
        assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
        assert!(err.to_string().contains(expected), "{url}: {err}");
        assert!(!err.to_string().contains("secret"), "{err}");
    }
    let store = MysqlStore::connect("mysql://u@127.0.0.1:1/db")
        .await
        .expect("store");
    let err = store
        .lock("x".repeat(513), "a")
        .get()
        .await
        .expect_err("too long");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
}

/// A connection that another user of the pool returns in a transaction (autocommit off) is
/// reset by the pool before the lock gets it. One returned so with its reset turned off is found
/// by the lock's next statement on it: the write is not reported done (it was not committed),
/// the connection is closed, and the next attempt, on a new one, is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_left_in_a_transaction_commits_nothing_in_silence() {
    if common::admin().await.is_none() {
        return;
    }
    let store = one_connection_store().await;
    let lock = store.lock(unique("left-open"), "a");
    let created = lock.create(&record("a", 1)).await.expect("create");
    on_the_pooled_connection(&store, "SET autocommit = 0", true).await;
    // Renewed: the pool reset the connection, and autocommit is on again.
    let held = renew(&lock, &created).await;
    on_the_pooled_connection(&store, "SET autocommit = 0", false).await;
    let other = MysqlStore::connect(common::mysql_url())
        .await
        .expect("store");
    assert_renewal_in_an_open_transaction_commits_nothing(
        &lock,
        &held,
        &other.lock(lock.name(), "x"),
    )
    .await;
}

/// A connection the server answers as read-only (a replica, or a writer that a failover
/// demoted, still reached through the cluster's name) fails each write as an outage that says
/// so, and is closed instead of going back to the pool, so that the next request connects
/// again. The pool's one connection is made read-only as a session, which the pool keeps (no
/// reset): only a new connection takes writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_answered_read_only_is_closed_and_replaced() {
    if common::admin().await.is_none() {
        return;
    }
    let store = one_connection_store().await;
    let lock = store.lock(unique("read-only"), "a");
    on_the_pooled_connection(&store, "SET SESSION TRANSACTION READ ONLY", false).await;
    // Reads pass: the connection stays in use until a write is refused.
    assert!(lock.get().await.expect("a read").is_none());
    assert_unavailable_saying(
        lock.try_acquire(&record("a", 0)).await,
        &["READ ONLY", "error 1792", "connection is given up"],
    );
    assert_acquired(lock.try_acquire(&record("a", 0)).await);
}

/// Runs `sql` on `store`'s pooled connection as another user of the pool would, who returns
/// it with the pool's reset or without.
async fn on_the_pooled_connection(store: &MysqlStore, sql: &str, reset: bool) {
    let mut conn = store.pool().get_conn().await.expect("pooled");
    conn.query_drop(sql).await.expect(sql);
    conn.reset_connection(reset);
    drop(conn);
}

/// The `GET_LOCK` lock's session, answered as read-only, is ended (its user-level lock goes
/// with it) and the next request opens another. The server runs `init_connect` for each new
/// session of a user without SUPER; while it is set here, it makes this test's user's new
/// sessions read-only and leaves every other user's as they are. It is put back as it was when
/// the test ends, passed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_lock_session_answered_read_only_is_ended_and_replaced() {
    if common::store().await.is_none() {
        return;
    }
    let user = user_with("leader_standby", "SELECT, INSERT, UPDATE").await;
    let mut admin = common::admin().await.expect("server");
    // MySQL 8 and MariaDB 11.1 name the setting transaction_read_only; MariaDB before 11.1,
    // tx_read_only.
    let setting = match admin
        .query_drop("SELECT @@SESSION.transaction_read_only")
        .await
    {
        Ok(()) => "transaction_read_only",
        Err(_) => "tx_read_only",
    };
    let before: Option<String> = admin
        .query_first("SELECT @@GLOBAL.init_connect")
        .await
        .expect("init_connect");
    let restore = InitConnect(before);
    admin
        .exec_drop(
            "SET GLOBAL init_connect = ?",
            (format!(
                "SET SESSION {setting} = (CURRENT_USER() = '{user}@%')"
            ),),
        )
        .await
        .expect("read-only sessions for the user");
    let lock = store_as(&user, "pw")
        .await
        .named_lock(unique("read-only-named"), "a");
    let first = lock.try_acquire(&record("a", 0)).await;
    drop(restore);
    assert_unavailable_saying(first, &["READ ONLY", "connection is given up"]);
    assert_acquired(lock.try_acquire(&record("a", 0)).await);
    lock.close().await;
    admin_exec(&format!("DROP USER '{user}'@'%'")).await;
}

/// The server's `init_connect` as it was, put back when dropped.
struct InitConnect(Option<String>);

impl Drop for InitConnect {
    fn drop(&mut self) {
        let before = self.0.take().unwrap_or_default();
        // Dropped inside the test's runtime, which cannot wait here: on a runtime of its own.
        let restored = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                let mut admin = common::admin().await.expect("server");
                admin
                    .exec_drop("SET GLOBAL init_connect = ?", (before,))
                    .await
            })
        })
        .join();
        if !matches!(restored, Ok(Ok(()))) && !std::thread::panicking() {
            panic!("init_connect was not put back: {restored:?}");
        }
    }
}
