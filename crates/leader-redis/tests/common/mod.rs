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
    match client.get_multiplexed_async_connection().await {
        Ok(connection) => Some(connection),
        Err(err) if !in_ci() => {
            eprintln!(
                "skipping: no Redis at {} ({err}); set REDIS_URL or run scripts/test",
                leader_core::redact_url(&redis_url())
            );
            None
        }
        Err(err) => panic!(
            "CI=true and no Redis at {}: {err}",
            leader_core::redact_url(&redis_url())
        ),
    }
}

pub async fn store() -> Option<RedisStore> {
    admin().await?;
    Some(RedisStore::connect(redis_url()).await.expect("store"))
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", fastrand::u32(..))
}

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
