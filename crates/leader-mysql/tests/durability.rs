//! A server on which a crash can undo a commit it acknowledged (`innodb_flush_log_at_trx_commit`
//! 0 or 2) is refused (S15): before an elector runs, and at a term's start when the setting
//! changes under running locks (`SET GLOBAL`). A MariaDB of the test's own, since the setting is
//! global (the shared server's stays as it is). Skipped without `mariadbd`, a failure under
//! `CI=true`.

mod common;

use std::time::Duration;

use common::private::{PrivateServer, server_dir};
use common::{LEASE, RETRY, Running};
use leader_core::ResourceLock;
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_test_support::{assert_misconfigured_saying, started_leading};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commits_a_crash_can_undo_are_refused_before_and_under_running_locks() {
    let Some(mut server) = PrivateServer::start(server_dir("durability"), &[]) else {
        return;
    };
    let mut admin = server.admin("").await;
    admin
        .query_drop("CREATE DATABASE leader")
        .await
        .expect("database");
    let store = MysqlStore::builder(server.url("root", "leader", ""))
        .create_table(true)
        .build()
        .await
        .expect("store");
    let lease = Duration::from_secs(15);
    store
        .lock("checked", "a")
        .check_lease(lease)
        .await
        .expect("durable by default");

    let (first, _) = started_leading(store.lock("jobs", "a")).await;
    let second = Running::start(store.lock("jobs", "b"));
    // Past the second that a check that passed stands for.
    tokio::time::sleep(Duration::from_secs(2)).await;
    admin
        .query_drop("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
        .await
        .expect("set");
    first.stop().await;
    tokio::time::sleep(LEASE + RETRY * 4).await;
    assert_eq!(
        second.leading_token(),
        None,
        "a term started on undoable commits"
    );
    let record = store
        .lock("jobs", "b")
        .get()
        .await
        .expect("get")
        .expect("the record");
    assert!(
        record.record.is_free(),
        "the refused term was released: {record:?}"
    );
    second.stop().await;

    let words = ["innodb_flush_log_at_trx_commit = 2", "set it to 1"];
    assert_misconfigured_saying(store.lock("checked", "a").check_lease(lease).await, &words);
    assert_misconfigured_saying(
        store.named_lock("checked", "a").check_lease(lease).await,
        &words,
    );
}
