//! Test support: the cluster from `ETCD_ENDPOINTS` (default: loopback), required under
//! `CI=true`; and private etcd servers for tests that stop one or turn on authentication.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
use leader_etcd::EtcdStore;

pub use leader_test_support::{etcd_endpoints as endpoints, etcd_prefix as prefix};

pub use leader_test_support::in_ci;

/// A store on the test cluster, under the run's prefix; `None` (outside CI) without one.
pub async fn store() -> Option<EtcdStore> {
    let mut builder = EtcdStore::builder(endpoints()).timeout(Duration::from_secs(2));
    if let Some(prefix) = prefix() {
        builder = builder.prefix(prefix);
    }
    let connected = match builder.build().await {
        Ok(store) => match store.client().await.expect("etcd client").status().await {
            Ok(_) => Ok(store),
            Err(err) => Err(err.to_string()),
        },
        Err(err) => Err(err.to_string()),
    };
    leader_test_support::connected_or_skip(
        connected,
        "etcd",
        &format!("{:?}", endpoints()),
        "ETCD_ENDPOINTS",
    )
}

pub use leader_test_support::unique;

/// Locks for the conformance suite.
pub struct Factory {
    pub store: EtcdStore,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity))
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn leader_core::LockSet>> {
        Some(Box::new(self.store.lock_set("conformance", identity)))
    }

    async fn corrupt(&self, name: &str) -> bool {
        let key = self.store.lock(name, "x").key().to_owned();
        self.store
            .client()
            .await
            .expect("etcd client")
            .put(key, "not a record", None)
            .await
            .expect("write garbage");
        true
    }
}

pub use leader_test_support::{Candidate as Running, LEASE, RENEW, RETRY};

/// An etcd server of the test's own on loopback, with its data in a temporary directory that
/// outlives restarts. Killed when dropped.
pub struct PrivateEtcd {
    pub client_port: u16,
    peer_port: u16,
    pub dir: std::path::PathBuf,
    child: Option<Child>,
    /// More flags of the server's.
    flags: Vec<String>,
}

impl PrivateEtcd {
    /// Starts one, or `None` (outside CI) when the `etcd` binary is missing.
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// As [`start`](Self::start), with more of the server's flags.
    pub fn start_with(flags: &[&str]) -> Option<Self> {
        if !leader_test_support::tool_or_skip("etcd", "scripts/setup installs etcd-server") {
            return None;
        }
        let free = leader_test_support::free_port;
        let dir = std::env::temp_dir().join(format!("leader-etcd-test-{:08x}", fastrand::u32(..)));
        let mut etcd = Self {
            client_port: free(),
            peer_port: free(),
            dir,
            child: None,
            flags: flags.iter().map(|&flag| flag.to_owned()).collect(),
        };
        etcd.resume();
        Some(etcd)
    }

    /// The server's client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Turns authentication on, with user `root` (role `root`) logging in with `password`.
    pub async fn enable_auth(&self, password: &str) {
        let admin = EtcdStore::connect([self.endpoint()])
            .await
            .expect("connect");
        let mut client = admin.client().await.expect("etcd client");
        client
            .user_add("root", password, None)
            .await
            .expect("add root");
        client
            .user_grant_role("root", "root")
            .await
            .expect("grant root");
        client.auth_enable().await.expect("enable auth");
    }

    /// Starts (again) on the same ports and data.
    pub fn resume(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
            .args(["--name", "private", "--data-dir"])
            .arg(&self.dir)
            .args([
                "--listen-client-urls",
                &self.endpoint(),
                "--advertise-client-urls",
                &self.endpoint(),
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("private={peer}")])
            .args(&self.flags)
            .env("ETCD_UNSUPPORTED_ARCH", "arm64")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", self.client_port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("private etcd did not start");
    }

    /// Stops the server (SIGKILL), keeping its data.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateEtcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
