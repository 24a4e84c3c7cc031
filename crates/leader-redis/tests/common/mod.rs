//! Test support: the server from `REDIS_URL` (default: loopback), required under `CI=true`.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::sync::Arc;

use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
use leader_redis::RedisStore;
use redis::aio::MultiplexedConnection;

pub use leader_test_support::redis_url;

pub use leader_test_support::in_ci;

/// A raw connection for setting up and breaking things; `None` (outside CI) without a server.
pub async fn admin() -> Option<MultiplexedConnection> {
    let client = redis::Client::open(redis_url()).expect("REDIS_URL");
    let connected = client.get_multiplexed_async_connection().await;
    let at = leader_core::redact_url(&redis_url());
    leader_test_support::connected_or_skip(connected, "Redis", &at, "REDIS_URL")
}

pub async fn store() -> Option<RedisStore> {
    admin().await?;
    Some(RedisStore::connect(redis_url()).await.expect("store"))
}

pub use leader_test_support::unique;

pub use leader_test_support::{Candidate as Running, LEASE, RENEW, RETRY};

/// Locks for the conformance suite.
pub struct Factory {
    pub store: RedisStore,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity))
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn leader_core::LockSet>> {
        Some(Box::new(self.store.lock_set(identity)))
    }

    async fn corrupt(&self, name: &str) -> bool {
        let mut admin = admin().await.expect("server");
        let key = self.store.lock(name, "x").key().to_owned();
        let _: () = redis::cmd("RPUSH")
            .arg(&key)
            .arg("not")
            .arg("a hash")
            .query_async(&mut admin)
            .await
            .expect("write a list");
        true
    }
}
