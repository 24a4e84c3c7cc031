//! Test support: the server from `REDIS_URL` (default: loopback), required under `CI=true`.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use leader_core::conformance::LockFactory;
use leader_core::{CancellationToken, LeaderElector, LeaderState, ResourceLock, async_trait};
use leader_redis::RedisStore;
use redis::aio::MultiplexedConnection;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

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

pub const LEASE: Duration = Duration::from_secs(3);
pub const RENEW: Duration = Duration::from_secs(2);
pub const RETRY: Duration = Duration::from_millis(500);

/// An elector with short timings, running in the background.
pub struct Running {
    pub state: watch::Receiver<LeaderState>,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<()>,
}

impl Running {
    pub fn start(lock: impl ResourceLock + 'static) -> Self {
        Self::start_with(lock, RETRY)
    }

    pub fn start_with(lock: impl ResourceLock + 'static, retry: Duration) -> Self {
        let elector = LeaderElector::builder(lock)
            .lease_duration(LEASE.max(retry * 4))
            .renew_deadline(RENEW.max(retry * 3))
            .retry_period(retry)
            .build()
            .expect("valid timings");
        let state = elector.subscribe();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(elector.run(shutdown.clone()));
        Self {
            state,
            shutdown,
            task,
        }
    }

    pub fn leading_token(&self) -> Option<u64> {
        self.state.borrow().leadership().map(|l| l.fencing_token())
    }

    pub async fn wait_leading(&mut self, within: Duration) -> u64 {
        tokio::time::timeout(within, self.state.wait_for(LeaderState::is_leading))
            .await
            .expect("leads in time")
            .expect("elector alive")
            .leadership()
            .map(|l| l.fencing_token())
            .expect("leading")
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.expect("elector task");
    }
}

/// Locks for the conformance suite.
pub struct Factory {
    pub store: RedisStore,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity))
    }

    async fn corrupt(&self, name: &str) {
        let mut admin = admin().await.expect("server");
        let key = self.store.lock(name, "x").key().to_owned();
        let _: () = redis::cmd("RPUSH")
            .arg(&key)
            .arg("not")
            .arg("a hash")
            .query_async(&mut admin)
            .await
            .expect("write a list");
    }
}
