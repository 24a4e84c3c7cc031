//! A shard workload under faults: three replicas of `leader run --shards 4 -- fenced-writer`
//! against one backend, each shard's COMMAND writing its token through a fenced sink that keeps
//! a high-water mark per shard; faults into the replicas in turn (SIGKILL, SIGSTOP of the
//! replica and its COMMANDs past the lease, its connection cut) and into the server (a crash
//! and restart). The checker takes each shard on its own: its terms (from its COMMANDs' log)
//! never overlap, their tokens grow, and the sink accepted no stale write for it.

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
    drain_sink, proxy_to, stop_replicas, watch_commands,
};
use super::checker::{self, Marks};
use super::proxy::{Mode, Proxy};
use super::servers::PrivateServer;
use crate::{TermEvent, now_ns, term_events};

/// The shards of the workload's set.
pub const SHARDS: u32 = 4;

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
    /// Replicas that exited with no kill aimed at them (and were started again), with their
    /// exit status: each incarnation's stderr is kept beside the logs of a failed run.
    pub exited: Vec<String>,
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
    /// Per shard: a term's identity and token are unique within its shard only.
    killed: BTreeMap<u32, Marks>,
    frozen: BTreeMap<u32, Marks>,
    /// The processes of each freeze's COMMAND groups, and when they were stopped.
    frozen_pids: Vec<(BTreeSet<i32>, i128)>,
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

/// Freeze marks by process: a term whose COMMAND was in a frozen group is marked at the first
/// freeze after its start, unless its own log marked it earlier. Only a freeze while the term
/// could still run counts: before its stop line, and before it was killed. Process ids are
/// reused (a long run wraps around them), so a later process with the pid of a term that had
/// ended is not that term's COMMAND.
fn mark_frozen_by_pid(
    events: &[TermEvent],
    frozen_pids: &[(BTreeSet<i32>, i128)],
    killed: &Marks,
    frozen: &mut Marks,
) {
    for event in events.iter().filter(|e| e.start) {
        let Some(pid) = event.pid else { continue };
        let key = (event.identity.clone(), event.token);
        let stopped = events
            .iter()
            .filter(|e| !e.start && e.identity == event.identity && e.token == event.token)
            .map(|e| e.at)
            .min();
        let ended = [stopped, killed.get(&key).copied()]
            .into_iter()
            .flatten()
            .min();
        let first = frozen_pids
            .iter()
            .filter(|(pids, at)| {
                *at > event.at && ended.is_none_or(|end| *at < end) && pids.contains(&pid)
            })
            .map(|(_, at)| *at)
            .min();
        if let Some(at) = first {
            let mark = frozen.entry(key).or_insert(at);
            *mark = (*mark).min(at);
        }
    }
}

fn shard_log(dir: &Path, shard: u32) -> PathBuf {
    dir.join(format!("job.log.{shard}"))
}

impl Run<'_> {
    fn spawn(&mut self, slot: usize) -> Result<(), HarnessError> {
        self.incarnations[slot] += 1;
        let identity = format!("s{slot}.{}", self.incarnations[slot]);
        let port = self.proxies.get(slot).map_or(0, Proxy::port);
        let (url, env) = self.backend.replica_lock(self.dir, port, &self.settings)?;
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        // Each incarnation's own errors, kept beside the logs of a failed run: why a replica
        // exited is read there.
        let stderr = std::fs::File::create(self.dir.join(format!("leader.{identity}.stderr")))
            .map_err(|source| HarnessError::Io {
                what: "creating a replica's stderr file".into(),
                source,
            })?;
        let child = Command::new(&self.programs.leader)
            .args(["run", "--lock", &url, "--name", &self.name])
            .args(["--identity", &identity, "--shards", &SHARDS.to_string()])
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

    /// The terms `identity` has open now, by the shards' logs: shard, identity and token.
    fn open_terms(&self, identity: &str) -> Vec<(u32, (String, u64))> {
        (0..SHARDS)
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
                let at = now_ns();
                for (shard, key) in open {
                    self.killed.entry(shard).or_default().insert(key, at);
                }
                sleep(lasts).await;
                self.spawn(slot)?;
            }
            Fault::Freeze => {
                let Some(pid) = pid else { return Ok(false) };
                // The replica first, so that it starts no COMMAND once its groups are read.
                let _ = kill(Pid::from_raw(pid.cast_signed()), Signal::SIGSTOP);
                let groups = command_groups(pid);
                for group in &groups {
                    let _ = killpg(*group, Signal::SIGSTOP);
                }
                let at = now_ns();
                for (shard, key) in self.open_terms(&identity) {
                    self.frozen.entry(shard).or_default().insert(key, at);
                }
                // And by process: a COMMAND whose start line is not in its log yet (written
                // late, under load) is frozen all the same; the checker finds its term by pid.
                self.frozen_pids.push((members_of(&groups), at));
                sleep(lasts).await;
                for group in &groups {
                    let _ = killpg(*group, Signal::SIGCONT);
                }
                let _ = kill(Pid::from_raw(pid.cast_signed()), Signal::SIGCONT);
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
        SHARDS - 1
    ))
    .await
    .map_err(&sink_error)?;
    let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
        what: "temporary directory".into(),
        source,
    })?;
    let gone: Vec<Arc<StdMutex<Marks>>> = (0..SHARDS).map(|_| Arc::default()).collect();
    let watchers: Vec<_> = (0..SHARDS)
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
    for shard in 0..SHARDS {
        let killed = run.killed.get(&shard).cloned().unwrap_or_default();
        let seen_gone = gone[shard as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let events = term_events(&shard_log(dir.path(), shard));
        let mut frozen = run.frozen.get(&shard).cloned().unwrap_or_default();
        mark_frozen_by_pid(&events, &run.frozen_pids, &killed, &mut frozen);
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
    }

    let rows = drain_sink(&sink, &prefix, "shard, token, at, accepted", &sink_error).await?;
    report.writes = rows.len();
    let keep = std::env::temp_dir().join(format!("leader-shards-{tag}"));
    for row in &rows {
        let shard = u32::try_from(row.get::<_, i32>(0)).unwrap_or(0);
        let token = u64::try_from(row.get::<_, i64>(1)).unwrap_or(0);
        let at = i128::from(row.get::<_, i64>(2));
        let accepted: bool = row.get(3);
        let highest = starts
            .get(&shard)
            .into_iter()
            .flatten()
            .filter(|s| s.at < at)
            .map(|s| s.token)
            .max()
            .unwrap_or(0);
        if !accepted {
            report.stale_refused += 1;
        } else if token < highest {
            report.stale_accepted += 1;
            report.violations.push(format!(
                "shard {shard}: the sink accepted a stale write (token {token} < {highest})"
            ));
        }
    }
    if !report.violations.is_empty() {
        // The COMMANDs' logs of a failed run are kept for a look.
        let _ = std::fs::create_dir_all(&keep);
        for shard in 0..SHARDS {
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

    /// A term whose COMMAND was in a frozen group is marked at the first freeze after its
    /// start, though its log had no start line when the freeze read it; an earlier mark stays;
    /// a freeze after the term stopped or was killed does not count, though a process that
    /// came later has its pid.
    #[test]
    fn freezes_mark_terms_by_process() {
        let stop = |identity: &str, token: u64, at: i128| TermEvent {
            start: false,
            identity: identity.into(),
            token,
            at,
            pid: None,
        };
        let events = [
            start("a", 1, 100, 7),
            start("b", 2, 100, 8),
            start("a", 3, 500, 9),
            start("c", 4, 100, 10),
            stop("c", 4, 200),
            start("d", 5, 100, 11),
        ];
        let frozen_pids = [
            (BTreeSet::from([7, 9]), 300),
            (BTreeSet::from([7, 9]), 600),
            (BTreeSet::from([8]), 50),
            (BTreeSet::from([10, 11]), 900),
        ];
        let mut frozen = Marks::new();
        frozen.insert(("a".into(), 3), 550);
        let killed = Marks::from([(("d".into(), 5), 400)]);
        mark_frozen_by_pid(&events, &frozen_pids, &killed, &mut frozen);
        assert_eq!(frozen.get(&("a".into(), 1)), Some(&300));
        assert_eq!(
            frozen.get(&("b".into(), 2)),
            None,
            "frozen before it started"
        );
        assert_eq!(
            frozen.get(&("a".into(), 3)),
            Some(&550),
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
    }
}
