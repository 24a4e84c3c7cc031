//! The Lease lock on the test API server of `leader-test-support` (`kube_api`), which keeps
//! kube-apiserver's contract for what Lease clients do; the lock talks to it through a real
//! `kube::Client` over HTTP.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
use leader_kube::LeaseLock;
pub use leader_test_support::kube_api::KubeApiServer;
use serde_json::json;

/// A kube client for `api`.
pub fn client(api: &KubeApiServer) -> kube::Client {
    let config = kube::Config::new(api.url().parse().expect("url"));
    kube::Client::try_from(config).expect("client")
}

/// The HTTP status code of an API error.
///
/// # Panics
/// For an error that is not the API server's answer.
pub fn code(err: kube::Error) -> u16 {
    match err {
        kube::Error::Api(status) => status.code,
        other => panic!("not an API error: {other}"),
    }
}

/// Lease locks on the test API server, for the conformance suite.
pub struct Factory {
    pub api: KubeApiServer,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(LeaseLock::new(client(&self.api), "default", name, identity).expect("valid names"))
    }

    /// A Lease with a negative duration, which only a client that bypassed the API server's
    /// validation (or an old server) could have left.
    async fn corrupt(&self, name: &str) -> bool {
        self.api.put_raw(
            "default",
            name,
            json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                   "metadata": {"name": name, "namespace": "default"},
                   "spec": {"holderIdentity": "x", "leaseDurationSeconds": -5, "leaseTransitions": 1}}),
        );
        true
    }
}
