//! The Lease lock on the test API server of `leader-test-support` (`kube_api`), which keeps
//! kube-apiserver's contract for what Lease clients do; the lock talks to it through a real
//! `kube::Client` over HTTP.

#![allow(dead_code, unreachable_pub)]

pub mod policy;

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

/// The verbs a Role in `deploy/kubernetes/{file}` grants on `resource`.
///
/// # Panics
/// When the manifest has no rule for `resource`.
pub fn granted(file: &str, resource: &str) -> Vec<String> {
    let path = format!(
        "{}/../../deploy/kubernetes/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("the manifest");
    let mut lines = text.lines();
    let wanted = format!(r#"resources: ["{resource}"]"#);
    lines
        .find(|line| line.trim() == wanted)
        .expect("a rule for the resource");
    let verbs = lines.next().expect("its verbs").trim();
    let list = verbs
        .strip_prefix("verbs: [")
        .and_then(|v| v.strip_suffix(']'))
        .expect("verbs: [...]");
    list.split(',')
        .map(|verb| verb.trim().trim_matches('"').to_owned())
        .collect()
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
    /// A later release's field is a column (an annotation) this release leaves alone.
    fn keeps_unknown_fields(&self) -> bool {
        false
    }
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(LeaseLock::new(client(&self.api), "default", name, identity).expect("valid names"))
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn leader_core::LockSet>> {
        let base = LeaseLock::new(client(&self.api), "default", "conformance", identity);
        // The suite's sets use names of the shape this name's are checked for.
        let set = base.and_then(|b| b.lock_set("conformance", identity));
        Some(Box::new(set.expect("names the API server takes")))
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
