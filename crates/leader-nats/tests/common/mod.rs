//! Test support: the server from `NATS_URL` (default: loopback), required under `CI=true`, and
//! private servers the tests start, stop and configure themselves.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use leader_core::conformance::LockFactory;
use leader_core::{LockSet, ResourceLock, async_trait};
use leader_nats::{NatsStore, NatsStoreBuilder, key_of};
use leader_test_support::free_port;

pub use leader_test_support::{Candidate as Running, LEASE, RENEW, RETRY};
pub use leader_test_support::{in_ci, nats_bucket, nats_url};

/// A store on the test bucket, created if missing; `None` (outside CI) without a server.
pub async fn store() -> Option<NatsStore> {
    leader_test_support::nats_lock_or_skip()?;
    Some(
        NatsStore::builder(nats_url())
            .bucket(nats_bucket())
            .create_bucket(true)
            .build()
            .await
            .expect("store"),
    )
}

pub use leader_test_support::unique;

/// A store at `url` that waits a second for an answer.
pub fn builder(url: &str) -> NatsStoreBuilder {
    NatsStore::builder(url).request_timeout(Duration::from_secs(1))
}

/// Locks of one store, and its shard sets (a key per record).
pub struct Factory {
    pub store: NatsStore,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity))
    }

    async fn corrupt(&self, name: &str) -> bool {
        let kv = self.store.kv().await.expect("bucket");
        kv.put(key_of(name), "{\"holderIdentity\": 7, \"garbage".into())
            .await
            .expect("write a garbage value");
        true
    }
}

/// A server configuration with two users in an account with JetStream: `owner` (password
/// `owner-secret`) with every right, and `app` (password `app-secret`) with exactly the
/// permissions `deploy/nats/permissions.conf` documents for bucket `leader`.
pub fn documented_permissions() -> String {
    let permissions = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/nats/permissions.conf"
    ))
    .expect("deploy/nats/permissions.conf");
    format!(
        "{permissions}\naccounts {{ APP {{ jetstream: enabled, users: [ \
         {{ user: owner, password: owner-secret }}, \
         {{ user: app, password: app-secret, permissions: $LEADER_PERMISSIONS }} ] }} }}\n"
    )
}

/// A server with [`documented_permissions`] and the bucket `leader` that `owner` created, as
/// an operator does once; `None` (outside CI) without a `nats-server` binary.
pub async fn documented_server() -> Option<Server> {
    let server = Server::start(Some(&documented_permissions()))?;
    create_bucket(&server.url_as("owner", "owner-secret")).await;
    Some(server)
}

/// The bucket `leader` as the lock creates it, made at `url` by someone with every right.
pub async fn create_bucket(url: &str) {
    builder(url)
        .create_bucket(true)
        .build()
        .await
        .expect("store")
        .kv()
        .await
        .expect("create the bucket");
}

/// A `nats-server` of the test's own, with JetStream, on a free loopback port, stopped on drop.
pub struct Server {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    config: Option<String>,
    jetstream: bool,
}

impl Server {
    /// Starts a server with `config` (a `nats-server` configuration, or none); `None` (outside
    /// CI) when there is no `nats-server` binary.
    pub fn start(config: Option<&str>) -> Option<Self> {
        if !leader_test_support::tool_or_skip("nats-server", "scripts/setup installs it") {
            return None;
        }
        let mut server = Self {
            child: None,
            port: free_port(),
            dir: tempfile::tempdir().expect("temporary directory"),
            config: config.map(str::to_owned),
            jetstream: true,
        };
        server.run();
        Some(server)
    }

    /// A server without JetStream, as `nats-server` runs without `-js`.
    pub fn start_without_jetstream() -> Option<Self> {
        let mut server = Self::start(None)?;
        server.jetstream = false;
        server.restart();
        Some(server)
    }

    /// `n` servers with JetStream in one cluster on loopback, each with a name and routes to
    /// all; their client URLs, comma-separated, with [`Self::urls`].
    pub fn cluster(n: usize) -> Option<Vec<Self>> {
        let routes: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let listed: Vec<String> = routes
            .iter()
            .map(|port| format!("\"nats-route://127.0.0.1:{port}\""))
            .collect();
        (0..n)
            .map(|i| {
                Self::start(Some(&format!(
                    "server_name: n{i}\ncluster {{\n  name: leader-test\n  listen: \"127.0.0.1:{}\"\n  routes: [{}]\n}}\n",
                    routes[i],
                    listed.join(", ")
                )))
            })
            .collect()
    }

    /// The client URLs of `servers`, comma-separated.
    pub fn urls(servers: &[Self]) -> String {
        servers.iter().map(Self::url).collect::<Vec<_>>().join(",")
    }

    /// The server's client URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's client URL with `user`'s name and `password`.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("nats://{user}:{password}@127.0.0.1:{}", self.port)
    }

    fn run(&mut self) {
        let mut command = Command::new("nats-server");
        command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.jetstream {
            command
                .arg("-js")
                .arg("-sd")
                .arg(self.dir.path().join("js"));
        }
        if let Some(config) = &self.config {
            let path = self.dir.path().join("server.conf");
            std::fs::write(&path, config).expect("write the configuration");
            command.arg("-c").arg(path);
        }
        self.child = Some(command.spawn().expect("start nats-server"));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL): what it stored stays on disk.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and storage.
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}
