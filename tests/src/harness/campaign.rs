//! A fault campaign: N replicas of `leader run -- fenced-writer` against one backend (on
//! Kubernetes, some of them may be another project's client), faults injected into whichever
//! replica leads or into the server they share, and a checker over what happened.
//!
//! Every replica's COMMAND (`fenced-writer`) logs when it starts and stops with `CLOCK_MONOTONIC`
//! nanoseconds: one clock on one machine, so intervals from different processes compare exactly.
//! Where a COMMAND cannot log its end (its `leader` was SIGKILLed, so it was killed too) the
//! harness takes the moment it saw the process gone, an upper bound. A frozen leader's term ends,
//! for the overlap check, when the harness froze it; what it does after it is resumed is the
//! fence's business: its writes must be refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::sleep;

use super::Programs;
use super::checker::{self, Marks, Term};
use super::outage::{failed_attempts, free_port};
use super::proxy::{Mode, Proxy};
pub use super::report::Report;
use super::servers::{PrivateServer, ServerError, ServerKind};
use crate::{TermEvent as Event, now_ns, term_events as events};
use leader_test_support::etcd_cluster::EtcdCluster;

/// The backend the replicas elect on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Backend {
    /// `file://`: a lock file in a temporary directory (process faults only).
    File,
    /// `postgres://`: the table lock on a private Postgres.
    Postgres,
    /// `postgres://...?advisory=true`: the advisory lock on a private Postgres, with an idle
    /// session timeout of [`Settings::advisory_idle`].
    Advisory,
    /// `mysql://`: the table lock on a private MariaDB.
    Mysql,
    /// `mysql://...?lock=named`: the `GET_LOCK` lock on a private MariaDB.
    MysqlNamed,
    /// `nats://`: a key-value bucket on a private NATS server with JetStream.
    Nats,
    /// `redis://`: a private Redis.
    Redis,
    /// `etcd://`: a private etcd.
    Etcd,
    /// `etcd://` with three members: a private three-member etcd cluster, each member behind a
    /// proxy of its own that every replica goes through, so that one member can be killed,
    /// frozen or cut off from the replicas while the others serve.
    EtcdCluster,
    /// `kubernetes://`: a Lease on a private test API server (`kube-api-server`), each replica
    /// with a kubeconfig of its own that points at its proxy.
    Kubernetes,
    /// `consul://`: a key locked by a session on a private test Consul server
    /// (`consul-api-server`).
    Consul,
    /// `s3://`: an object written with preconditions on a private S3 API server (moto's).
    ObjectStore,
}

impl Backend {
    /// Every backend, in the order reports list them.
    pub const ALL: [Self; 12] = [
        Self::File,
        Self::Postgres,
        Self::Advisory,
        Self::Mysql,
        Self::MysqlNamed,
        Self::Nats,
        Self::Redis,
        Self::Etcd,
        Self::EtcdCluster,
        Self::Kubernetes,
        Self::Consul,
        Self::ObjectStore,
    ];

    /// The faults that apply: the network and server faults need a server.
    #[must_use]
    pub fn faults(self) -> &'static [Fault] {
        match self {
            Self::File => &[Fault::Kill, Fault::Freeze, Fault::FreezeInOperation],
            // Faults of one member, and of the leader (which must still fail over).
            Self::EtcdCluster => &[
                Fault::Kill,
                Fault::Freeze,
                Fault::MemberKill,
                Fault::MemberFreeze,
                Fault::MemberCut,
            ],
            // An object store does not lose what it acknowledged when it restarts, and moto
            // keeps nothing on disk to play that with: no server restart.
            Self::ObjectStore => &[
                Fault::Kill,
                Fault::Freeze,
                Fault::Cut,
                Fault::Latency,
                Fault::ServerFreeze,
                Fault::Outage,
            ],
            _ => &[
                Fault::Kill,
                Fault::Freeze,
                Fault::Cut,
                Fault::Latency,
                Fault::Restart,
                Fault::ServerFreeze,
                Fault::Outage,
            ],
        }
    }

    /// A private server of this backend's kind, started off the runtime; none for the file lock.
    pub(crate) async fn start_server(
        self,
        programs: &Programs,
    ) -> Result<Option<PrivateServer>, HarnessError> {
        let Some(kind) = self.server() else {
            return Ok(None);
        };
        let program = match kind {
            ServerKind::Consul => programs.consul_api_server.clone(),
            _ => programs.kube_api_server.clone(),
        };
        let server =
            tokio::task::spawn_blocking(move || PrivateServer::start(kind, Some(&program)))
                .await
                .expect("server task")?;
        Ok(Some(server))
    }

    /// The `--lock` URL of a replica that reaches the server at `port` (a proxy, usually), and
    /// the environment it needs: for Kubernetes a `KUBECONFIG` for that port, written into
    /// `dir`; for object storage the endpoint and credentials. The file lock's directory is
    /// `dir/lock`.
    fn replica_url(
        self,
        dir: &Path,
        port: u16,
        settings: &Settings,
    ) -> Result<(String, Vec<(String, String)>), HarnessError> {
        let url = match self {
            Self::File => format!("file://{}", dir.join("lock").display()),
            Self::Postgres => format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            Self::Advisory => format!(
                "postgres://postgres@127.0.0.1:{port}/postgres?advisory=true&idle_session_timeout={}ms",
                settings.advisory_idle().as_millis()
            ),
            Self::Mysql => format!("mysql://root@127.0.0.1:{port}/leader"),
            Self::MysqlNamed => format!(
                "mysql://root@127.0.0.1:{port}/leader?lock=named&idle_session_timeout={}s",
                whole_seconds(settings.advisory_idle()).max(1)
            ),
            Self::Nats => format!("nats://127.0.0.1:{port}/fault"),
            Self::Redis => format!("redis://127.0.0.1:{port}"),
            Self::Etcd => format!("etcd://127.0.0.1:{port}"),
            // `port` is the first member's proxy; the others' follow (see `run`). A member
            // that does not answer is given up after a quarter of the renew deadline.
            Self::EtcdCluster => {
                let hosts: Vec<String> =
                    (0..3).map(|i| format!("127.0.0.1:{}", port + i)).collect();
                format!(
                    "etcd://{}/?member_timeout={}ms",
                    hosts.join(","),
                    (settings.renew / 4).as_millis()
                )
            }
            Self::Consul => format!("consul://127.0.0.1:{port}/fault/"),
            Self::ObjectStore => {
                let env = leader_test_support::s3_env_at(&format!("http://127.0.0.1:{port}"));
                return Ok((format!("s3://{FAULT_BUCKET}/fault/"), env));
            }
            Self::Kubernetes => {
                let path = dir.join(format!("kubeconfig-{port}"));
                let config = leader_test_support::kube_api::kubeconfig(
                    &format!("http://127.0.0.1:{port}"),
                    "default",
                );
                std::fs::write(&path, config).map_err(|source| HarnessError::Io {
                    what: format!("writing {}", path.display()),
                    source,
                })?;
                return Ok((
                    "kubernetes://default".to_owned(),
                    vec![("KUBECONFIG".to_owned(), path.display().to_string())],
                ));
            }
        };
        Ok((url, Vec::new()))
    }

    /// [`replica_url`](Self::replica_url), checked by the backend's own parser, as the `leader`
    /// command will parse it.
    pub(crate) fn replica_lock(
        self,
        dir: &Path,
        port: u16,
        settings: &Settings,
    ) -> Result<(String, Vec<(String, String)>), HarnessError> {
        let (url, env) = self.replica_url(dir, port, settings)?;
        leader::LockUrl::parse(&url)?;
        Ok((url, env))
    }

    fn server(self) -> Option<ServerKind> {
        match self {
            Self::File => None,
            Self::Postgres | Self::Advisory => Some(ServerKind::Postgres),
            Self::Mysql | Self::MysqlNamed => Some(ServerKind::Mysql),
            Self::Nats => Some(ServerKind::Nats),
            Self::Redis => Some(ServerKind::Redis),
            Self::Etcd => Some(ServerKind::Etcd),
            // Started by `run`, as a cluster.
            Self::EtcdCluster => None,
            Self::Kubernetes => Some(ServerKind::Kube),
            Self::Consul => Some(ServerKind::Consul),
            Self::ObjectStore => Some(ServerKind::S3),
        }
    }

    /// Lower-case name, as in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Postgres => "postgres",
            Self::Advisory => "postgres advisory",
            Self::Mysql => "mysql",
            Self::MysqlNamed => "mysql GET_LOCK",
            Self::Nats => "nats",
            Self::Redis => "redis",
            Self::Etcd => "etcd",
            Self::EtcdCluster => "etcd (three members)",
            Self::Kubernetes => "kubernetes",
            Self::Consul => "consul",
            Self::ObjectStore => "object store (s3)",
        }
    }
}

/// A fault, injected into the replica that leads at the time (or, for the server faults, into
/// the server they all use).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// SIGKILL of its `leader` process (its COMMAND dies with it); the replica is started again
    /// under a new identity once another leads.
    Kill,
    /// SIGSTOP of `leader` and COMMAND for longer than the lease, then SIGCONT (COMMAND first,
    /// so that it may write before its `leader` can stop it).
    Freeze,
    /// Its connection to the backend cut (the proxy forwards nothing) until another leads, then
    /// restored with the held bytes delivered late: a partition of the leader alone, while the
    /// others still reach the server.
    Cut,
    /// Every byte between it and the backend held for twice the renew deadline, until another
    /// leads.
    Latency,
    /// The backend server crashed, down for one lease duration, and started again on its data.
    Restart,
    /// The backend server frozen (SIGSTOP of all its processes) for one lease duration, its
    /// connections open and silent, then resumed (SIGCONT).
    ServerFreeze,
    /// Every replica's connection to the backend closed, and every new one refused, for
    /// [`Settings::outage`]: a full outage. The replicas' failed attempts a second are measured
    /// meanwhile (S9).
    Outage,
    /// For the file lock: its `leader` stopped inside a write of the record, by a SIGSTOP that
    /// `strace` injects at one of the write's system calls (after the temporary file's `fsync`,
    /// before the link; after the `link`, before the check for a newer version; at the first
    /// `unlink`), and its COMMAND with it; resumed as [`Fault::Freeze`] is.
    FreezeInOperation,
    /// One member of a three-member etcd cluster killed (SIGKILL) for a renew deadline and a
    /// second, then started again on its data: the member the leader talks to, or the raft
    /// leader, or another, in turn. The leader must keep its term.
    MemberKill,
    /// One member frozen (SIGSTOP) for a renew deadline and a second, its connections open and
    /// silent, then resumed. The leader must keep its term.
    MemberFreeze,
    /// One member cut off from every replica (its proxy forwards nothing) for a renew deadline
    /// and a second, then reachable again. The leader must keep its term.
    MemberCut,
}

impl Fault {
    /// Every fault, in the order a round injects them.
    pub const ALL: [Self; 11] = [
        Self::Kill,
        Self::Freeze,
        Self::Cut,
        Self::Latency,
        Self::Restart,
        Self::ServerFreeze,
        Self::Outage,
        Self::FreezeInOperation,
        Self::MemberKill,
        Self::MemberFreeze,
        Self::MemberCut,
    ];

    /// Lower-case name, as in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "sigkill",
            Self::Freeze => "sigstop",
            Self::Cut => "network cut",
            Self::Latency => "latency spike",
            Self::Restart => "server restart",
            Self::ServerFreeze => "server frozen",
            Self::Outage => "full outage",
            Self::FreezeInOperation => "sigstop in an operation",
            Self::MemberKill => "member killed",
            Self::MemberFreeze => "member frozen",
            Self::MemberCut => "member cut off",
        }
    }

    /// Whether it is a fault of one member of a cluster, which must cost the leader nothing.
    #[must_use]
    pub fn of_a_member(self) -> bool {
        matches!(
            self,
            Self::MemberKill | Self::MemberFreeze | Self::MemberCut
        )
    }

    /// Whether the fault is timed from its end (the server back, the outage over) rather than
    /// from its injection.
    fn timed_from_its_end(self) -> bool {
        matches!(self, Self::Restart | Self::ServerFreeze | Self::Outage)
    }
}

/// Timing of the replicas and how many there are.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// `--lease-duration`.
    pub lease: Duration,
    /// `--renew-deadline`.
    pub renew: Duration,
    /// `--retry-period`.
    pub retry: Duration,
    /// Number of replicas.
    pub replicas: usize,
    /// How many of the replicas are another project's client instead of `leader run` (the last
    /// ones): kubert claimants, on [`Backend::Kubernetes`] only, with a lease of whole seconds.
    pub peers: usize,
    /// How long a [`Fault::Outage`] lasts.
    pub outage: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        let lease = Duration::from_secs(2);
        Self {
            lease,
            renew: Duration::from_millis(1500),
            retry: Duration::from_millis(250),
            replicas: 3,
            peers: 0,
            outage: lease * 3,
        }
    }
}

impl Settings {
    /// The advisory lock's idle session timeout: how long the server keeps the session (and
    /// its advisory lock) of a holder that went silent. Twice the lease: well above the
    /// holder's longest gap between requests (a retry period and its jitter).
    #[must_use]
    pub fn advisory_idle(&self) -> Duration {
        self.lease * 2
    }

    /// The promised bound on the time from a fault (for a server restart or freeze, from the
    /// server being back; for an outage, from its end) to the next leader's COMMAND starting:
    /// a lease and two retry periods, plus a generous margin for a loaded machine (one second;
    /// three when the server was away, for clients to reconnect). After an outage, add the
    /// longest back-off (a lease). On the advisory lock and the MySQL `GET_LOCK` lock, a leader
    /// that went silent (frozen, cut off, slowed down, or its server frozen) keeps its session
    /// until the idle session timeout ends it. On etcd the lease is whole seconds (the lock rounds it up), at least
    /// etcd's minimum TTL (2 s with its default election timeout: a 1 s grant is answered with
    /// 2 s), and etcd revokes expired leases every 500 ms. On Consul the holder's renewals are
    /// writes of its renewal key, and candidates take over a lease after the last one they read,
    /// as on any lock renewed by writes. Under a latency spike the leader's last renewal,
    /// sent up to a renew deadline after its last success, reaches the server twice the renew
    /// deadline late and extends the lease from there: the server cannot tell a late request
    /// from a new one.
    #[must_use]
    pub fn recovery_bound(&self, backend: Backend, fault: Fault) -> Duration {
        let margin = if fault.timed_from_its_end() {
            Duration::from_secs(3)
        } else {
            Duration::from_secs(1)
        };
        let lease = match backend {
            Backend::Etcd | Backend::EtcdCluster => {
                Duration::from_secs(whole_seconds(self.lease).max(2)) + Duration::from_millis(500)
            }
            _ => self.lease,
        };
        let mut bound = lease + self.retry * 2 + margin;
        if fault == Fault::Outage {
            bound += self.lease;
        }
        if fault == Fault::Latency {
            bound += self.renew * 3;
        }
        if matches!(backend, Backend::Advisory | Backend::MysqlNamed)
            && matches!(
                fault,
                Fault::Freeze | Fault::Cut | Fault::Latency | Fault::ServerFreeze
            )
        {
            // MySQL counts its idle session timeout in whole seconds.
            bound += match backend {
                Backend::MysqlNamed => {
                    Duration::from_secs(whole_seconds(self.advisory_idle()).max(1))
                }
                _ => self.advisory_idle(),
            };
        }
        bound
    }
}

/// The bucket of a private S3 server ([`ServerKind::S3`] makes it when it starts).
pub const FAULT_BUCKET: &str = "leader-fault";

/// `lease` rounded up to whole seconds.
fn whole_seconds(lease: Duration) -> u64 {
    u64::try_from(lease.as_millis().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// What could not be set up (as opposed to what went wrong under faults, which a [`Report`]
/// lists).
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A private server did not start.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// The fenced sink's Postgres.
    #[error("fenced sink at {url}: {source}")]
    Sink {
        /// Redacted connection string.
        url: String,
        /// The driver's error.
        source: tokio_postgres::Error,
    },
    /// Spawning a process or a proxy.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// Settings the campaign cannot run with.
    #[error("{0}")]
    Settings(String),
    /// A replica's lock URL that its backend does not take.
    #[error(transparent)]
    LockUrl(#[from] leader::LockUrlError),
}

/// The state letter of `/proc/PID/stat` (R, S, T, Z, ...); `None` once the process is gone.
fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Gone, or a zombie nobody reaped yet: it runs no more code either way.
pub(crate) fn process_gone(pid: i32) -> bool {
    matches!(process_state(pid), None | Some('Z' | 'X'))
}

pub(crate) fn process_stopped(pid: i32) -> bool {
    process_state(pid) == Some('T')
}

/// Watches the COMMANDs of the terms in the log at `log` every 5 ms: a term whose process is
/// gone without a `stop` line (SIGKILLed by its `leader` after the grace, say) is marked in
/// `gone` when it was seen gone, which is never earlier than it died. The log is read from
/// where the last look ended.
pub fn watch_commands(log: PathBuf, gone: Arc<StdMutex<Marks>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        use std::io::{Read, Seek, SeekFrom};
        let mut open: BTreeMap<(String, u64), i32> = BTreeMap::new();
        let mut offset = 0;
        let mut pending = String::new();
        loop {
            if let Ok(mut file) = std::fs::File::open(&log)
                && file.seek(SeekFrom::Start(offset)).is_ok()
            {
                let mut fresh = String::new();
                if let Ok(read) = file.read_to_string(&mut fresh) {
                    offset += read as u64;
                    pending.push_str(&fresh);
                }
            }
            // Complete lines only; a line being written stays for the next look.
            while let Some(end) = pending.find('\n') {
                let line: String = pending.drain(..=end).collect();
                let Some(event) = Event::parse(line.trim_end()) else {
                    continue;
                };
                let key = (event.identity, event.token);
                match (event.start, event.pid) {
                    (true, Some(pid)) => {
                        open.insert(key, pid);
                    }
                    (false, _) => {
                        open.remove(&key);
                    }
                    (true, None) => {}
                }
            }
            open.retain(|key, pid| {
                if !process_gone(*pid) {
                    return true;
                }
                gone.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .entry(key.clone())
                    .or_insert_with(now_ns);
                false
            });
            sleep(Duration::from_millis(5)).await;
        }
    })
}

/// Calls `check` every `every` until it returns something; `None` after `within`.
pub(crate) async fn poll<T>(
    within: Duration,
    every: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Option<T> {
    tokio::time::timeout(within, async {
        loop {
            if let Some(found) = check() {
                return found;
            }
            sleep(every).await;
        }
    })
    .await
    .ok()
}

/// From `earlier` to `later` (both [`now_ns`]), zero if `later` is not later.
fn between(earlier: i128, later: i128) -> Duration {
    Duration::from_nanos(u64::try_from(later - earlier).unwrap_or(0))
}

/// The process group `leader` runs COMMAND in: its supervisor's, its only child. A peer's
/// replica has none.
pub(crate) fn command_group(leader_pid: u32) -> Option<Pid> {
    std::fs::read_to_string(format!("/proc/{leader_pid}/task/{leader_pid}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
        .map(Pid::from_raw)
}

/// The fenced sink's connection to the Postgres of `url`, and what turns its errors into the
/// harness's (the URL without its password).
pub(crate) async fn connect_sink(
    url: &str,
) -> Result<
    (
        tokio_postgres::Client,
        impl Fn(tokio_postgres::Error) -> HarnessError + Clone,
    ),
    HarnessError,
> {
    let redacted = leader_core::redact_url(url);
    let sink_error = move |source| HarnessError::Sink {
        url: redacted.clone(),
        source,
    };
    let (sink, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(sink_error.clone())?;
    tokio::spawn(connection);
    Ok((sink, sink_error))
}

/// Asks every replica to stop (SIGTERM) and waits up to ten seconds for each.
pub(crate) async fn stop_replicas(replicas: &mut [(String, tokio::process::Child)]) {
    for (_, child) in replicas.iter() {
        if let Some(pid) = child.id() {
            let _ = kill(Pid::from_raw(pid.cast_signed()), Signal::SIGTERM);
        }
    }
    for (_, child) in replicas.iter_mut() {
        let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    }
}

/// The fenced sink's writes (`columns` of `PREFIX_writes`, in the order written), and its
/// tables dropped, over a connection of its own: the run's may not have lasted the hour a long
/// run takes (a restart of the sink's server, for one, ends it).
pub(crate) async fn drain_sink(
    sink_url: &str,
    prefix: &str,
    columns: &str,
) -> Result<Vec<tokio_postgres::Row>, HarnessError> {
    let (sink, sink_error) = connect_sink(sink_url).await?;
    let rows = sink
        .query(
            &format!("SELECT {columns} FROM {prefix}_writes ORDER BY seq"),
            &[],
        )
        .await
        .map_err(&sink_error)?;
    sink.batch_execute(&format!(
        "DROP TABLE {prefix}_mark; DROP TABLE {prefix}_writes;"
    ))
    .await
    .map_err(&sink_error)?;
    Ok(rows)
}

/// Crashes the private server, waits `down`, and starts it again; returns when it started
/// again (`CLOCK_MONOTONIC` ns).
pub(crate) async fn crash_and_restart(
    server: &mut Option<PrivateServer>,
    down: Duration,
) -> Result<i128, HarnessError> {
    let mut taken = server.take();
    let (taken, restarted) = tokio::task::spawn_blocking(move || {
        let mut restarted = now_ns();
        if let Some(server) = taken.as_mut() {
            server.kill();
            std::thread::sleep(down);
            restarted = now_ns();
            server.restart()?;
        }
        Ok::<_, ServerError>((taken, restarted))
    })
    .await
    .expect("restart task")?;
    *server = taken;
    Ok(restarted)
}

/// The process groups `leader` runs its COMMANDs in (with `--shards`, one per shard): its
/// children, each a supervisor leading a group of its own.
pub(crate) fn command_groups(leader_pid: u32) -> Vec<Pid> {
    std::fs::read_to_string(format!("/proc/{leader_pid}/task/{leader_pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|pid| pid.parse().ok())
        .map(Pid::from_raw)
        .collect()
}

/// Stops the `leader` process `pid` inside its next write of a file lock record: `strace`
/// attaches, delivers SIGSTOP at one of the write's system calls (chosen at random) and is
/// ended, leaving the process stopped (a tracee in group-stop stays stopped when its tracer
/// goes). Within two seconds, or the plain SIGSTOP that follows does it.
async fn stop_inside_a_write(pid: Pid) -> Result<(), HarnessError> {
    // After the temporary file is synced (before the link), after the link (before the check
    // for a newer version), after the temporary file is removed (before old versions are); the
    // signal is delivered as the system call returns.
    let call = ["fsync", "link,linkat", "unlink,unlinkat"][fastrand::usize(..3)];
    let mut strace = Command::new("strace")
        .args(["-f", "-qq", "-o", "/dev/null", "-p"])
        .arg(pid.as_raw().to_string())
        .args(["-e", &format!("trace={call}")])
        .args(["-e", &format!("inject={call}:signal=SIGSTOP:when=1")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| HarnessError::Io {
            what: "running strace (Debian's strace package; scripts/setup installs it)".into(),
            source,
        })?;
    // Stopped while traced shows as `t`.
    let _ = poll(Duration::from_secs(2), Duration::from_millis(1), || {
        matches!(process_state(pid.as_raw()), Some('t' | 'T')).then_some(())
    })
    .await;
    let _ = strace.kill().await;
    Ok(())
}

/// Whether an identity is a peer's (another project's client): they are named `k...`.
fn is_peer(identity: &str) -> bool {
    identity.starts_with('k')
}

struct Replica {
    identity: String,
    child: Child,
    /// Its `--metrics-addr`; peers have none.
    metrics: Option<String>,
}

impl Replica {
    fn pid(&self) -> Option<Pid> {
        self.child.id().map(|id| Pid::from_raw(id.cast_signed()))
    }
}

struct Run<'a> {
    backend: Backend,
    settings: Settings,
    programs: &'a Programs,
    name: String,
    log: PathBuf,
    sink_url: String,
    sink_prefix: String,
    dir: PathBuf,
    server: Option<PrivateServer>,
    proxies: Vec<Proxy>,
    /// The three-member etcd cluster of [`Backend::EtcdCluster`], and a proxy per member
    /// (which every replica goes through).
    cluster: Option<Arc<StdMutex<EtcdCluster>>>,
    member_proxies: Vec<Proxy>,
    /// Member faults so far, to pick the next member.
    member_faults: usize,
    replicas: Vec<Replica>,
    incarnations: Vec<usize>,
    /// (identity, token) of a killed term -> when the harness saw its COMMAND gone.
    killed: Marks,
    /// (identity, token) of a term whose COMMAND is gone with no `stop` line -> when
    /// [`watch_commands`] saw it gone.
    gone: Arc<StdMutex<Marks>>,
    /// The task behind `gone`.
    watcher: tokio::task::JoinHandle<()>,
    /// (identity, token) of a frozen term -> when it was frozen. A resumed replica may lead
    /// again later, in a term of its own.
    frozen: Marks,
    recoveries: Vec<(Fault, Option<Duration>)>,
    resumed_stops: Vec<Duration>,
    outage_rates: Vec<f64>,
    violations: Vec<String>,
}

impl Run<'_> {
    /// Records a violation, and says so at once: a long run shows what went wrong while it
    /// goes on.
    fn violate(&mut self, what: String) {
        eprintln!("{}: VIOLATION: {what}", self.backend.name());
        self.violations.push(what);
    }

    /// A replica started while its server was away exits at once with `leader`'s code for an
    /// unreachable backend at start (by design), where an orchestrator would start it again:
    /// so does the harness. Any other exit of its own is a violation.
    /// The terms [`watch_commands`] saw end without a `stop` line.
    fn gone(&self) -> std::sync::MutexGuard<'_, Marks> {
        self.gone
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn respawn_exited(&mut self) -> Result<(), HarnessError> {
        for slot in 0..self.replicas.len() {
            let Ok(Some(status)) = self.replicas[slot].child.try_wait() else {
                continue;
            };
            // The command's exit code for a backend it cannot reach at start (its README).
            if status.code() != Some(4) || is_peer(&self.replicas[slot].identity) {
                let identity = self.replicas[slot].identity.clone();
                self.violate(format!(
                    "{identity} exited by itself ({status}); run with FAULT_LOG=info to see why"
                ));
            }
            self.spawn(slot)?;
        }
        Ok(())
    }

    fn spawn(&mut self, slot: usize) -> Result<(), HarnessError> {
        self.incarnations[slot] += 1;
        let peer = slot >= self.settings.replicas - self.settings.peers;
        let identity = format!(
            "{}{slot}.{}",
            if peer { 'k' } else { 'r' },
            self.incarnations[slot]
        );
        let port = self
            .proxies
            .get(slot)
            .or_else(|| self.member_proxies.first())
            .map_or(0, Proxy::port);
        let spawned = |program: &Path, what: std::io::Result<Child>| {
            what.map_err(|source| HarnessError::Io {
                what: format!("spawning {}", program.display()),
                source,
            })
        };
        let replica = if peer {
            let program = &self.programs.kubert_claimant;
            let child = Command::new(program)
                .arg(format!("http://127.0.0.1:{port}"))
                .args(["default", &self.name, &identity])
                .arg(self.settings.lease.as_secs().to_string())
                .env("JOB_LOG", &self.log)
                .stdout(Stdio::null())
                .kill_on_drop(true)
                .spawn();
            Replica {
                identity,
                child: spawned(program, child)?,
                metrics: None,
            }
        } else {
            let (url, env) = self.backend.replica_lock(&self.dir, port, &self.settings)?;
            let metrics = format!("127.0.0.1:{}", free_port()?);
            let ms = |d: Duration| format!("{}ms", d.as_millis());
            let program = &self.programs.leader;
            let mut command = Command::new(program);
            command
                .args(["run", "--lock", &url, "--name", &self.name])
                .args(["--identity", &identity])
                .args(["--lease-duration", &ms(self.settings.lease)])
                .args(["--renew-deadline", &ms(self.settings.renew)])
                .args(["--retry-period", &ms(self.settings.retry)])
                .args(["--metrics-addr", &metrics])
                .arg("--")
                .arg(&self.programs.writer)
                .env("DATABASE_URL", &self.sink_url)
                .env("SINK", &self.sink_prefix)
                .env("JOB_LOG", &self.log)
                .env(
                    "RUST_LOG",
                    std::env::var("FAULT_LOG").unwrap_or_else(|_| "error".into()),
                )
                .stdout(Stdio::null())
                .kill_on_drop(true);
            command.envs(env);
            Replica {
                identity,
                child: spawned(program, command.spawn())?,
                metrics: Some(metrics),
            }
        };
        if slot < self.replicas.len() {
            self.replicas[slot] = replica;
        } else {
            self.replicas.push(replica);
        }
        Ok(())
    }

    /// The term running now (started, not stopped, not killed, not frozen), if any.
    fn current(&self) -> Option<Event> {
        let events = events(&self.log);
        let latest = events.iter().rfind(|e| e.start)?;
        let key = (latest.identity.clone(), latest.token);
        let over = events
            .iter()
            .any(|e| !e.start && e.identity == latest.identity && e.token == latest.token)
            || self.killed.contains_key(&key)
            || self.frozen.contains_key(&key)
            || self.gone().contains_key(&key);
        (!over).then(|| latest.clone())
    }

    /// Waits for a leader that has led for `settled` (so it has renewed and written).
    async fn settled_leader(&self, within: Duration) -> Option<(usize, Event)> {
        let settled = self.settings.lease / 2;
        poll(within, Duration::from_millis(20), || {
            let event = self.current()?;
            let slot = self
                .replicas
                .iter()
                .position(|r| r.identity == event.identity)?;
            (between(event.at, now_ns()) >= settled).then_some((slot, event))
        })
        .await
    }

    /// Waits for a COMMAND start after `since`; the time from `from` to it.
    async fn next_start(&self, since: i128, from: i128, within: Duration) -> Option<Duration> {
        poll(within, Duration::from_millis(5), || {
            let start = events(&self.log)
                .into_iter()
                .find(|e| e.start && e.at > since)?;
            Some(between(from, start.at))
        })
        .await
    }

    /// Each of our replicas' failed attempts so far, by slot (peers and replicas that do not
    /// answer have none).
    async fn failed_attempts(&self) -> Vec<Option<u64>> {
        let mut out = Vec::new();
        for replica in &self.replicas {
            out.push(match &replica.metrics {
                Some(addr) => failed_attempts(addr, &self.name).await,
                None => None,
            });
        }
        out
    }

    /// A full outage: every proxy down for [`Settings::outage`]; returns when it ended, and
    /// records the worst rate of failed attempts of one replica (S9: at most one attempt per
    /// retry period, and fewer as it backs off).
    async fn outage(&mut self) -> i128 {
        let before = self.failed_attempts().await;
        for proxy in &self.proxies {
            proxy.set(Mode::Down);
        }
        let began = tokio::time::Instant::now();
        sleep(self.settings.outage).await;
        let after = self.failed_attempts().await;
        let lasted = began.elapsed();
        for proxy in &self.proxies {
            proxy.set(Mode::Open);
        }
        let ended = now_ns();
        let limit = (lasted.as_secs_f64() / self.settings.retry.as_secs_f64()).floor() as u64 + 2;
        let mut worst = 0.0_f64;
        for (slot, (before, after)) in before.iter().zip(&after).enumerate() {
            let (Some(before), Some(after)) = (before, after) else {
                continue;
            };
            let failed = after.saturating_sub(*before);
            worst = worst.max(failed as f64 / lasted.as_secs_f64());
            if failed > limit {
                self.violate(format!(
                    "{}: {failed} failed attempts in a {lasted:?} outage, more than {limit}",
                    self.replicas[slot].identity
                ));
            }
        }
        self.outage_rates.push(worst);
        ended
    }

    async fn inject(&mut self, fault: Fault) -> Result<(), HarnessError> {
        self.respawn_exited()?;
        let Some((slot, term)) = self.settled_leader(Duration::from_secs(30)).await else {
            let log = events(&self.log);
            let recent: Vec<String> = log[log.len().saturating_sub(6)..]
                .iter()
                .map(|e| {
                    let what = if e.start { "start" } else { "stop" };
                    format!("{what} {} {}", e.identity, e.token)
                })
                .collect();
            self.violate(format!(
                "no leader before injecting {}; the log ends with {recent:?}",
                fault.name()
            ));
            return Ok(());
        };
        let bound = self.settings.recovery_bound(self.backend, fault);
        let Some(leader_pid) = self.replicas[slot].pid() else {
            self.violations
                .push(format!("{} exited by itself", term.identity));
            return Ok(());
        };
        if fault.of_a_member() {
            self.member_fault(fault, &term).await;
            return Ok(());
        }
        let group = command_group(leader_pid.as_raw().cast_unsigned());
        let mut from = now_ns();
        let since = from;
        match fault {
            Fault::Kill => {
                let _ = kill(leader_pid, Signal::SIGKILL);
                let _ = self.replicas[slot].child.wait().await;
                let gone = poll(Duration::from_secs(5), Duration::from_millis(1), || {
                    term.pid.is_none_or(process_gone).then_some(())
                });
                if gone.await.is_none() {
                    self.violate(format!(
                        "{}'s COMMAND outlived its SIGKILLed leader by 5 s",
                        term.identity
                    ));
                }
                self.killed
                    .insert((term.identity.clone(), term.token), now_ns());
            }
            Fault::Freeze | Fault::FreezeInOperation => {
                if fault == Fault::FreezeInOperation {
                    stop_inside_a_write(leader_pid).await?;
                }
                if let Some(group) = group {
                    let _ = killpg(group, Signal::SIGSTOP);
                }
                let _ = kill(leader_pid, Signal::SIGSTOP);
                let stopped = poll(Duration::from_secs(5), Duration::from_millis(1), || {
                    (process_stopped(leader_pid.as_raw()) && term.pid.is_none_or(process_stopped))
                        .then_some(())
                });
                if stopped.await.is_none() {
                    self.violations
                        .push(format!("{} could not be frozen", term.identity));
                }
                self.frozen
                    .insert((term.identity.clone(), term.token), now_ns());
            }
            Fault::Cut => self.proxies[slot].set(Mode::Cut),
            Fault::Latency => self.proxies[slot].set(Mode::Delay(self.settings.renew * 2)),
            Fault::Restart => {
                from = crash_and_restart(&mut self.server, self.settings.lease).await?;
            }
            Fault::ServerFreeze => {
                if let Some(server) = &self.server {
                    server.freeze();
                    sleep(self.settings.lease).await;
                    from = now_ns();
                    server.thaw();
                }
            }
            Fault::Outage => from = self.outage().await,
            Fault::MemberKill | Fault::MemberFreeze | Fault::MemberCut => {}
        }
        let recovery = self.next_start(since, from, bound * 3).await;
        match recovery {
            None => self.violate(format!(
                "{}: no new leader within {:?}",
                fault.name(),
                bound * 3
            )),
            Some(d) if d > bound => self.violate(format!(
                "{}: the next leader took {d:?}, over the bound {bound:?}",
                fault.name()
            )),
            Some(_) => {}
        }
        self.recoveries.push((fault, recovery));

        // Undo the fault.
        sleep(Duration::from_millis(300)).await; // the new leader writes meanwhile
        match fault {
            Fault::Kill => self.spawn(slot)?,
            Fault::Freeze | Fault::FreezeInOperation => {
                if let Some(group) = group {
                    let _ = killpg(group, Signal::SIGCONT);
                }
                sleep(Duration::from_millis(200)).await;
                let resumed = now_ns();
                let _ = kill(leader_pid, Signal::SIGCONT);
                // Its stop line, or its COMMAND seen gone (SIGKILLed after the grace).
                let key = (term.identity.clone(), term.token);
                let stopped = poll(Duration::from_secs(5), Duration::from_millis(2), || {
                    events(&self.log)
                        .into_iter()
                        .find(|e| !e.start && e.identity == term.identity && e.token == term.token)
                        .map(|stop| stop.at)
                        .or_else(|| self.gone().get(&key).copied())
                });
                match stopped.await {
                    Some(at) => self.resumed_stops.push(between(resumed, at)),
                    None => self.violate(format!(
                        "{} was resumed and its COMMAND still ran 5 s later",
                        term.identity
                    )),
                }
            }
            Fault::Cut | Fault::Latency => self.proxies[slot].set(Mode::Open),
            Fault::Restart
            | Fault::ServerFreeze
            | Fault::Outage
            | Fault::MemberKill
            | Fault::MemberFreeze
            | Fault::MemberCut => {}
        }
        Ok(())
    }

    /// A fault of one member of the cluster, while `term` leads: every other fault into the
    /// raft leader, the others into the members in turn. The fault lasts a renew deadline and a
    /// second; the term must still run a lease after the member is back, with no other term
    /// started. Recorded as a recovery of zero when it kept leading, `None` when it lost its
    /// term.
    async fn member_fault(&mut self, fault: Fault, term: &Event) {
        let Some(cluster) = self.cluster.clone() else {
            self.violate(format!("{}: no cluster", fault.name()));
            return;
        };
        self.member_faults += 1;
        let turn = self.member_faults;
        let member = tokio::task::spawn_blocking({
            let cluster = cluster.clone();
            move || {
                let cluster = cluster.lock().unwrap_or_else(|p| p.into_inner());
                if turn.is_multiple_of(2) {
                    cluster.wait_for_a_leader(Duration::from_secs(10))
                } else {
                    (turn / 2) % cluster.len()
                }
            }
        })
        .await
        .expect("cluster task");
        let on_cluster = |f: Box<dyn FnOnce(&mut EtcdCluster) + Send>| {
            let cluster = cluster.clone();
            tokio::task::spawn_blocking(move || {
                f(&mut cluster.lock().unwrap_or_else(|p| p.into_inner()));
            })
        };
        let since = now_ns();
        let lasts = self.settings.renew + Duration::from_secs(1);
        match fault {
            Fault::MemberKill => {
                let _ = on_cluster(Box::new(move |c| c.kill(member))).await;
                sleep(lasts).await;
                let _ = on_cluster(Box::new(move |c| c.restart(member))).await;
            }
            Fault::MemberFreeze => {
                let _ = on_cluster(Box::new(move |c| c.freeze(member))).await;
                sleep(lasts).await;
                let _ = on_cluster(Box::new(move |c| c.thaw(member))).await;
            }
            _ => {
                self.member_proxies[member].set(Mode::Cut);
                sleep(lasts).await;
                self.member_proxies[member].set(Mode::Open);
            }
        }
        // A member that is back can still cost a term (it catches up, its clients reconnect).
        sleep(self.settings.lease).await;
        let kept = self
            .current()
            .is_some_and(|now| now.identity == term.identity && now.token == term.token)
            && !events(&self.log).iter().any(|e| e.start && e.at > since);
        if kept {
            self.recoveries.push((fault, Some(Duration::ZERO)));
        } else {
            self.recoveries.push((fault, None));
            let which = if turn.is_multiple_of(2) {
                ", the raft leader"
            } else {
                ""
            };
            self.violate(format!(
                "{} (member {member}{which}): {} lost its term {}",
                fault.name(),
                term.identity,
                term.token
            ));
        }
        let _ = on_cluster(Box::new(|c| {
            c.wait_for_a_leader(Duration::from_secs(10));
        }))
        .await;
    }

    async fn stop_all(&mut self) {
        for replica in &mut self.replicas {
            if let Ok(Some(status)) = replica.child.try_wait()
                && !self
                    .killed
                    .keys()
                    .any(|(identity, _)| *identity == replica.identity)
            {
                self.violations.push(format!(
                    "{} exited by itself ({status}); run with FAULT_LOG=info to see why",
                    replica.identity
                ));
            }
            if let Some(pid) = replica.pid() {
                let _ = kill(pid, Signal::SIGTERM);
            }
        }
        for replica in &mut self.replicas {
            let _ = tokio::time::timeout(Duration::from_secs(10), replica.child.wait()).await;
        }
    }

    /// The overlap and token checks over the log (tokens among our replicas' terms only).
    fn check_terms(&mut self) -> (Vec<Term>, usize) {
        self.watcher.abort();
        // A COMMAND seen gone without a stop line ended when it was seen gone, like a killed
        // one: never earlier than it died.
        let gone = self.gone().clone();
        let terms = checker::terms_seen(&events(&self.log), &self.killed, &self.frozen, &gone);
        let (overlaps, violations) = checker::check_fenced(&terms, |t| !is_peer(&t.identity));
        self.violations.extend(violations);
        (terms, overlaps)
    }
}

/// A private three-member etcd cluster, and a proxy in front of each member on consecutive
/// ports (the replicas' lock URL names the first port; see [`Backend::replica_url`]).
async fn start_cluster() -> Result<(Option<Arc<StdMutex<EtcdCluster>>>, Vec<Proxy>), HarnessError> {
    let cluster = tokio::task::spawn_blocking(|| EtcdCluster::start(3))
        .await
        .expect("cluster task")
        .ok_or_else(|| HarnessError::Settings("no etcd binary for the cluster".to_owned()))?;
    // Consecutive ports: try a few bases until all three bind.
    for _ in 0..50 {
        let base = 20_000 + fastrand::u16(..40_000);
        let mut proxies = Vec::new();
        for (i, port) in (0..cluster.len()).map(|i| (i, cluster.client_port(i))) {
            let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let Ok(offset) = u16::try_from(i) else { break };
            match Proxy::start_on(base + offset, upstream).await {
                Ok(proxy) => proxies.push(proxy),
                Err(_) => break,
            }
        }
        if proxies.len() == cluster.len() {
            return Ok((Some(Arc::new(StdMutex::new(cluster))), proxies));
        }
    }
    Err(HarnessError::Settings(
        "no three consecutive free ports for the members' proxies".to_owned(),
    ))
}

/// A proxy on loopback in front of `server`.
pub(crate) async fn proxy_to(server: &PrivateServer) -> Result<Proxy, HarnessError> {
    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], server.port()));
    Proxy::start(upstream)
        .await
        .map_err(|source| HarnessError::Io {
            what: "proxy".into(),
            source,
        })
}

/// Runs one campaign: `faults` in order against `backend`, each into the replica leading at
/// the time. Needs the Postgres at `sink_url` for the fenced sink (tables of its own, dropped
/// at the end) and, for a server backend, that server's binaries.
///
/// # Errors
/// Something could not be set up; what goes wrong under the faults is in the [`Report`].
pub async fn run(
    backend: Backend,
    faults: &[Fault],
    settings: Settings,
    programs: &Programs,
    sink_url: &str,
) -> Result<Report, HarnessError> {
    if settings.peers > 0
        && (backend != Backend::Kubernetes
            || settings.peers >= settings.replicas
            || settings.lease.subsec_nanos() != 0)
    {
        return Err(HarnessError::Settings(format!(
            "peers run on Kubernetes only, beside at least one replica of ours, with a lease of whole seconds ({settings:?})"
        )));
    }
    let (sink, sink_error) = connect_sink(sink_url).await?;
    let tag = format!("{:08x}", fastrand::u32(..));
    let prefix = format!("fault_sink_{tag}");
    sink.batch_execute(&format!(
        "CREATE TABLE {prefix}_mark (token bigint NOT NULL);
         INSERT INTO {prefix}_mark VALUES (0);
         CREATE TABLE {prefix}_writes (seq bigserial PRIMARY KEY, token bigint NOT NULL,
             writer text NOT NULL, at bigint NOT NULL, accepted bool NOT NULL);"
    ))
    .await
    .map_err(&sink_error)?;

    let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
        what: "temporary directory".into(),
        source,
    })?;
    let server = backend.start_server(programs).await?;
    let mut proxies = Vec::new();
    if let Some(server) = &server {
        for _ in 0..settings.replicas {
            proxies.push(proxy_to(server).await?);
        }
    }
    let (cluster, member_proxies) = if backend == Backend::EtcdCluster {
        start_cluster().await?
    } else {
        (None, Vec::new())
    };
    let log = dir.path().join("terms.log");
    let gone = Arc::new(StdMutex::new(Marks::new()));
    let mut run = Run {
        backend,
        settings,
        programs,
        name: format!("fault-{tag}"),
        watcher: watch_commands(log.clone(), gone.clone()),
        gone,
        log,
        sink_url: sink_url.to_owned(),
        sink_prefix: prefix.clone(),
        dir: dir.path().to_owned(),
        server,
        proxies,
        cluster,
        member_proxies,
        member_faults: 0,
        replicas: Vec::new(),
        incarnations: vec![0; settings.replicas],
        killed: BTreeMap::new(),
        frozen: BTreeMap::new(),
        recoveries: Vec::new(),
        resumed_stops: Vec::new(),
        outage_rates: Vec::new(),
        violations: Vec::new(),
    };
    let mut outcome = Ok(());
    for slot in 0..settings.replicas {
        outcome = outcome.and_then(|()| run.spawn(slot));
    }
    if outcome.is_ok() {
        for (done, fault) in faults.iter().enumerate() {
            if let Err(err) = run.inject(*fault).await {
                outcome = Err(err);
                break;
            }
            if (done + 1) % 100 == 0 {
                eprintln!(
                    "{}: {} of {} faults, {} violations",
                    backend.name(),
                    done + 1,
                    faults.len(),
                    run.violations.len()
                );
            }
        }
        // The last leader writes a little before the end.
        sleep(Duration::from_millis(300)).await;
    }
    run.stop_all().await;
    outcome?;

    let (terms, overlaps) = run.check_terms();
    let rows = drain_sink(sink_url, &prefix, "token, writer, at, accepted").await?;
    let mut stale_refused = 0;
    let mut stale_accepted = 0;
    for row in &rows {
        let token = u64::try_from(row.get::<_, i64>(0)).unwrap_or(0);
        let writer: String = row.get(1);
        let at = i128::from(row.get::<_, i64>(2));
        let accepted: bool = row.get(3);
        // The highest token of a term of ours that had started before this write was sent.
        let highest = terms
            .iter()
            .filter(|t| t.start < at && !is_peer(&t.identity))
            .map(|t| t.token)
            .max()
            .unwrap_or(0);
        // A refused write is stale by definition (a higher token had been accepted); whether
        // a newer term's writes were refused wrongly, the token order of the terms says.
        if !accepted {
            stale_refused += 1;
        } else if token < highest {
            stale_accepted += 1;
            run.violations.push(format!(
                "the sink accepted a stale write ({writer}, token {token} < {highest})"
            ));
        }
    }
    // A frozen leader of ours writes after SIGCONT, and the sink must refuse it: the next
    // leader of ours wrote with a higher token. A peer's terms write nothing, so in a mixed
    // fleet the next leader may have left the fence untouched.
    let fenced_frozen = run
        .frozen
        .keys()
        .filter(|(identity, _)| settings.peers == 0 && !is_peer(identity));
    for (identity, token) in fenced_frozen {
        let refused = rows
            .iter()
            .filter(|r| {
                !r.get::<_, bool>(3)
                    && r.get::<_, String>(1) == *identity
                    && u64::try_from(r.get::<_, i64>(0)).ok() == Some(*token)
            })
            .count();
        if refused == 0 {
            run.violations.push(format!(
                "{identity} wrote nothing after it was resumed: the fence was not exercised"
            ));
        }
    }
    let kinds: Vec<bool> = terms.iter().map(|t| is_peer(&t.identity)).collect();
    let handovers = |from: bool| {
        kinds
            .windows(2)
            .filter(|pair| pair[0] == from && pair[1] != from)
            .count()
    };
    Ok(Report {
        backend,
        peers: settings.peers,
        recoveries: run.recoveries,
        terms: terms.len(),
        peer_terms: kinds.iter().filter(|peer| **peer).count(),
        handovers_to_peers: handovers(false),
        handovers_from_peers: handovers(true),
        overlaps,
        writes: rows.len(),
        stale_refused,
        stale_accepted,
        resumed_stops: run.resumed_stops,
        outage_rates: run.outage_rates,
        violations: run.violations,
    })
}
