//! The Consul lock against the test Consul server of `leader-test-support` (`consul_api`), which
//! keeps Consul's contract for what the lock uses, or against a real agent with
//! `LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=http://HOST:8500` (and `CONSUL_HTTP_TOKEN`).

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use leader_consul::ConsulStore;
use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
pub use leader_test_support::consul_api::ConsulApiServer;

/// A store on `api` with a prefix of its own.
pub fn store(api: &ConsulApiServer) -> ConsulStore {
    ConsulStore::builder(api.url())
        .prefix(format!("leader-test-{:08x}/", fastrand::u32(..)))
        .build()
        .expect("a store")
}

/// Consul locks for the conformance suite.
pub struct Factory {
    pub api: ConsulApiServer,
    pub store: ConsulStore,
}

impl Factory {
    pub async fn start() -> Self {
        let api = ConsulApiServer::start().await;
        let store = store(&api);
        Self { api, store }
    }
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity))
    }

    /// A session lives up to twice its TTL of at least 10 s.
    fn extra_expiry(&self) -> std::time::Duration {
        std::time::Duration::from_secs(21)
    }

    async fn corrupt(&self, name: &str) -> bool {
        let key = format!("{}{name}", self.store.prefix());
        self.api.put_raw(&key, b"{\"holderIdentity\": 5, garbage");
        true
    }
}
