//! The Consul lock against the test Consul server of `leader-test-support` (`consul_api`), which
//! keeps Consul's contract for what the lock uses, or against a real agent with
//! `LEADER_CONSUL_E2E=1 CONSUL_HTTP_ADDR=http://HOST:8500` (and `CONSUL_HTTP_TOKEN`).

#![allow(dead_code, unreachable_pub)]

pub mod cluster;
pub mod scenarios;

use std::sync::Arc;

use leader_consul::{ConsulLock, ConsulStore};
use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
pub use leader_test_support::consul_api::ConsulApiServer;

/// A store on `api` with a prefix of its own.
pub fn store(api: &ConsulApiServer) -> ConsulStore {
    store_at(&api.url(), &prefix())
}

/// A new key prefix.
pub fn prefix() -> String {
    format!("leader-test-{:08x}/", fastrand::u32(..))
}

/// A store on the agent at `url` with key prefix `prefix`.
pub fn store_at(url: &str, prefix: &str) -> ConsulStore {
    ConsulStore::builder(url)
        .prefix(prefix)
        .build()
        .expect("a store")
}

/// A lock of `store` on election `name` for `identity`.
pub fn lock(store: &ConsulStore, name: &str, identity: &str) -> ConsulLock {
    store.lock(name, identity).expect("a valid name")
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
        Arc::new(lock(&self.store, name, identity))
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn leader_core::LockSet>> {
        // The suite's sets use keys of the shape this name's are checked for.
        let set = self.store.lock_set("conformance", identity);
        Some(Box::new(set.expect("keys Consul takes")))
    }

    async fn corrupt(&self, name: &str) -> bool {
        let key = format!("{}{name}", self.store.prefix());
        self.api.put_raw(&key, b"{\"holderIdentity\": 5, garbage");
        true
    }
}

/// A plain HTTP client, for what an operator or another client does to the server.
pub fn http() -> reqwest::Client {
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .build()
        .expect("an HTTP client")
}

/// `PUT url` with `body`: the status and the answer's text.
pub async fn put(url: &str, body: &str) -> (reqwest::StatusCode, String) {
    let answer = http()
        .put(url)
        .body(body.to_owned())
        .send()
        .await
        .expect("PUT");
    (answer.status(), answer.text().await.expect("a body"))
}

/// `GET url`: the status.
pub async fn get_status(url: &str) -> reqwest::StatusCode {
    http().get(url).send().await.expect("GET").status()
}
