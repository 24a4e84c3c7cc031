//! Test support: the server from `DATABASE_URL` (default: loopback), required under `CI=true`.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use leader_core::conformance::LockFactory;
use leader_core::{CancellationToken, LeaderElector, LeaderState, ResourceLock, async_trait};
use leader_postgres::PostgresStore;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const DEFAULT_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/postgres";

pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// A raw client for setting up and breaking things.
pub async fn admin() -> Option<tokio_postgres::Client> {
    match tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(connection);
            Some(client)
        }
        Err(err) if !in_ci() => {
            eprintln!(
                "skipping: no Postgres at {} ({err}); set DATABASE_URL or run scripts/test",
                leader_postgres::redact_url(&database_url())
            );
            None
        }
        Err(err) => panic!(
            "CI=true and no Postgres at {}: {err}",
            leader_postgres::redact_url(&database_url())
        ),
    }
}

/// A store on the default table, created if missing; `None` (outside CI) without a server.
pub async fn store() -> Option<PostgresStore> {
    admin().await?;
    Some(
        PostgresStore::builder(database_url())
            .create_table(true)
            .build()
            .await
            .expect("store"),
    )
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", fastrand::u32(..))
}

/// An elector with short timings, running in the background.
pub struct Running {
    pub state: watch::Receiver<LeaderState>,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<()>,
}

pub const LEASE: Duration = Duration::from_secs(3);
pub const RENEW: Duration = Duration::from_secs(2);
pub const RETRY: Duration = Duration::from_millis(500);

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

/// Locks for the conformance suite: table or advisory locks of one store.
pub struct Factory {
    pub store: PostgresStore,
    pub advisory: bool,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        if self.advisory {
            Arc::new(self.store.advisory_lock(name, identity))
        } else {
            Arc::new(self.store.lock(name, identity))
        }
    }

    async fn corrupt(&self, name: &str) {
        let admin = admin().await.expect("server");
        admin
            .execute(
                "INSERT INTO public.leader_election (name, holder_identity, lease_duration_ms, acquire_time, \
                 renew_time, leader_transitions, version, expires_at) \
                 VALUES ($1, 'x', -5, now(), now() - interval '1 day', -1, 1, now())",
                &[&name],
            )
            .await
            .expect("write a garbage row");
    }
}
