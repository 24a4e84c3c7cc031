//! A server on which a crash can undo a commit it acknowledged (`innodb_flush_log_at_trx_commit`
//! 0 or 2) is refused (S15): before an elector runs, and at a term's start when the setting
//! changes under running locks (`SET GLOBAL`). A MariaDB of the test's own, since the setting is
//! global (the shared server's stays as it is). And a server whose default turns autocommit
//! off still commits the locks' writes. Skipped without `mariadbd`, a failure under `CI=true`.

mod common;

use std::time::Duration;

use common::Running;
use common::private::PrivateServer;
use leader_core::ResourceLock;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_test_support::{
    assert_misconfigured_saying, assert_next_term_refused_and_released, started_leading,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commits_a_crash_can_undo_are_refused_before_and_under_running_locks() {
    let Some((_server, mut admin, store)) = PrivateServer::with_store("durability", &[]).await
    else {
        return;
    };
    let lease = Duration::from_secs(15);
    store
        .lock("checked", "a")
        .check_lease(lease)
        .await
        .expect("durable by default");

    let (first, _) = started_leading(store.lock("jobs", "a")).await;
    let second = Running::start(store.lock("jobs", "b"));
    let change = async {
        admin
            .query_drop("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
            .await
            .expect("set");
    };
    assert_next_term_refused_and_released(first, second, change, store.lock("jobs", "b")).await;

    let words = ["innodb_flush_log_at_trx_commit = 2", "set it to 1"];
    assert_misconfigured_saying(store.lock("checked", "a").check_lease(lease).await, &words);
    assert_misconfigured_saying(
        store.named_lock("checked", "a").check_lease(lease).await,
        &words,
    );
}

/// A server whose default turns autocommit off (`--autocommit=0`): the store's connections turn
/// it on, so the table lock's and the `GET_LOCK` lock's writes are committed, as another
/// session reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_defaulting_to_autocommit_off_still_commits_the_locks_writes() {
    let args = ["--autocommit=0".to_owned()];
    let Some((_server, mut admin, store)) = PrivateServer::with_store("autocommit", &args).await
    else {
        return;
    };
    let off: Option<u8> = admin
        .query_first("SELECT @@GLOBAL.autocommit")
        .await
        .expect("autocommit");
    assert_eq!(off, Some(0), "the case at hand");
    for (name, lock) in [
        (
            "table",
            Box::new(store.lock("table", "a")) as Box<dyn ResourceLock>,
        ),
        ("named", Box::new(store.named_lock("named", "a"))),
    ] {
        let (leader, token) = started_leading(lock).await;
        // A statement of its own: root's session, with autocommit off, reads as of its start.
        admin.query_drop("COMMIT").await.expect("commit");
        let holder: Option<String> = admin
            .exec_first(
                "SELECT holder_identity FROM leader.leader_election WHERE name = ?",
                (name,),
            )
            .await
            .expect("read the row");
        assert_eq!(holder.as_deref(), Some("a"), "{name}, token {token}");
        leader.stop().await;
    }
}
