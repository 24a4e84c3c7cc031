//! The lock table's shape against a real MySQL or MariaDB: a later release's column is kept by
//! every write of this one (S16).

mod common;

use common::unique;
use leader_core::ResourceLock;
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::Conn;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_test_support::later_column::{LATER, LaterColumn, LaterTable};
use tokio::sync::Mutex;

/// The current lock table, in `database`, plus a nullable column this release does not know,
/// as a later release's migration would add it.
fn later_layout(database: &str) -> String {
    let layout = leader_mysql::SCHEMA
        .replace(
            "`leader_election`",
            &format!("`{database}`.`leader_election`"),
        )
        .replace(
            "extensions         MEDIUMBLOB     NULL",
            "extensions         MEDIUMBLOB     NULL,\n    holder_release     VARBINARY(64)  NULL",
        );
    assert!(layout.contains("holder_release"), "{layout}");
    assert!(layout.contains(database), "{layout}");
    layout
}

/// `database.leader_election` with a later release's column, through an admin connection.
struct LaterTableOf<'a> {
    admin: Mutex<Conn>,
    database: &'a str,
}

impl LaterTable for LaterTableOf<'_> {
    async fn write(&self, name: &str) {
        self.admin
            .lock()
            .await
            .exec_drop(
                format!(
                    "INSERT INTO `{}`.leader_election (name, holder_identity, lease_duration_ms, \
                     acquire_time, renew_time, leader_transitions, version, expires_at, \
                     holder_release) VALUES (?, '', 15000, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), \
                     3, 1, UTC_TIMESTAMP(6), ?)",
                    self.database
                ),
                (name, LATER),
            )
            .await
            .expect("a later release's record");
    }

    async fn column(&self, name: &str) -> Result<Option<String>, String> {
        let value: Option<Option<String>> = self
            .admin
            .lock()
            .await
            .exec_first(
                format!(
                    "SELECT holder_release FROM `{}`.leader_election WHERE name = ?",
                    self.database
                ),
                (name,),
            )
            .await
            .map_err(|err| err.to_string())?;
        value.ok_or_else(|| "the row is gone".to_owned())
    }
}

/// A lock table with a later release's column, holding a value that release wrote: every write
/// this release makes (the table lock's, the `GET_LOCK` lock's and a shard set's batched
/// renewals) leaves the column as it was, and `get` and `get_many` read the record beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_release_s_column_is_kept_by_every_write() {
    let Some(mut admin) = common::admin().await else {
        return;
    };
    // A database of its own, so that the table can be called `leader_election`.
    let database = unique("later").replace('-', "_");
    admin
        .query_drop(format!("CREATE DATABASE `{database}`"))
        .await
        .expect("database");
    admin
        .query_drop(later_layout(&database))
        .await
        .expect("the table");
    let store = MysqlStore::builder(common::mysql_url())
        .table(format!("{database}.leader_election"))
        .create_table(true)
        .build()
        .await
        .expect("a lock table with a later release's column");
    let later = LaterColumn {
        table: LaterTableOf {
            admin: Mutex::new(admin),
            database: &database,
        },
        reader: store.lock_set("reader"),
    };

    later
        .every_write("jobs", &store.lock("jobs", "a"), &store.lock("jobs", "b"))
        .await;
    let (a, b) = (
        store.named_lock("named-jobs", "a"),
        store.named_lock("named-jobs", "b"),
    );
    later.every_write("named-jobs", &a, &b).await;
    a.close().await;
    b.close().await;
    later.every_shard_write(&store.lock_set("m")).await;

    let mut admin = later.table.admin.into_inner();
    admin
        .query_drop(format!("DROP DATABASE `{database}`"))
        .await
        .expect("drop");
}
