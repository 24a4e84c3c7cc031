//! Test support: the server from `MYSQL_URL` (default: loopback), required under `CI=true`.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::sync::Arc;

use leader_core::conformance::LockFactory;
use leader_core::{LockSet, ResourceLock, async_trait};
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_mysql::mysql_async::{self, Conn};

pub use leader_test_support::{in_ci, mysql_url};

pub mod private;

/// A raw connection for setting up and breaking things; `None` (outside CI) without a server.
pub async fn admin() -> Option<Conn> {
    let opts = mysql_async::Opts::from_url(&mysql_url()).expect("MYSQL_URL");
    let at = leader_mysql::redact_url(&mysql_url());
    leader_test_support::connected_or_skip(Conn::new(opts).await, "MySQL", &at, "MYSQL_URL")
}

/// Runs `sql` as the admin.
pub async fn admin_exec(sql: &str) {
    let mut conn = admin().await.expect("server");
    conn.query_drop(sql).await.expect(sql);
}

/// A store whose pool holds one connection, on the default table, created if missing: the
/// connection another user of the pool changes is the one the lock gets next.
pub async fn one_connection_store() -> MysqlStore {
    MysqlStore::builder(mysql_url())
        .max_connections(1)
        .create_table(true)
        .build()
        .await
        .expect("store")
}

/// A store on the default table, created if missing; `None` (outside CI) without a server.
pub async fn store() -> Option<MysqlStore> {
    admin().await?;
    Some(
        MysqlStore::builder(mysql_url())
            .create_table(true)
            .build()
            .await
            .expect("store"),
    )
}

pub use leader_test_support::unique;

pub use leader_test_support::{Candidate as Running, LEASE, RENEW, RETRY};

/// Locks for the conformance suite: table locks of one store and its shard sets, or its
/// `GET_LOCK` locks (`named`), on which the shard protocol runs one record at a time.
pub struct Factory {
    pub store: MysqlStore,
    pub named: bool,
}

#[async_trait]
impl LockFactory for Factory {
    /// A later release's field is a column (an annotation) this release leaves alone.
    fn keeps_unknown_fields(&self) -> bool {
        false
    }
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        if self.named {
            Arc::new(self.store.named_lock(name, identity))
        } else {
            Arc::new(self.store.lock(name, identity))
        }
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn LockSet>> {
        (!self.named).then(|| Box::new(self.store.lock_set(identity)) as Box<_>)
    }

    /// Writes, under election `name`, a row that does not decode.
    async fn corrupt(&self, name: &str) -> bool {
        let mut admin = admin().await.expect("server");
        admin
            .exec_drop(
                "INSERT INTO leader_election (name, holder_identity, lease_duration_ms, acquire_time, \
                 renew_time, leader_transitions, version, expires_at) \
                 VALUES (?, 'x', -5, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL 1 DAY, -1, 1, \
                 UTC_TIMESTAMP(6))",
                (name,),
            )
            .await
            .expect("write a garbage row");
        true
    }
}
