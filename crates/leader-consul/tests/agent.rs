//! The conformance suite, several electors and the scenarios of the test Consul server's tests
//! that an agent can run, against a real Consul agent, on request:
//!
//! ```text
//! LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=http://127.0.0.1:8500 [CONSUL_HTTP_TOKEN=...] \
//!     cargo test -p leader-consul --test agent -- --ignored
//! ```
//!
//! The token needs the rules the README lists, and for the force-left scenario `node:write`
//! (it deregisters the agent's node and registers it again, as its anti-entropy would: use an
//! agent nothing else depends on, such as `consul agent -dev`). With `CONSUL_DENIED_TOKEN`, a
//! token that may create sessions and read keys under `leader-e2e-` but not write them, the
//! denial is checked too. What only the test server can do (an agent that leaves, a failing
//! check, a raised `session_ttl_min`, a restored snapshot) stays in its tests. Reported as
//! ignored, not passed, when not asked for.

mod common;

use std::sync::Arc;

use common::cluster::Cluster;
use common::scenarios;
use leader_consul::ConsulStore;
use leader_core::conformance::{self, LockFactory};
use leader_core::{ResourceLock, async_trait};

struct Agent {
    store: ConsulStore,
}

impl Agent {
    async fn connect() -> Self {
        Self {
            store: Cluster::agent()
                .await
                .store(false, &format!("leader-e2e-{:08x}/", fastrand::u32(..))),
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
    conformance::run_all(&Agent::connect().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Consul agent: LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=..."]
async fn ten_electors_on_a_real_agent_elect_exactly_one() {
    conformance::electors_elect_exactly_one(&Agent::connect().await, 10).await;
}

/// Tests that each run one scenario of the test server's tests on the real agent.
macro_rules! on_a_real_agent {
    ($($test:ident => $scenario:ident;)+) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "needs a Consul agent: LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=..."]
        async fn $test() {
            scenarios::$scenario(&Cluster::agent().await).await;
        }
    )+};
}

on_a_real_agent! {
    an_operators_destroy_never_gives_two_leaders_on_a_real_agent => an_operators_destroy_never_gives_two_leaders;
    a_force_left_node_never_gives_two_leaders_on_a_real_agent => a_force_left_node_never_gives_two_leaders;
    a_release_still_hands_over_at_once_on_a_real_agent => a_release_still_hands_over_at_once;
    a_crashed_holder_is_replaced_within_a_lease_and_a_jittered_retry_period_on_a_real_agent => a_crashed_holder_is_replaced_within_a_lease_and_a_jittered_retry_period;
    sessions_carry_no_ttl_and_no_checks_on_a_real_agent => sessions_carry_no_ttl_and_no_checks;
    a_watch_on_a_missing_key_wakes_for_its_creation_only_on_a_real_agent => a_watch_on_a_missing_key_wakes_for_its_creation_only;
    names_consul_would_refuse_are_refused_when_the_lock_is_built_on_a_real_agent => names_consul_would_refuse_are_refused_when_the_lock_is_built;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a Consul agent and a token without key:write: LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=... CONSUL_DENIED_TOKEN=..."]
async fn a_token_without_key_write_is_forbidden_on_a_real_agent() {
    let cluster = Cluster::agent().await;
    let token = std::env::var("CONSUL_DENIED_TOKEN")
        .expect("CONSUL_DENIED_TOKEN: a token that may not write the keys");
    let Cluster::Agent { url, .. } = &cluster else {
        unreachable!("a real agent");
    };
    let store = ConsulStore::builder(url)
        .token(token)
        .prefix(format!("leader-e2e-{:08x}/", fastrand::u32(..)))
        .build()
        .expect("a store");
    scenarios::a_token_without_key_write_is_forbidden(&store).await;
}
