//! A three-server ZooKeeper ensemble of a test's own on loopback, as users run ZooKeeper,
//! whose servers the test kills, restarts and freezes: Debian's `zookeeperd` (3.8) with its
//! defaults (`tickTime` 2000 ms), each server's data in a temporary directory that outlives its
//! restarts. A test that needs other settings (authentication enforced, containers reaped
//! sooner) starts servers of its own with [`ZooKeeperEnsemble::start_with`].

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::free_port;
use crate::process::{DataDir, Slot, exchange, wait_until};

/// Where Debian's package puts the server.
const JAR: &str = "/usr/share/java/zookeeper.jar";
/// A logger binding for the server's slf4j (Debian's `libslf4j-java`).
const LOGGER: &str = "/usr/share/java/slf4j-simple.jar";

/// One server: its port, process and data (removed after the process is killed).
#[derive(Debug)]
struct Server {
    client_port: u16,
    child: Slot,
    dir: DataDir,
}

/// Where a count of requests began ([`ZooKeeperEnsemble::count_requests`]).
#[derive(Clone, Copy, Debug)]
pub struct RequestCount {
    before: u64,
    asking: u64,
}

/// An ensemble of the test's own; every server killed and its data removed when dropped.
#[derive(Debug)]
pub struct ZooKeeperEnsemble {
    servers: Vec<Server>,
    /// The Java system properties every server starts with (`-Dkey=value`).
    properties: Vec<String>,
}

/// The configuration of a server on loopback `client_port` that keeps its data in `data`, with
/// ZooKeeper's defaults (`tickTime` 2000 ms) and the four-letter words the tests ask: a member
/// of the ensemble `peers` names (its `server.N=` lines), or a standalone server without them.
#[must_use]
pub fn server_config(data: &Path, client_port: u16, peers: &str) -> String {
    let mut config = format!(
        "tickTime=2000\ndataDir={}\nclientPortAddress=127.0.0.1\nclientPort={client_port}\nadmin.enableServer=false\n4lw.commands.whitelist=srvr,ruok,stat,wchs\n",
        data.display()
    );
    if !peers.is_empty() {
        config.push_str("initLimit=10\nsyncLimit=5\nstandaloneEnabled=false\n");
        config.push_str(peers);
    }
    config
}

/// The command that runs a server (Debian's `zookeeperd`) on configuration file `config`.
#[must_use]
pub fn server_command(config: &Path) -> Command {
    server_command_with(config, &[])
}

/// [`server_command`] with Java system properties (`-Dkey=value`, such as
/// `znode.container.checkIntervalMs`, which the server reads only from there).
#[must_use]
pub fn server_command_with(config: &Path, properties: &[String]) -> Command {
    let mut command = Command::new("java");
    command
        .arg("-Xmx256m")
        .args(properties.iter().map(|p| format!("-D{p}")))
        .args(["-cp", &format!("{JAR}:{LOGGER}")])
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(config);
    command
}

/// Sends four-letter word `word` to loopback `port` and returns the answer, or `None` when
/// nothing answered within a second.
pub fn four_letter_word(port: u16, word: &str) -> Option<String> {
    exchange(port, word.as_bytes())
}

/// The requests server `port` has received from clients so far (its `stat`'s `Received:`).
pub fn received(port: u16) -> Option<u64> {
    four_letter_word(port, "stat")?
        .lines()
        .find_map(|line| line.strip_prefix("Received: ")?.trim().parse().ok())
}

/// The watches server `port` keeps for its clients' connections, persistent ones included
/// (its `wchs`'s `Total watches:`).
pub fn watches(port: u16) -> Option<u64> {
    four_letter_word(port, "wchs")?
        .lines()
        .find_map(|line| line.strip_prefix("Total watches:")?.trim().parse().ok())
}

impl ZooKeeperEnsemble {
    /// Starts three servers and waits until they have a quorum; `None` when Debian's
    /// `zookeeperd` is not installed (a failure under `CI=true`).
    ///
    /// # Panics
    /// The ensemble formed no quorum within 60 s.
    #[must_use]
    pub fn start() -> Option<Self> {
        Self::start_with(3, "", &[])
    }

    /// Starts `count` servers (one: a standalone server), each with `settings` (lines added
    /// to its `zoo.cfg`, such as `enforce.auth.enabled=true`) and Java system `properties`
    /// (`key=value`), and waits until they serve; `None` when Debian's `zookeeperd` is not
    /// installed (a failure under `CI=true`).
    ///
    /// # Panics
    /// The servers did not serve within 60 s.
    #[must_use]
    pub fn start_with(count: usize, settings: &str, properties: &[&str]) -> Option<Self> {
        if !std::path::Path::new(JAR).is_file()
            || Command::new("java").arg("-version").output().is_err()
        {
            assert!(
                !crate::in_ci(),
                "CI=true and no ZooKeeper server (scripts/setup installs zookeeperd)"
            );
            eprintln!("skipping: no ZooKeeper server (zookeeperd)");
            return None;
        }
        let tag = format!("{:08x}", fastrand::u32(..));
        let ports: Vec<(u16, u16, u16)> = (0..count)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let peers: String = if count == 1 {
            String::new()
        } else {
            ports
                .iter()
                .enumerate()
                .map(|(i, (_, quorum, election))| {
                    format!("server.{}=127.0.0.1:{quorum}:{election}\n", i + 1)
                })
                .collect()
        };
        let mut servers = Vec::new();
        for (i, (client, _, _)) in ports.iter().enumerate() {
            let dir = std::env::temp_dir().join(format!("leader-zookeeper-{tag}-{}", i + 1));
            std::fs::create_dir_all(&dir).expect("the server's directory");
            std::fs::write(dir.join("myid"), format!("{}\n", i + 1)).expect("myid");
            let mut config = server_config(&dir, *client, &peers);
            for line in settings.lines().map(str::trim).filter(|l| !l.is_empty()) {
                config.push_str(line);
                config.push('\n');
            }
            std::fs::write(dir.join("zoo.cfg"), config).expect("zoo.cfg");
            servers.push(Server {
                client_port: *client,
                child: Slot::default(),
                dir: DataDir(dir),
            });
        }
        let mut ensemble = Self {
            servers,
            properties: properties.iter().map(|p| (*p).to_owned()).collect(),
        };
        for index in 0..count {
            ensemble.spawn(index);
        }
        ensemble.wait_for_quorum(Duration::from_secs(60));
        Some(ensemble)
    }

    fn spawn(&mut self, index: usize) {
        let server = &self.servers[index];
        let log = std::fs::File::create(server.dir.join("zookeeper.log"))
            .map_or_else(|_| Stdio::null(), Stdio::from);
        let mut command = server_command_with(&server.dir.join("zoo.cfg"), &self.properties);
        self.servers[index]
            .child
            .start(&mut command, log, "a ZooKeeper server");
    }

    /// The connect string of every server, `127.0.0.1:PORT,...`.
    #[must_use]
    pub fn connect_string(&self) -> String {
        self.servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Server `index`'s client port.
    #[must_use]
    pub fn client_port(&self, index: usize) -> u16 {
        self.servers[index].client_port
    }

    /// The requests every server has received from clients so far.
    #[must_use]
    pub fn received(&self) -> u64 {
        self.servers
            .iter()
            .filter(|s| s.child.is_running())
            .filter_map(|s| received(s.client_port))
            .sum()
    }

    /// Starts counting the requests the servers receive from clients: see
    /// [`requests`](Self::requests).
    #[must_use]
    pub fn count_requests(&self) -> RequestCount {
        let first = self.received();
        let before = self.received();
        RequestCount {
            before,
            asking: before.saturating_sub(first),
        }
    }

    /// The requests the servers received from clients since `count` began, less those that
    /// asking the servers makes (`stat` counts itself).
    #[must_use]
    pub fn requests(&self, count: &RequestCount) -> u64 {
        self.received()
            .saturating_sub(count.before)
            .saturating_sub(count.asking)
    }

    /// The server that leads the ensemble now, as its `srvr` says.
    #[must_use]
    pub fn leader(&self) -> Option<usize> {
        self.servers.iter().position(|s| {
            s.child.is_running()
                && four_letter_word(s.client_port, "srvr")
                    .is_some_and(|answer| answer.lines().any(|l| l == "Mode: leader"))
        })
    }

    /// Waits until every running server serves in a quorum (leader or follower), or alone.
    ///
    /// # Panics
    /// They did not within `within`.
    pub fn wait_for_quorum(&self, within: Duration) {
        wait_until(
            within,
            Duration::from_millis(100),
            "the ZooKeeper ensemble formed no quorum",
            || {
                let serving = self
                    .servers
                    .iter()
                    .filter(|s| s.child.is_running())
                    .all(|s| {
                        four_letter_word(s.client_port, "srvr").is_some_and(|answer| {
                            answer.lines().any(|l| {
                                l == "Mode: leader"
                                    || l == "Mode: follower"
                                    || l == "Mode: standalone"
                            })
                        })
                    });
                (serving && (self.servers.len() == 1 || self.leader().is_some())).then_some(())
            },
        );
    }

    /// Kills server `index` (SIGKILL), keeping its data.
    pub fn kill(&mut self, index: usize) {
        self.servers[index].child.kill();
    }

    /// Starts server `index` again on its ports and data, and waits until it serves in the
    /// quorum again.
    ///
    /// # Panics
    /// It did not within 60 s.
    pub fn restart(&mut self, index: usize) {
        self.kill(index);
        self.spawn(index);
        self.wait_for_quorum(Duration::from_secs(60));
    }

    /// Freezes server `index` (SIGSTOP): its connections stay open and silent.
    pub fn freeze(&self, index: usize) {
        self.servers[index].child.freeze();
    }

    /// Resumes a frozen server (SIGCONT).
    pub fn thaw(&self, index: usize) {
        self.servers[index].child.thaw();
    }
}
