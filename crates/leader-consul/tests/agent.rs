//! The conformance suite and several electors against a real Consul agent, on request:
//! `LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=http://127.0.0.1:8500 [CONSUL_HTTP_TOKEN=...]
//! cargo test -p leader-consul --test agent -- --ignored`. The token needs the rules the
//! README lists. Reported as ignored, not passed, when not asked for.

use std::sync::Arc;

use leader_consul::ConsulStore;
use leader_core::conformance::{self, LockFactory};
use leader_core::{ResourceLock, async_trait};

struct Agent {
    store: ConsulStore,
}

impl Agent {
    fn connect() -> Self {
        assert_eq!(
            std::env::var("LEADER_CONSUL_E2E").as_deref(),
            Ok("1"),
            "set LEADER_CONSUL_E2E=1 and CONSUL_HTTP_ADDR to run against a real agent"
        );
        let address = std::env::var("CONSUL_HTTP_ADDR").expect("CONSUL_HTTP_ADDR");
        let address = if address.contains("://") {
            address
        } else {
            format!("http://{address}")
        };
        let mut builder =
            ConsulStore::builder(address).prefix(format!("leader-e2e-{:08x}/", fastrand::u32(..)));
        if let Ok(token) = std::env::var("CONSUL_HTTP_TOKEN") {
            builder = builder.token(token);
        }
        Self {
            store: builder.build().expect("store"),
        }
    }
}

#[async_trait]
impl LockFactory for Agent {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity).expect("a valid name"))
    }

    /// The lock's own client writes only records; the check that needs garbage is skipped.
    async fn corrupt(&self, _name: &str) -> bool {
        false
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Consul agent: LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=..."]
async fn a_real_agent_conforms() {
    conformance::run_all(&Agent::connect()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Consul agent: LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=..."]
async fn ten_electors_on_a_real_agent_elect_exactly_one() {
    conformance::electors_elect_exactly_one(&Agent::connect(), 10).await;
}
