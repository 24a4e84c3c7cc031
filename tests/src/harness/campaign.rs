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

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::sleep;

use super::Programs;
use super::checker::{self, Marks, Term};
use super::outage::failed_attempts;
use super::proxy::{Mode, Proxy};
pub use super::report::Report;
use super::servers::{PrivateServer, ServerError};
use crate::{TermEvent as Event, now_ns, term_events as events};
use leader_test_support::etcd_cluster::EtcdCluster;

mod inject;
mod processes;
mod setup;

pub use processes::*;
pub use setup::*;

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

    /// The terms [`watch_commands`] saw end without a `stop` line.
    fn gone(&self) -> std::sync::MutexGuard<'_, Marks> {
        self.gone
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A replica started while its server was away, or whose server did not answer its open
    /// within the request timeout (moto on a loaded machine), exits at once with `leader`'s
    /// code for an unreachable backend at start (by design), where an orchestrator would start
    /// it again: so does the harness. Any other exit of its own is a violation.
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
            let metrics = format!("127.0.0.1:{}", leader_test_support::free_port());
            let program = &self.programs.leader;
            let mut command = Command::new(program);
            command
                .args(["run", "--lock", &url, "--name", &self.name])
                .args(["--identity", &identity])
                .args(timing_args(&self.settings))
                .args(["--metrics-addr", &metrics])
                .arg("--")
                .arg(&self.programs.writer)
                .env("DATABASE_URL", &self.sink_url)
                .env("SINK", &self.sink_prefix)
                .env("JOB_LOG", &self.log)
                .env("RUST_LOG", replica_log_filter("error"))
                .stdout(Stdio::null())
                .kill_on_drop(true);
            command.envs(env);
            Replica {
                identity,
                child: spawned(program, command.spawn())?,
                metrics: Some(metrics),
            }
        };
        place(&mut self.replicas, slot, replica);
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

    /// Waits for a leader that has led for `settled` (so it has renewed and written),
    /// starting again meanwhile every replica that exited ([`respawn_exited`]).
    ///
    /// [`respawn_exited`]: Self::respawn_exited
    async fn settled_leader(
        &mut self,
        within: Duration,
    ) -> Result<Option<(usize, Event)>, HarnessError> {
        let settled = self.settings.lease / 2;
        let began = tokio::time::Instant::now();
        loop {
            self.respawn_exited()?;
            let leader = self.current().and_then(|event| {
                let slot = self
                    .replicas
                    .iter()
                    .position(|r| r.identity == event.identity)?;
                (between(event.at, now_ns()) >= settled).then_some((slot, event))
            });
            if leader.is_some() || began.elapsed() >= within {
                return Ok(leader);
            }
            sleep(Duration::from_millis(20)).await;
        }
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
    let (tag, prefix) = token_sink(sink_url, "fault").await?;
    let Stage {
        dir,
        server,
        proxies,
    } = stage(backend, programs, settings.replicas).await?;
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
    let outcome = async {
        (0..settings.replicas).try_for_each(|slot| run.spawn(slot))?;
        for (done, fault) in faults.iter().enumerate() {
            run.inject(*fault).await?;
            let violations = run.violations.len();
            let what = format_args!("{} ({violations} violations)", backend.name());
            super::say_progress(what, done + 1, faults.len());
        }
        // The last leader writes a little before the end.
        sleep(Duration::from_millis(300)).await;
        Ok::<(), HarnessError>(())
    }
    .await;
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
