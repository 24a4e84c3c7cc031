//! Test support: the server from `REDIS_URL` (default: loopback), required under `CI=true`.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

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

/// A `redis-server` of a test's own on a free loopback port, stopped when dropped: for a test
/// that changes the server's settings or reads its counters, which other tests running side by
/// side on the shared server would disturb.
pub struct PrivateServer {
    child: Child,
    /// Where it listens.
    pub url: String,
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PrivateServer {
    /// Started and answering, or `None` (a skip outside CI) without `redis-server` on the PATH.
    pub async fn start() -> Option<Self> {
        Self::start_with(|_| Vec::new()).await
    }

    /// As [`start`](Self::start), with the further arguments `args` makes of its port.
    pub async fn start_with(args: impl FnOnce(u16) -> Vec<String>) -> Option<Self> {
        if !leader_test_support::tool_or_skip("redis-server", "scripts/setup installs Redis") {
            return None;
        }
        let port = leader_test_support::free_port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--dir", "/tmp"])
            .args(args(port))
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server");
        let server = Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
        };
        for _ in 0..100 {
            if server.admin().await.is_ok() {
                return Some(server);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the private redis-server did not start");
    }

    /// A raw connection to it.
    pub async fn admin(&self) -> redis::RedisResult<MultiplexedConnection> {
        redis::Client::open(self.url.as_str())?
            .get_multiplexed_async_connection()
            .await
    }
}

pub use leader_test_support::{Candidate as Running, LEASE, RENEW, RETRY};

/// Locks for the conformance suite, on the server `REDIS_URL` names.
pub struct Factory {
    pub store: RedisStore,
    /// The server's URL, where it is not `REDIS_URL`'s (a private server).
    pub server: Option<String>,
}

impl Factory {
    /// Locks of `store`, on the server `REDIS_URL` names.
    pub fn new(store: RedisStore) -> Self {
        Self {
            store,
            server: None,
        }
    }
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
        let url = self.server.clone().unwrap_or_else(redis_url);
        let mut admin = redis::Client::open(url)
            .expect("URL")
            .get_multiplexed_async_connection()
            .await
            .expect("server");
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
