//! A shard workload under faults: three replicas of `leader run --shards 4 --static-membership
//! -- fenced-writer` against one backend, each shard's COMMAND writing its token through a
//! fenced sink that keeps a high-water mark per shard; faults into the replicas in turn
//! (SIGKILL, SIGSTOP of the replica and its COMMANDs past the lease, its connection cut) and
//! into the server (a crash and restart). Beside the faults, what operators do: after every
//! seventh fault (from the second) a rolling restart of the three replicas (SIGTERM, started
//! again under the same identity within the lease), and after every tenth (from the second) a
//! resize of the running set (`leader shards resize`, through 6, 3, 8 and 4 shards in turn;
//! replicas started later get the count of the day). The checker takes each shard on its own:
//! its terms (from its COMMANDs' log) never overlap, their tokens grow, and the sink accepted
//! no stale write for it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::sleep;

use super::Programs;
use super::campaign::{
    Backend, Fault, HarnessError, Settings, command_groups, connect_sink, crash_and_restart,
    drain_sink, poll, process_gone, process_stopped, proxy_to, stop_replicas, watch_commands,
};
use super::checker::{self, Marks};
use super::proxy::{Mode, Proxy};
use super::servers::PrivateServer;
use crate::{TermEvent, now_ns, term_events};

/// The shards of the workload's set, at its start.
pub const SHARDS: u32 = 4;

/// The counts the workload's resizes go through, in turn.
const RESIZES: [u32; 4] = [6, 3, 8, SHARDS];

/// The most shards the set ever has: the range of the sink and the checker.
pub const MOST_SHARDS: u32 = 8;

/// What a shard workload under faults saw.
#[derive(Clone, Debug, Default)]
pub struct ShardsReport {
    /// Faults injected.
    pub faults: usize,
    /// Terms, over every shard.
    pub terms: usize,
    /// Terms that overlapped another of the same shard: must be 0.
    pub overlaps: usize,
    /// Writes to the fenced sink.
    pub writes: usize,
    /// Stale writes the sink refused.
    pub stale_refused: usize,
    /// Stale writes the sink accepted: must be 0.
    pub stale_accepted: usize,
    /// Writes a frozen term made once resumed, before the next term of its shard had written
    /// anything: the sink accepted them, and they come before all of the next term's writes in
    /// its order. Fencing promises no more (a process resumed acts before it can look at a
    /// clock); they are not stale, and counted apart.
    pub resumed_first: usize,
    /// Replicas that exited with no kill aimed at them (and were started again), with their
    /// exit status: each incarnation's stderr is kept beside the logs of a failed run.
    pub exited: Vec<String>,
    /// Rolling restarts of every replica.
    pub rolling_restarts: usize,
    /// Replicas that did not exit within three leases of their SIGTERM in a rolling restart
    /// (killed then, and started again under a new identity).
    pub stuck_on_sigterm: usize,
    /// Resizes the set took.
    pub resizes: usize,
    /// Resizes `leader shards resize` refused or could not make (a server down, say).
    pub resize_failures: Vec<String>,
    /// Every broken rule, in words.
    pub violations: Vec<String>,
}

struct Run<'a> {
    backend: Backend,
    settings: Settings,
    programs: &'a Programs,
    name: String,
    dir: &'a Path,
    sink: (&'a str, &'a str),
    server: Option<PrivateServer>,
    proxies: Vec<Proxy>,
    replicas: Vec<(String, Child)>,
    incarnations: Vec<usize>,
    /// The set's shard count now, which replicas are started with.
    count: u32,
    /// Per shard: a term's identity and token are unique within its shard only.
    killed: BTreeMap<u32, Marks>,
    frozen: BTreeMap<u32, Marks>,
    /// Every freeze: the processes it stopped, and when.
    frozen_pids: Vec<Freeze>,
    exited: Vec<String>,
}

/// The processes whose process group is one of `groups` (`/proc/PID/stat`, field 5).
fn members_of(groups: &[Pid]) -> BTreeSet<i32> {
    let groups: BTreeSet<i32> = groups.iter().map(|g| g.as_raw()).collect();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return BTreeSet::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    stat.rsplit_once(") ")?
                        .1
                        .split(' ')
                        .nth(2)?
                        .parse::<i32>()
                        .ok()
                })
                .is_some_and(|group| groups.contains(&group))
        })
        .collect()
}

/// One freeze of a replica: the processes of its COMMANDs it stopped, when they were all
/// stopped, and when they were resumed.
#[derive(Clone, Debug)]
struct Freeze {
    pids: BTreeSet<i32>,
    stopped: i128,
    thawed: i128,
}

/// How long after a thaw a start line can still be the one a frozen COMMAND had yet to write:
/// `leader`'s watchdog kills such a COMMAND as soon as both run again, its term long past its
/// deadline. Far too short for its process id to be another's by then (they wrap around after
/// tens of thousands of processes).
const LATE_START: i128 = 1_000_000_000;

/// Stops replica `leader` and every process of its COMMANDs, and says which groups and
/// processes: its children by process as well as by group (a child caught between its fork
/// and its own `setpgid` has no group of its own yet, and a signal to that group would stop
/// nothing: its COMMAND would then start and run through the freeze), over again until no
/// process is new, then waits until each shows stopped.
async fn freeze(leader: Pid) -> (Vec<Pid>, BTreeSet<i32>) {
    let _ = kill(leader, Signal::SIGSTOP);
    let mut groups = BTreeSet::new();
    let mut pids = BTreeSet::new();
    for _ in 0..20 {
        let children = command_groups(leader.as_raw().cast_unsigned());
        for child in &children {
            let _ = kill(*child, Signal::SIGSTOP);
            let _ = killpg(*child, Signal::SIGSTOP);
        }
        let mut found = members_of(&children);
        found.extend(children.iter().map(|c| c.as_raw()));
        let new: Vec<i32> = found.difference(&pids).copied().collect();
        for pid in &new {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGSTOP);
        }
        groups.extend(children.iter().map(|c| c.as_raw()));
        pids.extend(new.iter().copied());
        if new.is_empty() {
            break;
        }
    }
    let _ = poll(Duration::from_secs(1), Duration::from_millis(1), || {
        (process_stopped(leader.as_raw())
            && pids.iter().all(|&p| process_stopped(p) || process_gone(p)))
        .then_some(())
    })
    .await;
    (groups.into_iter().map(Pid::from_raw).collect(), pids)
}

/// Freeze marks by process: a term whose COMMAND was in a frozen group is marked at the first
/// freeze after its start, unless its own log marked it earlier. Only a freeze while the term
/// could still run counts: before its stop line, and before it was killed. Process ids are
/// reused (a long run wraps around them), so a later process with the pid of a term that had
/// ended is not that term's COMMAND.
///
/// A COMMAND frozen before it wrote its start line (still starting, under load) writes it once
/// resumed, and is killed by its `leader` at once: its term began before the freeze, and it acts
/// after the thaw as any frozen term does, which the fence answers for. Such a start line (at
/// most [`LATE_START`] after the thaw) is moved to the freeze, and the term marked there. A
/// start line written during a freeze by one of its processes is a freeze that missed it: said
/// in the returned list.
fn mark_frozen_by_pid(
    events: &mut [TermEvent],
    freezes: &[Freeze],
    killed: &Marks,
    frozen: &mut Marks,
) -> Vec<String> {
    let mut missed = Vec::new();
    let stops: Vec<(String, u64, i128)> = events
        .iter()
        .filter(|e| !e.start)
        .map(|e| (e.identity.clone(), e.token, e.at))
        .collect();
    for event in events.iter_mut().filter(|e| e.start) {
        let Some(pid) = event.pid else { continue };
        let key = (event.identity.clone(), event.token);
        let mut mark = |at: i128| {
            let mark = frozen.entry(key.clone()).or_insert(at);
            *mark = (*mark).min(at);
        };
        let ours = |f: &&Freeze| f.pids.contains(&pid) && f.stopped < event.at;
        if let Some(freeze) = freezes
            .iter()
            .filter(ours)
            .find(|f| event.at >= f.thawed && event.at - f.thawed <= LATE_START)
        {
            event.at = freeze.stopped;
            mark(freeze.stopped);
            continue;
        }
        if let Some(freeze) = freezes.iter().filter(ours).find(|f| event.at < f.thawed) {
            missed.push(format!(
                "{} (token {}): its COMMAND, pid {pid}, wrote its start line during a freeze \
                 that was to stop it (at {} ns, resumed at {} ns)",
                event.identity, event.token, freeze.stopped, freeze.thawed
            ));
        }
        let stopped = stops
            .iter()
            .filter(|(identity, token, _)| *identity == event.identity && *token == event.token)
            .map(|(_, _, at)| *at)
            .min();
        let ended = [stopped, killed.get(&key).copied()]
            .into_iter()
            .flatten()
            .min();
        let first = freezes
            .iter()
            .filter(|f| {
                f.stopped > event.at
                    && ended.is_none_or(|end| f.stopped < end)
                    && f.pids.contains(&pid)
            })
            .map(|f| f.stopped)
            .min();
        if let Some(at) = first {
            mark(at);
        }
    }
    missed
}

/// Whether an accepted write of `token` at `at`, on a shard whose terms started as `starts`
/// say, is stale: a later term had started before it. A write of a frozen term after its freeze
/// (`frozen_at`) is the fence's to judge: the sink took it only while no later token had been
/// written, so it comes before all of the next term's writes (`Resumed`).
fn judge_write(
    token: u64,
    at: i128,
    accepted: bool,
    starts: &[TermEvent],
    frozen_at: Option<i128>,
) -> Judged {
    let highest = checker::highest_started_before(starts.iter().map(|s| (s.at, s.token)), at);
    if !accepted {
        Judged::Refused
    } else if token >= highest {
        Judged::Fine
    } else if frozen_at.is_some_and(|frozen| frozen <= at) {
        Judged::Resumed
    } else {
        Judged::Stale(highest)
    }
}

/// What [`judge_write`] found.
#[derive(Debug, PartialEq, Eq)]
enum Judged {
    Fine,
    Refused,
    Resumed,
    /// Accepted, though a term with this higher token had started.
    Stale(u64),
}

fn shard_log(dir: &Path, shard: u32) -> PathBuf {
    dir.join(format!("job.log.{shard}"))
}

impl Run<'_> {
    /// Starts the replica of `slot` under a new identity (after a kill: its records are the
    /// dead one's until their leases run out).
    fn spawn(&mut self, slot: usize) -> Result<(), HarnessError> {
        self.incarnations[slot] += 1;
        self.spawn_as(slot, format!("s{slot}.{}", self.incarnations[slot]))
    }

    /// Starts the replica of `slot` as `identity`.
    fn spawn_as(&mut self, slot: usize, identity: String) -> Result<(), HarnessError> {
        let port = self.proxies.get(slot).map_or(0, Proxy::port);
        let (url, env) = self.backend.replica_lock(self.dir, port, &self.settings)?;
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        // Each incarnation's own errors, kept beside the logs of a failed run: why a replica
        // exited is read there.
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("leader.{identity}.stderr")))
            .map_err(|source| HarnessError::Io {
                what: "creating a replica's stderr file".into(),
                source,
            })?;
        let child = Command::new(&self.programs.leader)
            .args(["run", "--lock", &url, "--name", &self.name])
            .args(["--identity", &identity, "--shards", &self.count.to_string()])
            .arg("--static-membership")
            .args(["--lease-duration", &ms(self.settings.lease)])
            .args(["--renew-deadline", &ms(self.settings.renew)])
            .args(["--retry-period", &ms(self.settings.retry)])
            .arg("--")
            .arg(&self.programs.writer)
            .env("DATABASE_URL", self.sink.0)
            .env("SINK", self.sink.1)
            .env("JOB_LOG", self.dir.join("job.log"))
            .env(
                "RUST_LOG",
                std::env::var("FAULT_LOG").unwrap_or_else(|_| "error".into()),
            )
            .envs(env)
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| HarnessError::Io {
                what: "spawning leader run --shards".into(),
                source,
            })?;
        let replica = (identity, child);
        if slot < self.replicas.len() {
            self.replicas[slot] = replica;
        } else {
            self.replicas.push(replica);
        }
        Ok(())
    }

    /// Marks the terms `open` (see [`Run::open_terms`]) ended by a kill now.
    fn killed_now(&mut self, open: Vec<(u32, (String, u64))>) {
        let at = now_ns();
        for (shard, key) in open {
            self.killed.entry(shard).or_default().insert(key, at);
        }
    }

    /// The terms `identity` has open now, by the shards' logs: shard, identity and token.
    fn open_terms(&self, identity: &str) -> Vec<(u32, (String, u64))> {
        (0..MOST_SHARDS)
            .filter_map(|shard| {
                let events = term_events(&shard_log(self.dir, shard));
                let last = events.iter().rev().find(|e| e.identity == identity)?;
                last.start
                    .then(|| (shard, (last.identity.clone(), last.token)))
            })
            .collect()
    }

    async fn inject(&mut self, fault: Fault, turn: usize) -> Result<bool, HarnessError> {
        let slot = turn % self.replicas.len();
        let identity = self.replicas[slot].0.clone();
        let pid = self.replicas[slot].1.id();
        let lasts = self.settings.lease + Duration::from_secs(1);
        match fault {
            Fault::Kill => {
                let open = self.open_terms(&identity);
                if let Some(pid) = pid {
                    let _ = kill(Pid::from_raw(pid.cast_signed()), Signal::SIGKILL);
                }
                let _ = self.replicas[slot].1.wait().await;
                // Its COMMANDs die with it (their supervisors' parent-death signal); the
                // watchers see them gone, and the kill ends their terms at the latest.
                self.killed_now(open);
                sleep(lasts).await;
                self.spawn(slot)?;
            }
            Fault::Freeze => {
                let Some(pid) = pid else { return Ok(false) };
                let leader = Pid::from_raw(pid.cast_signed());
                let (groups, pids) = freeze(leader).await;
                let stopped = now_ns();
                for (shard, key) in self.open_terms(&identity) {
                    // A term still open by its log since an earlier freeze keeps that mark.
                    self.frozen
                        .entry(shard)
                        .or_default()
                        .entry(key)
                        .or_insert(stopped);
                }
                sleep(lasts).await;
                let thawed = now_ns();
                for group in &groups {
                    let _ = killpg(*group, Signal::SIGCONT);
                }
                for pid in &pids {
                    let _ = kill(Pid::from_raw(*pid), Signal::SIGCONT);
                }
                let _ = kill(leader, Signal::SIGCONT);
                // And by process: a COMMAND whose start line is not in its log yet (written
                // late, under load) is frozen all the same; the checker finds its term by pid.
                self.frozen_pids.push(Freeze {
                    pids,
                    stopped,
                    thawed,
                });
            }
            Fault::Cut => {
                let Some(proxy) = self.proxies.get(slot) else {
                    return Ok(false);
                };
                proxy.set(Mode::Cut);
                sleep(lasts).await;
                proxy.set(Mode::Open);
            }
            Fault::Restart => {
                crash_and_restart(&mut self.server, self.settings.lease).await?;
            }
            _ => return Ok(false),
        }
        // A replica that could not reach a restarting server exits as unreachable at start:
        // start it again, as an orchestrator would.
        for slot in 0..self.replicas.len() {
            if let Ok(Some(status)) = self.replicas[slot].1.try_wait() {
                self.exited.push(format!(
                    "{} after fault {turn}: {status}",
                    self.replicas[slot].0
                ));
                self.spawn(slot)?;
            }
        }
        sleep(Duration::from_secs(1)).await;
        Ok(true)
    }
}

impl Run<'_> {
    /// What operators do beside the faults, after fault `turn`.
    async fn operate(
        &mut self,
        turn: usize,
        report: &mut ShardsReport,
    ) -> Result<(), HarnessError> {
        if turn % 7 == 1 {
            self.rolling_restart(report).await?;
        }
        if turn % 10 == 1 {
            self.resize(report).await;
        }
        Ok(())
    }

    /// Each replica in turn: SIGTERM, and started again under the same identity a few rounds
    /// later, within the lease (static membership: its shards wait for it). One that does not
    /// exit within three leases is killed, and started under a new identity.
    async fn rolling_restart(&mut self, report: &mut ShardsReport) -> Result<(), HarnessError> {
        for slot in 0..self.replicas.len() {
            let identity = self.replicas[slot].0.clone();
            let open = self.open_terms(&identity);
            if let Some(pid) = self.replicas[slot].1.id() {
                let _ = kill(Pid::from_raw(pid.cast_signed()), Signal::SIGTERM);
            }
            let exit = tokio::time::timeout(self.settings.lease * 3, self.replicas[slot].1.wait());
            if exit.await.is_err() {
                report.stuck_on_sigterm += 1;
                let _ = self.replicas[slot].1.start_kill();
                let _ = self.replicas[slot].1.wait().await;
                self.killed_now(open);
                self.spawn(slot)?;
            } else {
                sleep(self.settings.retry * 2).await;
                self.spawn_as(slot, identity)?;
            }
            // Before the next, this one takes its shards back, as a rollout waits for a
            // replica to be ready.
            sleep(self.settings.retry * 4).await;
        }
        report.rolling_restarts += 1;
        Ok(())
    }

    /// `leader shards resize` to the next count, through replica 0's way to the server.
    async fn resize(&mut self, report: &mut ShardsReport) {
        let to = RESIZES[report.resizes % RESIZES.len()];
        let port = self.proxies.first().map_or(0, Proxy::port);
        let (url, env) = match self.backend.replica_lock(self.dir, port, &self.settings) {
            Ok(both) => both,
            Err(err) => {
                report.resize_failures.push(err.to_string());
                return;
            }
        };
        let out = Command::new(&self.programs.leader)
            .args(["shards", "resize", "--lock", &url, "--name", &self.name])
            .arg(to.to_string())
            .envs(env)
            .output()
            .await;
        match out {
            Ok(out) if out.status.success() => {
                self.count = to;
                report.resizes += 1;
            }
            Ok(out) => report.resize_failures.push(format!(
                "to {to}: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(err) => report.resize_failures.push(format!("to {to}: {err}")),
        }
    }
}

/// The faults a shard workload takes on `backend`.
#[must_use]
pub fn faults_for(backend: Backend) -> Vec<Fault> {
    super::firings::faults_for(backend)
}

/// Runs the shard workload against `backend` with `faults` in order.
///
/// # Errors
/// Something could not be set up; what goes wrong under the faults is in the report.
pub async fn run(
    backend: Backend,
    faults: &[Fault],
    settings: Settings,
    programs: &Programs,
    sink_url: &str,
) -> Result<ShardsReport, HarnessError> {
    let (sink, sink_error) = connect_sink(sink_url).await?;
    let tag = format!("{:08x}", fastrand::u32(..));
    let prefix = format!("shard_sink_{tag}");
    sink.batch_execute(&format!(
        "CREATE TABLE {prefix}_mark (shard int PRIMARY KEY, token bigint NOT NULL);
         INSERT INTO {prefix}_mark SELECT s, 0 FROM generate_series(0, {}) s;
         CREATE TABLE {prefix}_writes (seq bigserial PRIMARY KEY, shard int NOT NULL,
             token bigint NOT NULL, writer text NOT NULL, at bigint NOT NULL, accepted bool NOT NULL);",
        MOST_SHARDS - 1
    ))
    .await
    .map_err(&sink_error)?;
    let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
        what: "temporary directory".into(),
        source,
    })?;
    let gone: Vec<Arc<StdMutex<Marks>>> = (0..MOST_SHARDS).map(|_| Arc::default()).collect();
    let watchers: Vec<_> = (0..MOST_SHARDS)
        .map(|shard| watch_commands(shard_log(dir.path(), shard), gone[shard as usize].clone()))
        .collect();
    let server = backend.start_server(programs).await?;
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
        name: format!("shards-{tag}"),
        dir: dir.path(),
        sink: (sink_url, &prefix),
        server,
        proxies,
        replicas: Vec::new(),
        incarnations: vec![0; settings.replicas],
        count: SHARDS,
        killed: BTreeMap::new(),
        frozen: BTreeMap::new(),
        frozen_pids: Vec::new(),
        exited: Vec::new(),
    };
    let mut report = ShardsReport::default();
    let mut outcome = Ok(());
    for slot in 0..settings.replicas {
        outcome = outcome.and_then(|()| run.spawn(slot));
    }
    if outcome.is_ok() {
        sleep(Duration::from_secs(3)).await;
        for (turn, fault) in faults.iter().enumerate() {
            match run.inject(*fault, turn).await {
                Ok(true) => report.faults += 1,
                Ok(false) => {}
                Err(err) => {
                    outcome = Err(err);
                    break;
                }
            }
            if let Err(err) = run.operate(turn, &mut report).await {
                outcome = Err(err);
                break;
            }
            if (turn + 1) % 100 == 0 {
                eprintln!(
                    "{} shards: {} of {} faults",
                    backend.name(),
                    turn + 1,
                    faults.len()
                );
            }
        }
        sleep(Duration::from_secs(3)).await;
    }
    stop_replicas(&mut run.replicas).await;
    // The watchers' last look.
    sleep(Duration::from_millis(50)).await;
    for watcher in watchers {
        watcher.abort();
    }
    outcome?;
    report.exited = std::mem::take(&mut run.exited);

    // Each shard on its own: terms that never overlap, tokens that grow.
    let mut starts: BTreeMap<u32, Vec<TermEvent>> = BTreeMap::new();
    let mut frozen_by_shard: BTreeMap<u32, Marks> = BTreeMap::new();
    for shard in 0..MOST_SHARDS {
        let killed = run.killed.get(&shard).cloned().unwrap_or_default();
        let seen_gone = gone[shard as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut events = term_events(&shard_log(dir.path(), shard));
        let mut frozen = run.frozen.get(&shard).cloned().unwrap_or_default();
        let missed = mark_frozen_by_pid(&mut events, &run.frozen_pids, &killed, &mut frozen);
        report
            .violations
            .extend(missed.into_iter().map(|m| format!("shard {shard}: {m}")));
        let terms = checker::terms_seen(&events, &killed, &frozen, &seen_gone);
        report.terms += terms.len();
        let (overlaps, violations) = checker::check(&terms);
        report.overlaps += overlaps;
        report.violations.extend(
            violations
                .into_iter()
                .map(|v| format!("shard {shard}: {v}")),
        );
        starts.insert(shard, events.into_iter().filter(|e| e.start).collect());
        frozen_by_shard.insert(shard, frozen);
    }

    let rows = drain_sink(sink_url, &prefix, "shard, token, writer, at, accepted").await?;
    report.writes = rows.len();
    let keep = std::env::temp_dir().join(format!("leader-shards-{tag}"));
    for row in &rows {
        let shard = u32::try_from(row.get::<_, i32>(0)).unwrap_or(0);
        let token = u64::try_from(row.get::<_, i64>(1)).unwrap_or(0);
        let writer: String = row.get(2);
        let at = i128::from(row.get::<_, i64>(3));
        let accepted: bool = row.get(4);
        let frozen_at = frozen_by_shard
            .get(&shard)
            .and_then(|marks| marks.get(&(writer, token)).copied());
        let starts = starts.get(&shard).map_or(&[][..], Vec::as_slice);
        match judge_write(token, at, accepted, starts, frozen_at) {
            Judged::Fine => {}
            Judged::Refused => report.stale_refused += 1,
            Judged::Resumed => report.resumed_first += 1,
            Judged::Stale(highest) => {
                report.stale_accepted += 1;
                report.violations.push(format!(
                    "shard {shard}: the sink accepted a stale write (token {token} < {highest})"
                ));
            }
        }
    }
    if !report.violations.is_empty() {
        // The COMMANDs' logs of a failed run are kept for a look.
        let _ = std::fs::create_dir_all(&keep);
        for shard in 0..MOST_SHARDS {
            let _ = std::fs::copy(
                shard_log(dir.path(), shard),
                keep.join(format!("job.log.{shard}")),
            );
        }
        // And what the checker ended terms with: kind, shard, identity, token, when.
        let mut marks = String::new();
        for (kind, by_shard) in [("killed", &run.killed), ("frozen", &run.frozen)] {
            for (shard, list) in by_shard {
                for ((identity, token), at) in list {
                    marks.push_str(&format!("{kind} {shard} {identity} {token} {at}\n"));
                }
            }
        }
        for (shard, list) in gone.iter().enumerate() {
            for ((identity, token), at) in list.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                marks.push_str(&format!("gone {shard} {identity} {token} {at}\n"));
            }
        }
        let _ = std::fs::write(keep.join("marks"), marks);
        if let Ok(entries) = std::fs::read_dir(dir.path()) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                if name.to_string_lossy().ends_with(".stderr") {
                    let _ = std::fs::copy(entry.path(), keep.join(name));
                }
            }
        }
        report
            .violations
            .push(format!("the logs are in {}", keep.display()));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(identity: &str, token: u64, at: i128, pid: i32) -> TermEvent {
        TermEvent {
            start: true,
            identity: identity.into(),
            token,
            at,
            pid: Some(pid),
        }
    }

    fn stop(identity: &str, token: u64, at: i128) -> TermEvent {
        TermEvent {
            start: false,
            identity: identity.into(),
            token,
            at,
            pid: None,
        }
    }

    const MS: i128 = 1_000_000;

    fn freeze(pids: &[i32], stopped_ms: i128, thawed_ms: i128) -> Freeze {
        Freeze {
            pids: pids.iter().copied().collect(),
            stopped: stopped_ms * MS,
            thawed: thawed_ms * MS,
        }
    }

    /// A term whose COMMAND was in a frozen group is marked at the first freeze after its
    /// start, though its log had no start line when the freeze read it; an earlier mark stays;
    /// a freeze after the term stopped or was killed does not count, nor one long before its
    /// start (a process that had its pid before). A start line written just after a thaw by a
    /// process of the freeze is moved to the freeze; one written during it is a freeze that
    /// missed its process.
    #[test]
    fn freezes_mark_terms_by_process() {
        let mut events = [
            start("a", 1, 100 * MS, 7),
            start("b", 2, 5_000 * MS, 8),
            start("a", 3, 3_000 * MS, 9),
            start("c", 4, 100 * MS, 10),
            stop("c", 4, 200 * MS),
            start("d", 5, 100 * MS, 11),
            start("e", 6, 2_500 * MS, 12),
            start("f", 7, 4_100 * MS, 13),
        ];
        let freezes = [
            freeze(&[7, 9], 300, 480),
            freeze(&[7, 9], 3_600, 3_780),
            freeze(&[8], 50, 230),
            freeze(&[10, 11], 900, 1_080),
            freeze(&[12], 2_000, 2_180),
            freeze(&[13], 4_000, 4_180),
        ];
        let mut frozen = Marks::new();
        frozen.insert(("a".into(), 3), 3_550 * MS);
        let killed = Marks::from([(("d".into(), 5), 400 * MS)]);
        let missed = mark_frozen_by_pid(&mut events, &freezes, &killed, &mut frozen);
        assert_eq!(frozen.get(&("a".into(), 1)), Some(&(300 * MS)));
        assert_eq!(
            frozen.get(&("b".into(), 2)),
            None,
            "frozen long before it started"
        );
        assert_eq!(
            frozen.get(&("a".into(), 3)),
            Some(&(3_550 * MS)),
            "the earlier mark stays"
        );
        assert_eq!(
            frozen.get(&("c".into(), 4)),
            None,
            "its pid frozen after it stopped"
        );
        assert_eq!(
            frozen.get(&("d".into(), 5)),
            None,
            "its pid frozen after it was killed"
        );
        assert_eq!(
            frozen.get(&("e".into(), 6)),
            Some(&(2_000 * MS)),
            "frozen before it wrote its start line"
        );
        assert_eq!(events[6].at, 2_000 * MS, "its start moved to the freeze");
        assert_eq!(missed.len(), 1, "{missed:?}");
        assert!(missed[0].starts_with("f (token 7)"), "{missed:?}");
        assert_eq!(frozen.get(&("f".into(), 7)), None);
    }

    /// Two terms of a shard as a freeze left them: the earlier one's COMMAND was frozen while
    /// it started, wrote its start line once resumed, after the next term had begun, and was
    /// killed at once. Its term ends at the freeze; without the move its late start line would
    /// read as an overlap and a token that went down.
    #[test]
    fn a_command_frozen_while_starting_acts_as_a_frozen_term() {
        let events = vec![
            start("s2.8", 65, 2_000 * MS, 1443),
            start("s0.8", 64, 2_810 * MS, 1270),
            stop("s2.8", 65, 3_000 * MS),
        ];
        let freezes = [freeze(&[1268, 1270], 1_000, 2_800)];
        let gone = Marks::from([(("s0.8".into(), 64), 2_816 * MS)]);
        let check = |events: &[TermEvent], frozen: &Marks| {
            checker::check(&checker::terms_seen(events, &Marks::new(), frozen, &gone))
        };
        let (overlaps, _) = check(&events, &Marks::new());
        assert_eq!(overlaps, 1, "the late start line alone reads as an overlap");

        let mut events = events;
        let mut frozen = Marks::new();
        let missed = mark_frozen_by_pid(&mut events, &freezes, &Marks::new(), &mut frozen);
        assert!(missed.is_empty(), "{missed:?}");
        assert_eq!(frozen.get(&("s0.8".into(), 64)), Some(&(1_000 * MS)));
        assert_eq!(check(&events, &frozen), (0, Vec::new()));
    }

    /// A write is stale when the sink accepted it after a term with a higher token had started,
    /// but a frozen term's write after its freeze is the fence's to judge: accepted only before
    /// the next term's first write.
    #[test]
    fn writes_resumed_after_a_freeze_are_judged_by_the_fence() {
        let starts = [start("s0", 400, 100, 1), start("s1", 401, 300, 2)];
        assert_eq!(
            judge_write(400, 120, true, &starts, Some(150)),
            Judged::Fine
        );
        assert_eq!(judge_write(401, 305, true, &starts, None), Judged::Fine);
        assert_eq!(
            judge_write(400, 320, true, &starts, Some(150)),
            Judged::Resumed
        );
        assert_eq!(
            judge_write(400, 320, true, &starts, None),
            Judged::Stale(401),
            "a term never frozen that wrote after the next began"
        );
        assert_eq!(
            judge_write(400, 320, true, &starts, Some(330)),
            Judged::Stale(401),
            "written before its freeze"
        );
        assert_eq!(
            judge_write(400, 340, false, &starts, Some(150)),
            Judged::Refused
        );
    }
}
