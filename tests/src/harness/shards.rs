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
use super::campaign::{
    Backend, Fault, HarnessError, Settings, Stage, connect_sink, crash_and_restart, drain_sink,
    place, replica_log_filter, resume_command_first, resume_supervisor, stage, stop_replicas,
    timing_args, watch_commands,
};
use super::checker::{self, Marks};
use super::proxy::{Mode, Proxy};
use super::servers::PrivateServer;
use crate::{TermEvent, now_ns, term_events};

mod freeze;
mod operations;

use freeze::*;

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
            .args(timing_args(&self.settings))
            .arg("--")
            .arg(&self.programs.writer)
            .env("DATABASE_URL", self.sink.0)
            .env("SINK", self.sink.1)
            .env("JOB_LOG", self.dir.join("job.log"))
            .env("RUST_LOG", replica_log_filter("error"))
            .envs(env)
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| HarnessError::Io {
                what: "spawning leader run --shards".into(),
                source,
            })?;
        place(&mut self.replicas, slot, (identity, child));
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
                for &group in &groups {
                    resume_command_first(group);
                }
                for &group in &groups {
                    resume_supervisor(group);
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
    let Stage {
        dir,
        server,
        proxies,
    } = stage(backend, programs, settings.replicas).await?;
    let gone: Vec<Arc<StdMutex<Marks>>> = (0..MOST_SHARDS).map(|_| Arc::default()).collect();
    let watchers: Vec<_> = (0..MOST_SHARDS)
        .map(|shard| watch_commands(shard_log(dir.path(), shard), gone[shard as usize].clone()))
        .collect();
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
    let outcome = async {
        (0..settings.replicas).try_for_each(|slot| run.spawn(slot))?;
        sleep(Duration::from_secs(3)).await;
        for (turn, fault) in faults.iter().enumerate() {
            if run.inject(*fault, turn).await? {
                report.faults += 1;
            }
            run.operate(turn, &mut report).await?;
            let what = format_args!("{} shards", backend.name());
            super::say_progress(what, turn + 1, faults.len());
        }
        sleep(Duration::from_secs(3)).await;
        Ok::<(), HarnessError>(())
    }
    .await;
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
mod tests;
