//! A schedule workload under faults: three replicas of `leader cron --missed all --retries 1
//! --timeout 3s -- fenced-writer` against one backend, each firing's COMMAND logging its
//! scheduled instant, attempt and token, writing through the fenced sink for 600 ms and logging
//! its end, the first attempt of every seventh second failing on purpose; faults into whichever
//! replica leads (SIGKILL, SIGSTOP past the lease, its connection cut) and into the server (a
//! crash and restart); after each fault an operator's `leader cron trigger`, every 25th fault
//! (the second first) a `suspend` for 4 s and a `resume`, and every 50th (every quarter of a
//! shorter run) a new configuration revision rolled out one replica at a time: its schedule
//! moves every instant (every second, then odd and even seconds in turn) and its overlap policy
//! goes allow, forbid, replace in turn (see [`plan`]). The replicas' wall clocks disagree
//! (libfaketime): one right, one 1.5 s ahead, one 1.5 s behind.
//!
//! The checker accounts for every scheduled instant: no (instant, attempt) started twice, no
//! instant of the schedule in force from the first to the last left unstarted (the missed
//! policy runs every missed firing) but those a suspension counted missed (due while
//! suspended, or waiting when the leader saw it), those of the old schedule a
//! change found unhandled (counted missed), and those a `replace` leader superseded after a
//! fault; no instant started that no schedule in force has; a failed first attempt retried, a
//! retry only of a firing started before (or recorded as started by a leader that a fault
//! stopped before its COMMAND ran); under `forbid` and `replace` no two firings of one term
//! side by side; a trigger run at most once, and no stale write accepted by the sink.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::sleep;

use self::plan::{Change, SKEW, configuration, in_force};
use super::Programs;
use super::campaign::{
    Backend, Fault, HarnessError, Settings, Stage, command_group, crash_and_restart, drain_sink,
    place, replica_log_filter, resume_command_first, resume_supervisor, stage, stop_replicas,
    timing_args, token_sink,
};
use super::checker;
use super::proxy::{Mode, Proxy};
use super::servers::PrivateServer;

/// What a schedule workload under faults saw.
#[derive(Clone, Debug, Default)]
pub struct FiringsReport {
    /// Faults injected.
    pub faults: usize,
    /// Scheduled instants from the first started to the last.
    pub instants: usize,
    /// Starts of a firing's COMMAND (attempts included).
    pub starts: usize,
    /// Starts that were a retry (attempt 2 or more).
    pub retries: usize,
    /// Retries of an attempt recorded as started whose COMMAND never ran (its leader faulted
    /// between the record's write and the COMMAND's start): a retry, as the policy says.
    pub retried_unstarted: usize,
    /// (instant, attempt) pairs started more than once: must be 0.
    pub started_twice: usize,
    /// Instants never started: must be 0 (every missed firing runs), but for those due while
    /// the schedule was suspended.
    pub lost: usize,
    /// Instants not started because they were due while the schedule was suspended.
    pub suspended_missed: usize,
    /// Configuration revisions rolled out under the running schedule (each changes its
    /// instants and its overlap policy).
    pub changes: usize,
    /// Instants of the old schedule not started because a change found them unhandled (the
    /// record counts them missed), and the new schedule's first instants near a change that
    /// the changing leader's clock (off by up to 1.5 s) put before it.
    pub changed_missed: usize,
    /// Instants a `replace` leader found due together after a fault and superseded by the
    /// latest (the record counts them missed, as the policy says).
    pub superseded: usize,
    /// Firings of one term that ran side by side under `forbid` or `replace`: must be 0.
    pub side_by_side: usize,
    /// Instants never started that a leader gave up near a fault: each of their attempts was
    /// recorded as started by a leader a fault stopped before its COMMAND logged, and the
    /// attempts (`--attempts`, 3) ran out, as the policy says.
    pub given_up: usize,
    /// Firings whose first attempt failed on purpose.
    pub failed_on_purpose: usize,
    /// Of those, retried (attempt 2 started).
    pub failures_retried: usize,
    /// `leader cron trigger` requests sent.
    pub triggers_sent: usize,
    /// Firings asked for by a trigger that started (a trigger not started yet is replaced by a
    /// newer one, so at most `triggers_sent`).
    pub triggers_ran: usize,
    /// Writes to the fenced sink.
    pub writes: usize,
    /// Stale writes the sink refused.
    pub stale_refused: usize,
    /// Stale writes the sink accepted: must be 0.
    pub stale_accepted: usize,
    /// From each scheduled instant to its first start, by the wall clock (one machine).
    pub lateness: BTreeMap<DateTime<Utc>, Duration>,
    /// When each fault was injected, by the wall clock.
    pub faulted_at: Vec<DateTime<Utc>>,
    /// Every broken rule, in words.
    pub violations: Vec<String>,
}

impl FiringsReport {
    /// From a scheduled instant to its first start, the worst.
    #[must_use]
    pub fn worst_lateness(&self) -> Duration {
        self.lateness.values().max().copied().unwrap_or_default()
    }
}

/// One started firing, as its COMMAND logged it.
struct Started {
    scheduled: DateTime<Utc>,
    attempt: u32,
    token: u64,
    at: i128,
}

fn log_file(path: &Path) -> Result<std::fs::File, HarnessError> {
    std::fs::File::create(path).map_err(|source| HarnessError::Io {
        what: format!("creating {}", path.display()),
        source,
    })
}

/// The scheduled instants the replicas' logs say were given up (`a firing is given up
/// ... scheduled=2026-11-28 16:49:09 UTC ...`).
fn given_up(dir: &Path) -> BTreeSet<DateTime<Utc>> {
    let logs = std::fs::read_dir(dir).into_iter().flatten().flatten();
    logs.filter(|entry| entry.path().extension().is_some_and(|e| e == "stderr"))
        .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
        .flat_map(|text| {
            text.lines()
                .filter(|line| line.contains("a firing is given up"))
                .filter_map(|line| {
                    let (_, rest) = line.split_once("scheduled=")?;
                    let (at, _) = rest.split_once(" UTC")?;
                    chrono::NaiveDateTime::parse_from_str(at, "%Y-%m-%d %H:%M:%S%.f")
                        .ok()
                        .map(|at| at.and_utc())
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn parse(log: &Path) -> Vec<Started> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let scheduled = DateTime::parse_from_rfc3339(fields.next()?)
                .ok()?
                .with_timezone(&Utc);
            let attempt = fields.next()?.parse().ok()?;
            let token = fields.next()?.parse().ok()?;
            let _identity = fields.next()?;
            let at = fields.next()?.parse().ok()?;
            Some(Started {
                scheduled,
                attempt,
                token,
                at,
            })
        })
        .collect()
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
    /// When the last fault was injected, by the wall clock.
    faulted_at: Option<DateTime<Utc>>,
    /// Operators' requests sent: triggers.
    triggers: usize,
    /// From each `suspend` to its `resume`, by the wall clock.
    suspensions: Vec<(DateTime<Utc>, DateTime<Utc>)>,
    /// The configuration revision rolled out last, and each replica's.
    revision: u64,
    revisions: Vec<u64>,
    /// Each replica incarnation's overlap policy, by identity.
    policies: BTreeMap<String, &'static str>,
    /// The schedule changes the record showed after each rollout.
    changes: Vec<Change>,
    /// libfaketime's library, when the replicas' clocks are to disagree.
    faketime: Option<std::path::PathBuf>,
}

/// The first attempt of a firing at a multiple of this many seconds fails on purpose.
const FAILS_EVERY: i64 = 7;

impl Run<'_> {
    fn spawn(&mut self, slot: usize) -> Result<(), HarnessError> {
        self.incarnations[slot] += 1;
        let identity = format!("f{slot}.{}", self.incarnations[slot]);
        let port = self.proxies.get(slot).map_or(0, Proxy::port);
        let (url, env) = self.backend.replica_lock(self.dir, port, &self.settings)?;
        let revision = self.revisions[slot];
        let (schedule, _, overlap) = configuration(revision);
        self.policies.insert(identity.clone(), overlap);
        let mut command = Command::new(&self.programs.leader);
        if let Some(library) = &self.faketime {
            // A fixed offset, read once (not a file read at every call, which slows every
            // reading of the clock); the monotonic clock stays the system's.
            command
                .env("LD_PRELOAD", library)
                .env("FAKETIME", plan::clock_offset(slot))
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let child = command
            .args(["cron", "--lock", &url, "--name", &self.name])
            .args(["--identity", &identity])
            .args(schedule)
            .args(["--schedule-revision", &revision.to_string()])
            .args(["--missed", "all", "--missed-max", "100000"])
            .args(["--overlap", overlap])
            .args(["--retries", "1", "--retry-backoff", "1s", "--timeout", "3s"])
            .args(timing_args(&self.settings))
            .arg("--")
            .arg(&self.programs.writer)
            .env("DATABASE_URL", self.sink.0)
            .env("SINK", self.sink.1)
            .env("FIRINGS_LOG", self.dir.join("firings.log"))
            // 600 ms of writes per firing: a frozen leader is often caught inside one, and its
            // writes after it is resumed exercise the fence.
            .env("FIRING_WRITES", "30")
            .env("FIRING_FAILS", FAILS_EVERY.to_string())
            // The schedule's warnings (a firing given up, run again) kept for the checker.
            .env("RUST_LOG", replica_log_filter("error,leader_cron=warn"))
            .env("NO_COLOR", "1")
            .envs(env)
            .stdout(Stdio::null())
            .stderr(log_file(&self.dir.join(format!("{identity}.stderr")))?)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| HarnessError::Io {
                what: "spawning leader cron".into(),
                source,
            })?;
        place(&mut self.replicas, slot, (identity, child));
        Ok(())
    }

    /// An operator's request for the schedule (`leader cron suspend|resume|trigger`), through
    /// the first proxy; whether it was taken.
    async fn request(&self, what: &str) -> bool {
        let port = self.proxies.first().map_or(0, Proxy::port);
        let Ok((url, env)) = self.backend.replica_lock(self.dir, port, &self.settings) else {
            return false;
        };
        Command::new(&self.programs.leader)
            .args([
                "cron", what, "--lock", &url, "--name", &self.name, "--by", "harness",
            ])
            .envs(env)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .is_ok_and(|status| status.success())
    }

    /// After a fault: an operator asks for a firing now, and after the second fault and every
    /// 25th after it suspends the schedule for 4 s.
    async fn operate(&mut self, done: usize) {
        if self.request("trigger").await {
            self.triggers += 1;
        }
        if done % 25 == 1 {
            let from = Utc::now();
            if self.request("suspend").await {
                sleep(Duration::from_secs(4)).await;
                while !self.request("resume").await {
                    sleep(Duration::from_millis(500)).await;
                }
                self.suspensions.push((from, Utc::now()));
            }
        }
    }

    /// A new configuration revision, rolled out as a Deployment does: each replica in turn
    /// stopped (SIGTERM) and started again with it. The change the record then shows (when,
    /// by the changing leader's clock) is kept for the checker; a change that never shows is a
    /// violation.
    async fn roll_out(&mut self) -> Result<Option<String>, HarnessError> {
        self.revision += 1;
        for slot in 0..self.replicas.len() {
            stop_replicas(std::slice::from_mut(&mut self.replicas[slot])).await;
            let _ = self.replicas[slot].1.kill().await;
            self.revisions[slot] = self.revision;
            self.spawn(slot)?;
            sleep(Duration::from_secs(1)).await;
        }
        for _ in 0..100 {
            if let Some(status) = self.status().await {
                let changed = &status["schedules"][0]["changed"];
                let at = changed["at"]
                    .as_str()
                    .and_then(|at| DateTime::parse_from_rfc3339(at).ok());
                if changed["revision"].as_u64() == Some(self.revision)
                    && let Some(at) = at
                {
                    let (_, instants, policy) = configuration(self.revision);
                    self.changes.push(Change {
                        at: at.with_timezone(&Utc),
                        instants,
                        policy,
                    });
                    return Ok(None);
                }
            }
            self.restart_exited()?;
            sleep(Duration::from_millis(200)).await;
        }
        Ok(Some(format!(
            "the change to revision {} never showed in the record",
            self.revision
        )))
    }

    /// `leader status --json` for the schedule's election (its lock URL through the first
    /// proxy).
    async fn status(&self) -> Option<serde_json::Value> {
        let port = self.proxies.first().map_or(0, Proxy::port);
        let (url, env) = self
            .backend
            .replica_lock(self.dir, port, &self.settings)
            .ok()?;
        let output = Command::new(&self.programs.leader)
            .args(["status", "--json", "--lock", &url, "--name", &self.name])
            .envs(env)
            .output()
            .await
            .ok()?;
        serde_json::from_slice(&output.stdout).ok()
    }

    /// The replica that holds the lease now, as `leader status` says.
    ///
    /// `leader status` judges a lease by the store's clock where the store keeps one (etcd,
    /// Redis), and otherwise by the record's renew time, written by the holder's clock: the
    /// harness knows each replica's offset and reads that time back on its own clock.
    async fn leader(&self) -> Option<usize> {
        let status = self.status().await?;
        let holder = status["holder"].as_str()?;
        let slot = self.replicas.iter().position(|(id, _)| id == holder)?;
        let expired = if status["expiresInMillis"].is_u64() || self.faketime.is_none() {
            status["expired"].as_bool() == Some(true)
        } else {
            let renewed = status["renewTime"]
                .as_str()
                .and_then(|at| DateTime::parse_from_rfc3339(at).ok())?;
            let offset: f64 = plan::clock_offset(slot).parse().ok()?;
            let lease = chrono::Duration::milliseconds(status["leaseDurationMillis"].as_i64()?);
            let offset = chrono::Duration::milliseconds((offset * 1000.0) as i64);
            renewed.with_timezone(&Utc) - offset + lease < Utc::now()
        };
        (!expired).then_some(slot)
    }

    async fn settled_leader(&mut self) -> Result<Option<usize>, HarnessError> {
        for _ in 0..100 {
            if let Some(slot) = self.leader().await {
                return Ok(Some(slot));
            }
            self.restart_exited()?;
            sleep(Duration::from_millis(200)).await;
        }
        Ok(None)
    }

    /// Starts again every replica whose process has exited (one that could not reach a
    /// restarting server, or whose open timed out on a loaded machine), as an orchestrator
    /// would.
    fn restart_exited(&mut self) -> Result<(), HarnessError> {
        for slot in 0..self.replicas.len() {
            if let Ok(Some(_)) = self.replicas[slot].1.try_wait() {
                self.spawn(slot)?;
            }
        }
        Ok(())
    }

    async fn inject(&mut self, fault: Fault) -> Result<Option<String>, HarnessError> {
        let Some(slot) = self.settled_leader().await? else {
            return Ok(Some(format!("no leader before {}", fault.name())));
        };
        let pid = self.replicas[slot]
            .1
            .id()
            .map(|p| Pid::from_raw(p.cast_signed()));
        let lasts = self.settings.lease + Duration::from_secs(1);
        self.faulted_at = Some(Utc::now());
        match fault {
            Fault::Kill => {
                if let Some(pid) = pid {
                    let _ = kill(pid, Signal::SIGKILL);
                }
                let _ = self.replicas[slot].1.wait().await;
                sleep(lasts).await;
                self.spawn(slot)?;
            }
            Fault::Freeze => {
                let group = pid.and_then(|p| command_group(p.as_raw().cast_unsigned()));
                if let Some(group) = group {
                    let _ = killpg(group, Signal::SIGSTOP);
                }
                if let Some(pid) = pid {
                    let _ = kill(pid, Signal::SIGSTOP);
                }
                sleep(lasts).await;
                if let Some(group) = group {
                    resume_command_first(group);
                    resume_supervisor(group);
                }
                if let Some(pid) = pid {
                    let _ = kill(pid, Signal::SIGCONT);
                }
            }
            Fault::Cut => {
                self.proxies[slot].set(Mode::Cut);
                sleep(lasts).await;
                self.proxies[slot].set(Mode::Open);
            }
            Fault::Restart => {
                crash_and_restart(&mut self.server, self.settings.lease).await?;
            }
            _ => return Ok(None),
        }
        // A replica that could not reach a restarting server exits as unreachable at start.
        self.restart_exited()?;
        // A firing or so on the leader now in place before the next fault (which waits for
        // a settled leader first).
        sleep(Duration::from_secs(1)).await;
        Ok(None)
    }
}

/// The faults a schedule workload takes on `backend`.
#[must_use]
pub fn faults_for(backend: Backend) -> Vec<Fault> {
    backend
        .faults()
        .iter()
        .copied()
        .filter(|f| matches!(f, Fault::Kill | Fault::Freeze | Fault::Cut | Fault::Restart))
        .collect()
}

/// What the workload changes beside the faults.
#[derive(Clone, Copy, Debug)]
pub struct Variations {
    /// A new configuration revision rolled out after every this many faults (none: the first
    /// configuration throughout).
    pub change_every: Option<usize>,
    /// Whether the replicas' wall clocks disagree (libfaketime: one right, one 1.5 s ahead,
    /// one 1.5 s behind).
    pub skewed_clocks: bool,
}

impl Variations {
    /// The fault campaign's: a rollout every 50th fault (`FAULT_CHANGE_EVERY`), or after each
    /// quarter of a shorter run (a round of four faults rolls out forbid, replace and allow in
    /// turn), and clocks that disagree.
    #[must_use]
    pub fn campaign(faults: usize) -> Self {
        let every = std::env::var("FAULT_CHANGE_EVERY")
            .ok()
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or((faults / 4).clamp(1, 50));
        Self {
            change_every: Some(every.max(1)),
            skewed_clocks: true,
        }
    }

    /// Neither: one configuration, one clock (what a measurement of failovers wants).
    #[must_use]
    pub fn none() -> Self {
        Self {
            change_every: None,
            skewed_clocks: false,
        }
    }
}

/// Runs the schedule workload against `backend` with `faults` in order, and `variations`
/// beside them.
///
/// # Errors
/// Something could not be set up; what goes wrong under the faults is in the report.
pub async fn run(
    backend: Backend,
    faults: &[Fault],
    variations: Variations,
    settings: Settings,
    programs: &Programs,
    sink_url: &str,
) -> Result<FiringsReport, HarnessError> {
    let (tag, prefix) = token_sink(sink_url, "firing").await?;
    // The clocks disagree where libfaketime is installed (under CI it must be).
    let faketime = variations
        .skewed_clocks
        .then(leader_test_support::faketime_or_skip)
        .flatten();
    // The harness's wall clock at one monotonic instant: the COMMANDs' monotonic times, which
    // no replica's skewed clock touches, read as wall-clock times.
    let origin = (crate::now_ns(), Utc::now());
    let wall = |ns: i128| {
        origin.1 + chrono::Duration::nanoseconds(i64::try_from(ns - origin.0).unwrap_or_default())
    };
    let Stage {
        dir,
        server,
        proxies,
    } = stage(backend, programs, settings.replicas).await?;
    let mut run = Run {
        backend,
        settings,
        programs,
        name: format!("firings-{tag}"),
        dir: dir.path(),
        sink: (sink_url, &prefix),
        server,
        proxies,
        replicas: Vec::new(),
        incarnations: vec![0; settings.replicas],
        faulted_at: None,
        triggers: 0,
        suspensions: Vec::new(),
        revision: 1,
        revisions: vec![1; settings.replicas],
        policies: BTreeMap::new(),
        changes: Vec::new(),
        faketime,
    };
    let mut report = FiringsReport::default();
    let outcome = async {
        (0..settings.replicas).try_for_each(|slot| run.spawn(slot))?;
        sleep(Duration::from_secs(3)).await;
        for (done, fault) in faults.iter().enumerate() {
            let injected = run.inject(*fault).await;
            report.faulted_at.extend(run.faulted_at.take());
            run.operate(done).await;
            let change = variations
                .change_every
                .is_some_and(|every| (done + 1) % every == 0 && done + 1 < faults.len());
            if change {
                match run.roll_out().await? {
                    Some(violation) => report.violations.push(violation),
                    None => report.changes += 1,
                }
            }
            match injected? {
                Some(violation) => report.violations.push(violation),
                None => report.faults += 1,
            }
            let what = format_args!("{} firings", backend.name());
            super::say_progress(what, done + 1, faults.len());
        }
        sleep(Duration::from_secs(3)).await;
        Ok::<(), HarnessError>(())
    }
    .await;
    stop_replicas(&mut run.replicas).await;
    outcome?;

    report.triggers_sent = run.triggers;
    let log = std::fs::read_to_string(dir.path().join("firings.log")).unwrap_or_default();
    let started = parse(&dir.path().join("firings.log"));
    let side_by_side = plan::overlaps(&plan::spans(&log), &run.policies);
    report.side_by_side = side_by_side.len();
    report.violations.extend(side_by_side);
    let skew = chrono::Duration::from_std(SKEW).unwrap_or_default();
    let mut attempts: BTreeMap<DateTime<Utc>, Vec<u32>> = BTreeMap::new();
    for s in &started {
        attempts.entry(s.scheduled).or_default().push(s.attempt);
    }
    // Firings asked for now have the request's instant, never a whole second.
    let triggered = |at: &DateTime<Utc>| at.timestamp_subsec_nanos() != 0;
    report.triggers_ran = attempts.keys().filter(|at| triggered(at)).count();
    if report.triggers_ran > report.triggers_sent {
        report.violations.push(format!(
            "{} triggered firings ran for {} requests",
            report.triggers_ran, report.triggers_sent
        ));
    }
    let near_fault = |instant: &DateTime<Utc>| {
        let near = chrono::Duration::from_std(settings.lease * 2 + Duration::from_secs(3))
            .unwrap_or_default()
            + skew;
        report
            .faulted_at
            .iter()
            .any(|at| *at - near <= *instant && *instant <= *at + near)
    };
    // The run ends (the replicas stopped) a few seconds after the last fault: a firing that
    // failed in its last seconds has no time left for its retry (--retry-backoff 1s).
    let last_start = started.iter().map(|s| wall(s.at)).max().unwrap_or(origin.1);
    let cut_by_the_end =
        |instant: &DateTime<Utc>| *instant + chrono::Duration::seconds(3) + skew > last_start;
    // A failed first attempt is retried, unless a fault near it ended its leader's term (then
    // the next leader may find it interrupted, or its failure unrecorded).
    for (instant, runs) in &attempts {
        if crate::firing_fails(*instant, true, FAILS_EVERY) && runs.contains(&1) {
            report.failed_on_purpose += 1;
            if runs.contains(&2) {
                report.failures_retried += 1;
            } else if !near_fault(instant) && !cut_by_the_end(instant) {
                report.violations.push(format!(
                    "{instant}: a failed firing was not retried ({runs:?})"
                ));
            }
        }
    }
    // A suspension counts missed what has not started when the leader sees it: the instants
    // due while suspended, and those still waiting then (a backlog after a failover, or behind
    // a running firing under forbid), which lie after the last one started before it.
    let lag = chrono::Duration::from_std(settings.lease * 2 + Duration::from_secs(3))
        .unwrap_or_default()
        + skew;
    // What was still waiting at `when` (by a clock off by the skew at most) lies after the
    // last scheduled instant started before it.
    let waiting_after = |when: DateTime<Utc>| {
        attempts
            .keys()
            .rfind(|at| !triggered(at) && **at < when - skew)
            .map_or(when - skew, |last| *last)
    };
    let suspended_since: Vec<(DateTime<Utc>, DateTime<Utc>)> = run
        .suspensions
        .iter()
        .map(|(from, to)| (waiting_after(*from), *to + lag))
        .collect();
    let suspended = |instant: &DateTime<Utc>| {
        suspended_since
            .iter()
            .any(|(after, until)| *after < *instant && *instant <= *until)
    };
    report.starts = started.len();
    report.retries = started.iter().filter(|s| s.attempt > 1).count();
    for (instant, runs) in &attempts {
        let distinct: BTreeSet<u32> = runs.iter().copied().collect();
        report.started_twice += runs.len() - distinct.len();
        if runs.len() > distinct.len() {
            report
                .violations
                .push(format!("{instant}: an attempt started twice ({runs:?})"));
        }
        if distinct
            .iter()
            .any(|a| *a > 1 && !distinct.contains(&(a - 1)))
        {
            // The attempt before was recorded as started, but its leader died (or lost its
            // term, or its write's outcome was unknown) before its COMMAND ran: the next leader
            // finds it interrupted and retries it, as the policy says. Only a fault explains it.
            if near_fault(instant) {
                report.retried_unstarted += 1;
            } else {
                report.violations.push(format!(
                    "{instant}: a retry of an attempt never started, with no fault near ({runs:?})"
                ));
            }
        }
    }
    let gave_up = given_up(dir.path());
    // The old schedule's instants a change found unhandled are counted missed: those after the
    // last one started before it (a rollout's failovers, a backlog that forbid runs in turn);
    // the changing leader's clock may be off by the skew either way.
    let change_after = skew + chrono::Duration::seconds(1);
    let unhandled_since: Vec<chrono::Duration> = run
        .changes
        .iter()
        .map(|change| change.at - waiting_after(change.at))
        .collect();
    let near_a_change = |at: &DateTime<Utc>| {
        run.changes
            .iter()
            .zip(&unhandled_since)
            .any(|(change, before)| change.near(*at, *before, change_after))
    };
    let mut scheduled = attempts.keys().filter(|at| !triggered(at));
    if let (Some(first), Some(last)) = (scheduled.next(), scheduled.next_back()) {
        let mut at = *first;
        while at <= *last {
            let (instants, policy) = in_force(&run.changes, at);
            let ran = attempts.contains_key(&at);
            if !instants.contains(at) {
                if ran && !near_a_change(&at) {
                    report.violations.push(format!(
                        "{at}: started, but the schedule in force ({instants:?}) has no such instant"
                    ));
                }
            } else if !ran {
                report.instants += 1;
                if suspended(&at) {
                    report.suspended_missed += 1;
                } else if near_a_change(&at) {
                    report.changed_missed += 1;
                } else if gave_up.contains(&at) && near_fault(&at) {
                    report.given_up += 1;
                } else if policy == "replace" && near_fault(&at) {
                    report.superseded += 1;
                } else {
                    report.lost += 1;
                    report.violations.push(format!("{at}: never started"));
                }
            } else {
                report.instants += 1;
            }
            at += chrono::Duration::seconds(1);
        }
    }
    // Lateness: from each instant to its first start, by the harness's clock (the COMMAND's
    // monotonic time read as the harness's wall clock: the replicas' clocks disagree).
    for s in &started {
        if let Ok(late) = u64::try_from((wall(s.at) - s.scheduled).num_milliseconds()) {
            let late = Duration::from_millis(late);
            let first = report.lateness.entry(s.scheduled).or_insert(late);
            *first = (*first).min(late);
        }
    }

    let rows = drain_sink(sink_url, &prefix, "token, at, accepted").await?;
    report.writes = rows.len();
    for row in &rows {
        let token = u64::try_from(row.get::<_, i64>(0)).unwrap_or(0);
        let at = i128::from(row.get::<_, i64>(1));
        let accepted: bool = row.get(2);
        let highest = checker::highest_started_before(started.iter().map(|s| (s.at, s.token)), at);
        if !accepted {
            report.stale_refused += 1;
        } else if token < highest {
            report.stale_accepted += 1;
            report.violations.push(format!(
                "the sink accepted a stale write (token {token} < {highest})"
            ));
        }
    }
    if !report.violations.is_empty() {
        // The replicas' logs and the firings' log, for whoever looks into a violation.
        let kept = dir.keep();
        eprintln!("schedule workload: logs kept in {}", kept.display());
    }
    Ok(report)
}

mod plan;

#[cfg(test)]
mod tests;
