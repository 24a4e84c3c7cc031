//! Test support: the ensemble from `ZOOKEEPER_ENSEMBLE` (default: the loopback ensemble
//! `scripts/setup` starts), required under `CI=true`, and the run's chroot, which the tests
//! create.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::sync::Arc;
use std::time::Duration;

use leader_core::conformance::LockFactory;
use leader_core::{LockSet, ResourceLock, async_trait};
use leader_test_support::zookeeper_ensemble::ZooKeeperEnsemble;
use leader_zookeeper::ZooKeeperStore;
use leader_zookeeper::zookeeper_client as zk;

pub use leader_test_support::{Candidate as Running, LEASE, RENEW, RETRY};
pub use leader_test_support::{in_ci, zookeeper_chroot, zookeeper_ensemble};

/// A session on the ensemble without a chroot, for what the tests do by hand; `None` (outside
/// CI) without an ensemble.
pub async fn raw() -> Option<zk::Client> {
    let ensemble = zookeeper_ensemble();
    let connecting = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .with_fail_eagerly()
        .connect(&ensemble);
    let connected = match tokio::time::timeout(Duration::from_secs(10), connecting).await {
        Ok(connected) => connected.map_err(|err| err.to_string()),
        Err(elapsed) => Err(elapsed.to_string()),
    };
    leader_test_support::connected_or_skip(
        connected,
        "ZooKeeper ensemble",
        &ensemble,
        "ZOOKEEPER_ENSEMBLE",
    )
}

/// Creates the run's chroot (and `more` under it) when missing.
pub async fn make_chroot(client: &zk::Client, more: &str) {
    let path = format!("{}{more}", zookeeper_chroot());
    client
        .mkdir(
            &path,
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .expect("create the chroot");
}

/// A store on the test ensemble under the run's chroot; `None` (outside CI) without one.
pub async fn store() -> Option<ZooKeeperStore> {
    let client = raw().await?;
    make_chroot(&client, "").await;
    Some(
        ZooKeeperStore::builder(zookeeper_ensemble())
            .chroot(zookeeper_chroot())
            .build()
            .await
            .expect("store"),
    )
}

/// A three-server ensemble of the test's own, and a store on it, for tests that count its
/// requests; `None` (outside CI) without `zookeeperd`.
pub async fn private_store() -> Option<(ZooKeeperEnsemble, ZooKeeperStore)> {
    let ensemble = ZooKeeperEnsemble::start()?;
    let store = ZooKeeperStore::builder(ensemble.connect_string())
        .build()
        .await
        .expect("store");
    Some((ensemble, store))
}

pub use leader_test_support::unique;

/// Locks of one store, and its shard sets (an election znode per record).
pub struct Factory {
    pub store: ZooKeeperStore,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity))
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn LockSet>> {
        Some(Box::new(self.store.lock_set(identity)))
    }

    async fn corrupt(&self, name: &str) -> bool {
        let lock = self.store.lock(name, "x");
        let client = self.store.client().await.expect("session");
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        client
            .mkdir(lock.path(), &persistent)
            .await
            .expect("the election znode");
        client
            .create(
                lock.record_path(),
                b"{\"holderIdentity\": 7, \"garbage",
                &persistent,
            )
            .await
            .expect("write a garbage record");
        true
    }
}
