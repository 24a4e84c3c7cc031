//! The lock table's shape against a real MySQL or MariaDB: a later release's column is kept by
//! every write of this one (S16).

mod common;

use chrono::Utc;
use common::unique;
use leader_core::backend::Known;
use leader_core::conformance::{record, renewals};
use leader_core::{Acquisition, LockSet, Observed, ResourceLock, request_handover};
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::Conn;
use leader_mysql::mysql_async::prelude::Queryable;
use tokio::sync::Mutex;

/// What a later release wrote into its own column.
const LATER: &str = "n+1";

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

/// The later release's column of `database.leader_election`, watched through this release's
/// writes.
struct LaterColumn<'a> {
    admin: Mutex<Conn>,
    database: &'a str,
    store: &'a MysqlStore,
}

impl LaterColumn<'_> {
    /// A free record of election `name` as a later release wrote it, with its column set.
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

    /// After `step`: the column of `name` still holds the later release's value, and `get` and a
    /// shard set's `get_many` both read the record.
    async fn kept(&self, step: &str, name: &str, lock: &dyn ResourceLock) -> Observed {
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
            .unwrap_or_else(|err| panic!("{step}: the row of {name}: {err}"));
        let value = value.unwrap_or_else(|| panic!("{step}: the row of {name} is gone"));
        assert_eq!(
            value.as_deref(),
            Some(LATER),
            "{step}: the later release's column of {name} lost its value"
        );
        let read = lock
            .get()
            .await
            .unwrap_or_else(|err| panic!("{step}: get: {err}"))
            .unwrap_or_else(|| panic!("{step}: get found no record"));
        let many = self
            .store
            .lock_set("reader")
            .get_many(&[name.to_owned()])
            .await;
        let [Ok(Some(many))] = many.as_slice() else {
            panic!("{step}: get_many: {many:?}");
        };
        assert_eq!(many, &read, "{step}: get_many and get differ");
        read
    }

    /// Every write of one election: `a` acquires, renews, updates with an extension, `b` asks
    /// for a handover, `a` releases, `b` acquires; the column is checked after each.
    async fn every_write(&self, name: &str, a: &dyn ResourceLock, b: &dyn ResourceLock) {
        self.write(name).await;
        self.kept("a later release's write", name, a).await;

        let Some(Acquisition::Acquired(held)) =
            a.try_acquire(&record("a", 0)).await.expect("acquisition")
        else {
            panic!("{name}: a did not take the free lease");
        };
        let read = self.kept("an acquisition", name, a).await;
        assert!(read.record.is_held_by("a"), "{read:?}");

        let mut renewal = held.record.clone();
        renewal.renew_time = renewal.renewal_time(Utc::now());
        let renewed = a.renew(&held.version, &renewal).await.expect("renewal");
        self.kept("a renewal", name, a).await;

        let mut extended = renewed.record.clone();
        extended.renew_time = extended.renewal_time(Utc::now());
        extended
            .extensions
            .insert("schedule".to_owned(), "fired=1".to_owned());
        a.update(&renewed.version, &extended)
            .await
            .expect("update with an extension");
        let read = self.kept("an update with an extension", name, a).await;
        assert_eq!(read.record.extensions, extended.extensions);

        request_handover(b, "b").await.expect("handover request");
        let requested = self.kept("a handover request", name, a).await;
        assert_eq!(requested.record.handover_to(), Some("b"));

        let now = Utc::now();
        let mut released = requested.record.clone();
        released.holder_identity = String::new();
        released.acquire_time = now;
        released.renew_time = now;
        a.update(&requested.version, &released)
            .await
            .expect("release");
        let read = self.kept("a release", name, a).await;
        assert!(read.record.is_free(), "{read:?}");

        let Some(Acquisition::Acquired(_)) =
            b.try_acquire(&record("b", 0)).await.expect("acquisition")
        else {
            panic!("{name}: b did not take the lease handed to it");
        };
        let read = self.kept("another candidate's acquisition", name, b).await;
        assert!(read.record.is_held_by("b"), "{read:?}");
        assert!(read.record.leader_transitions > held.record.leader_transitions);
        assert_eq!(read.record.extensions, extended.extensions);
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
        admin: Mutex::new(admin),
        database: &database,
        store: &store,
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

    let set = store.lock_set("m");
    let keys = ["shard-0".to_owned(), "shard-1".to_owned()];
    let mut taken = Vec::new();
    for key in &keys {
        later.write(key).await;
        let Some(Acquisition::Acquired(held)) = set
            .lock(key)
            .try_acquire(&record("m", 0))
            .await
            .expect("a shard's acquisition")
        else {
            panic!("{key}: m did not take the free lease");
        };
        later
            .kept("a shard's acquisition", key, &*set.lock(key))
            .await;
        taken.push((key.clone(), held));
    }
    let mut renewed = Vec::new();
    for (key, result) in keys.iter().zip(set.renew_many(&renewals(&taken)).await) {
        renewed.push((key.clone(), result.expect("a batched renewal")));
        later.kept("a batched renewal", key, &*set.lock(key)).await;
    }
    let round = set
        .renew_and_read(&renewals(&renewed), &keys, &[Known::Nothing; 2])
        .await;
    for ((key, renewal), read) in keys.iter().zip(round.renewed).zip(round.read) {
        renewal.expect("a round's renewal");
        read.expect("a round's read");
        later.kept("a round's renewal", key, &*set.lock(key)).await;
    }

    let mut admin = later.admin.into_inner();
    admin
        .query_drop(format!("DROP DATABASE `{database}`"))
        .await
        .expect("drop");
}
