//! Test support: the server from `DATABASE_URL` (default: loopback), required under `CI=true`.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::sync::Arc;
use std::time::Duration;

use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
use leader_postgres::PostgresStore;

pub use leader_test_support::database_url;

pub use leader_test_support::in_ci;

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

pub use leader_test_support::{Candidate as Running, LEASE, RENEW, RETRY};

/// Locks for the conformance suite: table or advisory locks of one store.
pub struct Factory {
    pub store: PostgresStore,
    pub advisory: bool,
}

#[async_trait]
impl LockFactory for Factory {
    /// A later release's field is a column (an annotation) this release leaves alone.
    fn keeps_unknown_fields(&self) -> bool {
        false
    }
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        if self.advisory {
            Arc::new(self.store.advisory_lock(name, identity))
        } else {
            Arc::new(self.store.lock(name, identity))
        }
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn leader_core::LockSet>> {
        (!self.advisory).then(|| Box::new(self.store.lock_set(identity)) as Box<_>)
    }

    async fn corrupt(&self, name: &str) -> bool {
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
        true
    }
}
