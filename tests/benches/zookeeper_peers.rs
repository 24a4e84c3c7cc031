//! The ZooKeeper lock beside the recipes ZooKeeper's users run: Apache Curator's `LeaderLatch`
//! (Java; Debian's `libcurator-recipes-java`, 5.4) and kazoo's `Election` (Python; Debian's
//! `python3-kazoo`, 2.8), two replicas of each on one three-server ensemble of the bench's own
//! (Debian's `zookeeperd`, 3.8, default `tickTime`).
//!
//! ```text
//! cargo bench -p leader-tests --bench zookeeper_peers            # 3 kills per contender
//! ROUNDS=5 WINDOW_S=30 cargo bench -p leader-tests --bench zookeeper_peers
//! ```
//!
//! - **Failover after SIGKILL**: the leading replica is killed; from the kill to the other
//!   replica's `LEADING` line (ours: `leader run`, whose COMMAND prints it when its term
//!   starts).
//! - **Requests a second** in steady state, leader and follower together, as the servers count
//!   them (`stat`'s `Received`), over `WINDOW_S` seconds (default 20).
//!
//! Each contender runs with its own defaults (Curator asks for a 60 s session, which the
//! ensemble grants as its maximum, 40 s; kazoo asks for 10 s; ours leases for 15 s, renews
//! within 10 s every 2 s, on a 30 s session), then all with one session timeout of 10 s (ours
//! with a lease of 10 s, a renew deadline of 7 s and a retry period of 2 s).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use leader_test_support::zookeeper_ensemble::ZooKeeperEnsemble;

const PEERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/peers");
const CURATOR_JARS: [&str; 4] = [
    "/usr/share/java/curator-recipes.jar",
    "/usr/share/java/curator-framework.jar",
    "/usr/share/java/curator-client.jar",
    "/usr/share/java/zookeeper.jar",
];
/// Debian's Python, which has `python3-kazoo` (another `python3` may come first on PATH).
const DEBIAN_PYTHON: &str = "/usr/bin/python3";

/// A replica: its process and the times of its output lines.
struct Replica {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
}

impl Replica {
    fn start(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a replica");
        let stdout = child.stdout.take().expect("stdout");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send((Instant::now(), line)).is_err() {
                    return;
                }
            }
        });
        Self { child, lines }
    }

    /// When it printed `LEADING`, waiting at most `within`.
    fn leading(&self, within: Duration) -> Option<Instant> {
        let until = Instant::now() + within;
        loop {
            let left = until.checked_duration_since(Instant::now())?;
            match self.lines.recv_timeout(left) {
                Ok((at, line)) if line.trim() == "LEADING" => return Some(at),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Makes the command of a replica: `(connect string, election, identity)`.
type Starter = Box<dyn Fn(&str, &str, &str) -> Command>;

/// One contender: how it starts a replica on an election, its settings for the table.
struct Contender {
    name: &'static str,
    settings: String,
    start: Starter,
}

fn ours(
    leader: PathBuf,
    session: Duration,
    lease: Duration,
    renew: Duration,
    retry: Duration,
) -> Contender {
    Contender {
        name: "ours (leader run)",
        settings: format!(
            "session {}, lease {}, renew deadline {}, retry {}",
            secs(session),
            secs(lease),
            secs(renew),
            secs(retry)
        ),
        start: Box::new(move |connect, election, identity| {
            let mut command = Command::new(&leader);
            command
                .args(["run", "--lock"])
                .arg(format!(
                    "zk://{connect}?prefix=/peers-ours&session_timeout={}ms",
                    session.as_millis()
                ))
                .args(["--name", election, "--identity", identity])
                .args(["--lease-duration", &format!("{}ms", lease.as_millis())])
                .args(["--renew-deadline", &format!("{}ms", renew.as_millis())])
                .args(["--retry-period", &format!("{}ms", retry.as_millis())])
                .args(["--", "sh", "-c", "echo LEADING; exec sleep 100000"]);
            command
        }),
    }
}

fn curator(classes: PathBuf, session: Duration) -> Contender {
    Contender {
        name: "Curator LeaderLatch",
        settings: format!("session {} asked", secs(session)),
        start: Box::new(move |connect, election, identity| {
            let mut classpath = vec![classes.display().to_string()];
            classpath.extend(CURATOR_JARS.iter().map(|j| (*j).to_owned()));
            classpath.push("/usr/share/java/slf4j-nop.jar".to_owned());
            let mut command = Command::new("java");
            command
                .args([
                    "-Xmx128m",
                    "-cp",
                    &classpath.join(":"),
                    "CuratorLatch",
                    connect,
                ])
                .arg(session.as_millis().to_string())
                .arg(format!("/peers-curator/{election}"))
                .arg(identity);
            command
        }),
    }
}

fn kazoo(session: Duration) -> Contender {
    Contender {
        name: "kazoo Election",
        settings: format!("session {}", secs(session)),
        start: Box::new(move |connect, election, identity| {
            let mut command = Command::new(DEBIAN_PYTHON);
            command
                .arg(Path::new(PEERS).join("kazoo_election.py"))
                .arg(connect)
                .arg(session.as_secs_f64().to_string())
                .arg(format!("/peers-kazoo/{election}"))
                .arg(identity);
            command
        }),
    }
}

fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// Compiles `CuratorLatch.java` into a temporary directory, or says why not.
fn compile_curator() -> Result<PathBuf, String> {
    if let Some(missing) = CURATOR_JARS.iter().find(|j| !Path::new(j).is_file()) {
        return Err(format!("{missing} is missing (libcurator-recipes-java)"));
    }
    let dir = std::env::temp_dir().join(format!("leader-curator-{:08x}", fastrand::u32(..)));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let status = Command::new("javac")
        .args(["-cp", &CURATOR_JARS.join(":"), "-d"])
        .arg(&dir)
        .arg(Path::new(PEERS).join("CuratorLatch.java"))
        .status()
        .map_err(|e| format!("javac: {e}"))?;
    status
        .success()
        .then_some(dir)
        .ok_or_else(|| "javac failed".to_owned())
}

fn main() {
    let rounds: usize = common::knob("ROUNDS", 3);
    let window = Duration::from_secs(common::knob("WINDOW_S", 20));
    let Some(ensemble) = ZooKeeperEnsemble::start() else {
        return;
    };
    let connect = ensemble.connect_string();
    let leader = leader_tests::programs!().leader;
    let classes = compile_curator();
    let kazoo_there = Command::new(DEBIAN_PYTHON)
        .args(["-c", "import kazoo"])
        .status()
        .is_ok_and(|s| s.success());
    let s = Duration::from_secs;
    let mut contenders = vec![ours(leader.clone(), s(30), s(15), s(10), s(2))];
    match &classes {
        Ok(classes) => contenders.push(curator(classes.clone(), s(60))),
        Err(why) => eprintln!("Curator left out: {why}"),
    }
    if kazoo_there {
        contenders.push(kazoo(s(10)));
    } else {
        eprintln!("kazoo left out: {DEBIAN_PYTHON} has no kazoo (python3-kazoo)");
    }
    // A 10 s lease needs a session of 14 s: the lease plus the client's connection timeout.
    contenders.push(ours(leader, s(14), s(10), s(7), s(2)));
    if let Ok(classes) = &classes {
        contenders.push(curator(classes.clone(), s(10)));
    }

    println!(
        "| contender | settings | failover after SIGKILL (each) | requests/s, leader and follower |"
    );
    println!("|---|---|---|---|");
    for (n, contender) in contenders.iter().enumerate() {
        let mut failovers = Vec::new();
        let mut rates = Vec::new();
        for round in 0..rounds {
            let election = format!("e{n}-{round}-{:08x}", fastrand::u32(..));
            let first = Replica::start((contender.start)(&connect, &election, "a"));
            if first.leading(Duration::from_secs(60)).is_none() {
                eprintln!("{}: the first replica never led", contender.name);
                break;
            }
            let mut first = first;
            let second = Replica::start((contender.start)(&connect, &election, "b"));
            // The follower is up and watching.
            std::thread::sleep(Duration::from_secs(5));
            let count = ensemble.count_requests();
            std::thread::sleep(window);
            rates.push(ensemble.requests(&count) as f64 / window.as_secs_f64());
            let killed = Instant::now();
            first.kill();
            match second.leading(Duration::from_secs(120)) {
                Some(at) => failovers.push(at.duration_since(killed)),
                None => eprintln!("{}: nobody led within 120 s of the kill", contender.name),
            }
        }
        let each: Vec<String> = failovers
            .iter()
            .map(|d| format!("{:.1} s", d.as_secs_f64()))
            .collect();
        let rate = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
        println!(
            "| {} | {} | {} | {rate:.2} |",
            contender.name,
            contender.settings,
            each.join(", ")
        );
    }
    if let Ok(classes) = classes {
        let _ = std::fs::remove_dir_all(classes);
    }
}
