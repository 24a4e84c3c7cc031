//! A three-member (or N-member) etcd cluster of a test's own on loopback, as users run etcd, whose
//! members the test kills, restarts and freezes: Debian's `etcd` binary, each member's data in a
//! temporary directory that outlives its restarts.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::free_port;
use crate::process::{DataDir, Slot, exchange, wait_until};

/// One member: its ports, process and data (removed after the process is killed).
#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Slot,
    dir: DataDir,
}

/// A cluster of the test's own; every member killed and its data removed when dropped.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    initial: String,
    token: String,
}

/// `GET path` on loopback `port`, the body, or `None` when nothing answered within a second.
fn http_get(port: u16, path: &str) -> Option<String> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    exchange(port, request.as_bytes())?
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

impl EtcdCluster {
    /// Starts `members` members and waits until they have elected a raft leader; `None` when
    /// the `etcd` binary is missing (a failure under `CI=true`).
    ///
    /// # Panics
    /// The cluster did not come up within 30 s.
    #[must_use]
    pub fn start(members: usize) -> Option<Self> {
        if !crate::tool_or_skip("etcd", "scripts/setup installs etcd-server") {
            return None;
        }
        let tag = format!("{:08x}", fastrand::u32(..));
        let members: Vec<Member> = (0..members)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                child: Slot::default(),
                dir: DataDir(std::env::temp_dir().join(format!("leader-etcd-cluster-{tag}-m{i}"))),
            })
            .collect();
        let initial = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self {
            members,
            initial,
            token: format!("leader-tests-{tag}"),
        };
        for index in 0..cluster.members.len() {
            cluster.spawn(index);
        }
        cluster.wait_for_a_leader(Duration::from_secs(30));
        Some(cluster)
    }

    fn spawn(&mut self, index: usize) {
        let member = &self.members[index];
        // `ETCD_CLUSTER_LOGS=DIR`: each member's log appended to DIR/NAME-MEMBER.log, across its
        // restarts, for reading after a test.
        let log = std::env::var_os("ETCD_CLUSTER_LOGS")
            .and_then(|dir| {
                let path = PathBuf::from(dir).join(format!("{}-{}.log", self.token, member.name));
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .ok()
            })
            .map_or_else(Stdio::null, Stdio::from);
        let client = format!("http://127.0.0.1:{}", member.client_port);
        let peer = format!("http://127.0.0.1:{}", member.peer_port);
        let mut command = Command::new("etcd");
        command
            .args(["--name", &member.name, "--data-dir"])
            .arg(&*member.dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial])
            .args(["--initial-cluster-token", &self.token])
            .env("ETCD_UNSUPPORTED_ARCH", "arm64");
        self.members[index]
            .child
            .start(&mut command, log, "an etcd member");
    }

    /// How many members there are.
    #[must_use]
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no member.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Every member's client endpoint, `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// Member `index`'s client port.
    #[must_use]
    pub fn client_port(&self, index: usize) -> u16 {
        self.members[index].client_port
    }

    /// The member that is the raft leader now, as its `/metrics` says.
    #[must_use]
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.child.is_running()
                && http_get(m.client_port, "/metrics")
                    .is_some_and(|body| body.lines().any(|l| l == "etcd_server_is_leader 1"))
        })
    }

    /// Waits until some member is the raft leader.
    ///
    /// # Panics
    /// None was within `within`.
    pub fn wait_for_a_leader(&self, within: Duration) -> usize {
        wait_until(
            within,
            Duration::from_millis(100),
            "the etcd cluster elected no leader",
            || self.leader(),
        )
    }

    /// Kills member `index` (SIGKILL), keeping its data.
    pub fn kill(&mut self, index: usize) {
        self.members[index].child.kill();
    }

    /// Starts member `index` again on its ports and data, and waits until it listens.
    ///
    /// # Panics
    /// It exited, or did not listen within 60 s (a loaded machine's WAL replay can take a
    /// while; set `ETCD_CLUSTER_LOGS=DIR` for its log).
    pub fn restart(&mut self, index: usize) {
        self.kill(index);
        self.spawn(index);
        let member = &mut self.members[index];
        let port = member.client_port;
        wait_until(
            Duration::from_secs(60),
            Duration::from_millis(50),
            &format!("etcd member {index} did not listen again"),
            || {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Some(());
                }
                if let Some(status) = member.child.exited() {
                    panic!("etcd member {index} exited as it started again ({status})");
                }
                None
            },
        );
    }

    /// Freezes member `index` (SIGSTOP): its connections stay open and silent.
    pub fn freeze(&self, index: usize) {
        self.members[index].child.freeze();
    }

    /// Resumes a frozen member (SIGCONT).
    pub fn thaw(&self, index: usize) {
        self.members[index].child.thaw();
    }
}
