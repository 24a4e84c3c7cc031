//! The core conformance suite against a real Postgres, for both locks.

mod common;

use std::sync::Arc;

use leader_core::conformance::{self, LockFactory};
use leader_core::{ResourceLock, async_trait};
use leader_postgres::PostgresStore;

struct Factory {
    store: PostgresStore,
    advisory: bool,
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
        let admin = common::admin().await.expect("server");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_lock_conforms() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory {
        store,
        advisory: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn advisory_lock_conforms() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory {
        store,
        advisory: true,
    })
    .await;
}
