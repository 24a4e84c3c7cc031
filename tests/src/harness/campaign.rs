//! A fault campaign: N replicas of `leader run -- fenced-writer` against one backend, faults
//! injected into whichever replica leads, and a checker over what happened.
//!
//! Every replica's COMMAND (`fenced-writer`) logs when it starts and stops with `CLOCK_MONOTONIC`
//! nanoseconds: one clock on one machine, so intervals from different processes compare exactly.
//! Where a COMMAND cannot log its end (its `leader` was SIGKILLed, so it was killed too) the
//! harness takes the moment it saw the process gone, an upper bound. A frozen leader's term ends,
//! for the overlap check, when the harness froze it; what it does after it is resumed is the
//! fence's business: its writes must be refused.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::sleep;

use super::checker::{self, Marks, Term};
use super::proxy::{Mode, Proxy};
use super::servers::{PrivateServer, ServerError, ServerKind};
use crate::{TermEvent as Event, now_ns, term_events as events};

/// The backend the replicas elect on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Backend {
    /// `file://`: a lock file in a temporary directory (process faults only).
    File,
    /// `postgres://`: the table lock on a private Postgres.
    Postgres,
    /// `redis://`: a private Redis.
    Redis,
    /// `etcd://`: a private etcd.
    Etcd,
}

impl Backend {
    /// Every backend, in the order reports list them.
    pub const ALL: [Self; 4] = [Self::File, Self::Postgres, Self::Redis, Self::Etcd];

    /// The faults that apply: the network and server faults need a server.
    #[must_use]
    pub fn faults(self) -> &'static [Fault] {
        match self {
            Self::File => &[Fault::Kill, Fault::Freeze],
            _ => &Fault::ALL,
        }
    }

    /// A private server of this backend's kind, started off the runtime; none for the file lock.
    pub(crate) async fn start_server(self) -> Result<Option<PrivateServer>, HarnessError> {
        let Some(kind) = self.server() else {
            return Ok(None);
        };
        let server = tokio::task::spawn_blocking(move || PrivateServer::start(kind))
            .await
            .expect("server task")?;
        Ok(Some(server))
    }

    /// The `--lock` URL of this backend: the lock directory for the file lock, else the server
    /// (or a proxy in front of it) at `port`.
    pub(crate) fn lock_url(self, lock_dir: &std::path::Path, port: u16) -> String {
        match self {
            Self::File => format!("file://{}", lock_dir.display()),
            Self::Postgres => format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            Self::Redis => format!("redis://127.0.0.1:{port}"),
            Self::Etcd => format!("etcd://127.0.0.1:{port}"),
        }
    }

    fn server(self) -> Option<ServerKind> {
        match self {
            Self::File => None,
            Self::Postgres => Some(ServerKind::Postgres),
            Self::Redis => Some(ServerKind::Redis),
            Self::Etcd => Some(ServerKind::Etcd),
        }
    }

    /// Lower-case name, as in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Postgres => "postgres",
            Self::Redis => "redis",
            Self::Etcd => "etcd",
        }
    }
}

/// A fault, injected into the replica that leads at the time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// SIGKILL of its `leader` process (its COMMAND dies with it); the replica is started again
    /// under a new identity once another leads.
    Kill,
    /// SIGSTOP of `leader` and COMMAND for longer than the lease, then SIGCONT (COMMAND first,
    /// so that it may write before its `leader` can stop it).
    Freeze,
    /// Its connection to the backend cut (the proxy forwards nothing) until another leads, then
    /// restored with the held bytes delivered late.
    Cut,
    /// Every byte between it and the backend held for twice the renew deadline, until another
    /// leads.
    Latency,
    /// The backend server crashed, down for one lease duration, and started again on its data.
    Restart,
}

impl Fault {
    /// Every fault, in the order a round injects them.
    pub const ALL: [Self; 5] = [
        Self::Kill,
        Self::Freeze,
        Self::Cut,
        Self::Latency,
        Self::Restart,
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
        }
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
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(2),
            renew: Duration::from_millis(1500),
            retry: Duration::from_millis(250),
            replicas: 3,
        }
    }
}

impl Settings {
    /// The promised bound on the time from a fault (for a server restart: from the server being
    /// started again) to the next leader's COMMAND starting: a lease and two retry periods, plus a
    /// generous margin for a loaded machine (one second; three after a restart, for clients
    /// to reconnect).
    #[must_use]
    pub fn recovery_bound(&self, fault: Fault) -> Duration {
        let margin = if fault == Fault::Restart {
            Duration::from_secs(3)
        } else {
            Duration::from_secs(1)
        };
        self.lease + self.retry * 2 + margin
    }
}

/// The programs a replica runs: the `leader` command and the fenced writer as its COMMAND.
#[derive(Clone, Debug)]
pub struct Programs {
    /// A binary that runs `leader_cli::main`.
    pub leader: PathBuf,
    /// The `fenced-writer` binary.
    pub writer: PathBuf,
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
}

/// What a campaign saw.
#[derive(Clone, Debug)]
pub struct Report {
    /// The backend.
    pub backend: Backend,
    /// Each fault injected, with the time from it (for a restart: from the server being started
    /// again) to the next leader's COMMAND starting; `None` if no leader came.
    pub recoveries: Vec<(Fault, Option<Duration>)>,
    /// Leadership terms seen (COMMAND starts).
    pub terms: usize,
    /// Pairs of terms that overlapped.
    pub overlaps: usize,
    /// Writes to the fenced sink.
    pub writes: usize,
    /// Writes the sink refused (their token was below one already accepted).
    pub stale_refused: usize,
    /// Writes the sink accepted although a term with a higher token had started before them.
    pub stale_accepted: usize,
    /// For each frozen leader: from its `leader` being resumed to its COMMAND stopped.
    pub resumed_stops: Vec<Duration>,
    /// Every broken rule, in words; empty when all held.
    pub violations: Vec<String>,
}

impl Report {
    /// The slowest recovery after `fault`, if it was injected (`None` inside: a leader never
    /// came).
    #[must_use]
    pub fn worst(&self, fault: Fault) -> Option<Option<Duration>> {
        self.recoveries
            .iter()
            .filter(|(f, _)| *f == fault)
            .map(|(_, d)| *d)
            .reduce(|a, b| match (a, b) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            })
    }

    /// A Markdown table of reports: faults, overlaps, stale writes and the worst recovery per
    /// fault.
    #[must_use]
    pub fn table(reports: &[Self]) -> String {
        let mut out = String::from(
            "| backend | faults | terms | overlaps | writes | stale refused | stale accepted |",
        );
        for fault in Fault::ALL {
            let _ = write!(out, " worst {} |", fault.name());
        }
        out.push_str("\n|---|---|---|---|---|---|---|");
        out.push_str(&"---|".repeat(Fault::ALL.len()));
        for r in reports {
            let _ = write!(
                out,
                "\n| {} | {} | {} | {} | {} | {} | {} |",
                r.backend.name(),
                r.recoveries.len(),
                r.terms,
                r.overlaps,
                r.writes,
                r.stale_refused,
                r.stale_accepted
            );
            for fault in Fault::ALL {
                let cell = match r.worst(fault) {
                    None => "n/a".to_owned(),
                    Some(None) => "NO LEADER".to_owned(),
                    Some(Some(d)) => format!("{} ms", d.as_millis()),
                };
                let _ = write!(out, " {cell} |");
            }
        }
        out.push('\n');
        out
    }
}

/// The state letter of `/proc/PID/stat` (R, S, T, Z, ...); `None` once the process is gone.
fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Gone, or a zombie nobody reaped yet: it runs no more code either way.
fn process_gone(pid: i32) -> bool {
    matches!(process_state(pid), None | Some('Z' | 'X'))
}

fn process_stopped(pid: i32) -> bool {
    process_state(pid) == Some('T')
}

/// Calls `check` every `every` until it returns something; `None` after `within`.
async fn poll<T>(
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

/// The process group `leader` runs COMMAND in: its supervisor's, its only child.
fn command_group(leader_pid: u32) -> Option<Pid> {
    std::fs::read_to_string(format!("/proc/{leader_pid}/task/{leader_pid}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
        .map(Pid::from_raw)
}

struct Replica {
    identity: String,
    child: Child,
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
    lock_dir: PathBuf,
    server: Option<PrivateServer>,
    proxies: Vec<Proxy>,
    replicas: Vec<Replica>,
    incarnations: Vec<usize>,
    /// identity -> when the harness saw its COMMAND gone after a SIGKILL.
    killed: Marks,
    /// (identity, token) of a frozen term -> when it was frozen. A resumed replica may lead
    /// again later, in a term of its own.
    frozen: Marks,
    recoveries: Vec<(Fault, Option<Duration>)>,
    resumed_stops: Vec<Duration>,
    violations: Vec<String>,
}

impl Run<'_> {
    fn lock_url(&self, slot: usize) -> String {
        let port = self.proxies.get(slot).map_or(0, Proxy::port);
        self.backend.lock_url(&self.lock_dir.join("lock"), port)
    }

    fn spawn(&mut self, slot: usize) -> Result<(), HarnessError> {
        self.incarnations[slot] += 1;
        let identity = format!("r{slot}.{}", self.incarnations[slot]);
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let child = Command::new(&self.programs.leader)
            .args(["run", "--lock", &self.lock_url(slot), "--name", &self.name])
            .args(["--identity", &identity])
            .args(["--lease-duration", &ms(self.settings.lease)])
            .args(["--renew-deadline", &ms(self.settings.renew)])
            .args(["--retry-period", &ms(self.settings.retry)])
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
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| HarnessError::Io {
                what: format!("spawning {}", self.programs.leader.display()),
                source,
            })?;
        let replica = Replica { identity, child };
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
        let over = events
            .iter()
            .any(|e| !e.start && e.identity == latest.identity && e.token == latest.token)
            || self
                .killed
                .contains_key(&(latest.identity.clone(), latest.token))
            || self
                .frozen
                .contains_key(&(latest.identity.clone(), latest.token));
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

    async fn inject(&mut self, fault: Fault) -> Result<(), HarnessError> {
        let Some((slot, term)) = self.settled_leader(Duration::from_secs(30)).await else {
            self.violations
                .push(format!("no leader before injecting {}", fault.name()));
            return Ok(());
        };
        let bound = self.settings.recovery_bound(fault);
        let Some(leader_pid) = self.replicas[slot].pid() else {
            self.violations
                .push(format!("{} exited by itself", term.identity));
            return Ok(());
        };
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
                    self.violations.push(format!(
                        "{}'s COMMAND outlived its SIGKILLed leader by 5 s",
                        term.identity
                    ));
                }
                self.killed
                    .insert((term.identity.clone(), term.token), now_ns());
            }
            Fault::Freeze => {
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
                let mut server = self.server.take();
                let lease = self.settings.lease;
                let (server, restarted) = tokio::task::spawn_blocking(move || {
                    let mut restarted = now_ns();
                    if let Some(server) = server.as_mut() {
                        server.kill();
                        std::thread::sleep(lease);
                        restarted = now_ns();
                        server.restart()?;
                    }
                    Ok::<_, ServerError>((server, restarted))
                })
                .await
                .expect("restart task")?;
                self.server = server;
                from = restarted;
            }
        }
        let recovery = self.next_start(since, from, bound * 3).await;
        match recovery {
            None => self.violations.push(format!(
                "{}: no new leader within {:?}",
                fault.name(),
                bound * 3
            )),
            Some(d) if d > bound => self.violations.push(format!(
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
            Fault::Freeze => {
                if let Some(group) = group {
                    let _ = killpg(group, Signal::SIGCONT);
                }
                sleep(Duration::from_millis(200)).await;
                let resumed = now_ns();
                let _ = kill(leader_pid, Signal::SIGCONT);
                let stopped = poll(Duration::from_secs(5), Duration::from_millis(2), || {
                    events(&self.log)
                        .into_iter()
                        .find(|e| !e.start && e.identity == term.identity && e.token == term.token)
                        .map(|stop| stop.at)
                });
                match stopped.await {
                    Some(at) => self.resumed_stops.push(between(resumed, at)),
                    None => self.violations.push(format!(
                        "{} was resumed and its COMMAND still ran 5 s later",
                        term.identity
                    )),
                }
            }
            Fault::Cut | Fault::Latency => self.proxies[slot].set(Mode::Open),
            Fault::Restart => {}
        }
        Ok(())
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

    /// The overlap and token checks over the log.
    fn check_terms(&mut self) -> (Vec<Term>, usize) {
        let terms = checker::terms(&events(&self.log), &self.killed, &self.frozen);
        let (overlaps, violations) = checker::check(&terms);
        self.violations.extend(violations);
        (terms, overlaps)
    }
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
    let redacted = leader_core::redact_url(sink_url);
    let sink_error = |source| HarnessError::Sink {
        url: redacted.clone(),
        source,
    };
    let (sink, connection) = tokio_postgres::connect(sink_url, tokio_postgres::NoTls)
        .await
        .map_err(sink_error)?;
    tokio::spawn(connection);
    let tag = format!("{:08x}", fastrand::u32(..));
    let prefix = format!("fault_sink_{tag}");
    sink.batch_execute(&format!(
        "CREATE TABLE {prefix}_mark (token bigint NOT NULL);
         INSERT INTO {prefix}_mark VALUES (0);
         CREATE TABLE {prefix}_writes (seq bigserial PRIMARY KEY, token bigint NOT NULL,
             writer text NOT NULL, at bigint NOT NULL, accepted bool NOT NULL);"
    ))
    .await
    .map_err(sink_error)?;

    let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
        what: "temporary directory".into(),
        source,
    })?;
    let server = backend.start_server().await?;
    let mut proxies = Vec::new();
    if let Some(server) = &server {
        for _ in 0..settings.replicas {
            proxies.push(proxy_to(server).await?);
        }
    }
    let mut run = Run {
        backend,
        settings,
        programs,
        name: format!("fault-{tag}"),
        log: dir.path().join("terms.log"),
        sink_url: sink_url.to_owned(),
        sink_prefix: prefix.clone(),
        lock_dir: dir.path().to_owned(),
        server,
        proxies,
        replicas: Vec::new(),
        incarnations: vec![0; settings.replicas],
        killed: BTreeMap::new(),
        frozen: BTreeMap::new(),
        recoveries: Vec::new(),
        resumed_stops: Vec::new(),
        violations: Vec::new(),
    };
    let mut outcome = Ok(());
    for slot in 0..settings.replicas {
        outcome = outcome.and_then(|()| run.spawn(slot));
    }
    if outcome.is_ok() {
        for fault in faults {
            if let Err(err) = run.inject(*fault).await {
                outcome = Err(err);
                break;
            }
        }
        // The last leader writes a little before the end.
        sleep(Duration::from_millis(300)).await;
    }
    run.stop_all().await;
    outcome?;

    let (terms, overlaps) = run.check_terms();
    let rows = sink
        .query(
            &format!("SELECT token, writer, at, accepted FROM {prefix}_writes ORDER BY seq"),
            &[],
        )
        .await
        .map_err(sink_error)?;
    sink.batch_execute(&format!(
        "DROP TABLE {prefix}_mark; DROP TABLE {prefix}_writes;"
    ))
    .await
    .map_err(sink_error)?;
    let mut stale_refused = 0;
    let mut stale_accepted = 0;
    for row in &rows {
        let token = u64::try_from(row.get::<_, i64>(0)).unwrap_or(0);
        let writer: String = row.get(1);
        let at = i128::from(row.get::<_, i64>(2));
        let accepted: bool = row.get(3);
        // The highest token of a term that had started before this write was sent.
        let highest = terms
            .iter()
            .filter(|t| t.start < at)
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
    for (identity, token) in run.frozen.keys() {
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
    Ok(Report {
        backend,
        recoveries: run.recoveries,
        terms: terms.len(),
        overlaps,
        writes: rows.len(),
        stale_refused,
        stale_accepted,
        resumed_stops: run.resumed_stops,
        violations: run.violations,
    })
}
