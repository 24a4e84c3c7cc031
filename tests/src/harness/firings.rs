//! A schedule workload under faults: three replicas of `leader cron --every 1s --missed all
//! --overlap allow --retries 1 --timeout 3s -- fenced-writer` against one backend, each firing's
//! COMMAND logging its scheduled instant, attempt and token and writing through the fenced sink
//! for 600 ms, the first attempt of every seventh second failing on purpose; faults into
//! whichever replica leads (SIGKILL, SIGSTOP past the lease, its connection cut) and into the
//! server (a crash and restart); after each fault an operator's `leader cron trigger`, and every
//! 25th fault (the second first) a `suspend` for 4 s and a `resume`. The checker accounts for every scheduled
//! instant: no (instant, attempt) started twice, no instant from the first to the last left
//! unstarted (the policy runs every missed firing) but those due while suspended, a failed first
//! attempt retried, a retry only of a firing started before (or recorded as started by a leader
//! that a fault stopped before its COMMAND ran), a trigger run at most once, and no stale write
//! accepted by the sink.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use chrono::{DateTime, Utc};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::sleep;

use super::Programs;
use super::campaign::{
    Backend, Fault, HarnessError, Settings, Stage, command_group, crash_and_restart, drain_sink,
    place, replica_log_filter, stage, stop_replicas, timing_args, token_sink,
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
    /// When it started, by the wall clock (milliseconds since the epoch).
    wall_ms: i64,
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
            let wall_ms = fields.next()?.parse().ok()?;
            Some(Started {
                scheduled,
                attempt,
                token,
                at,
                wall_ms,
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
}

/// The first attempt of a firing at a multiple of this many seconds fails on purpose.
const FAILS_EVERY: i64 = 7;

impl Run<'_> {
    fn spawn(&mut self, slot: usize) -> Result<(), HarnessError> {
        self.incarnations[slot] += 1;
        let identity = format!("f{slot}.{}", self.incarnations[slot]);
        let port = self.proxies.get(slot).map_or(0, Proxy::port);
        let (url, env) = self.backend.replica_lock(self.dir, port, &self.settings)?;
        let child = Command::new(&self.programs.leader)
            .args(["cron", "--lock", &url, "--name", &self.name])
            .args(["--identity", &identity, "--every", "1s"])
            .args([
                "--missed",
                "all",
                "--missed-max",
                "100000",
                "--overlap",
                "allow",
            ])
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

    /// The replica that holds the lease now, as `leader status` says (its lock URL through the
    /// first proxy).
    async fn leader(&self) -> Option<usize> {
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
        let status: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
        let holder = status["holder"].as_str()?;
        if status["expired"].as_bool() == Some(true) {
            return None;
        }
        self.replicas.iter().position(|(id, _)| id == holder)
    }

    async fn settled_leader(&self) -> Option<usize> {
        for _ in 0..100 {
            if let Some(slot) = self.leader().await {
                return Some(slot);
            }
            sleep(Duration::from_millis(200)).await;
        }
        None
    }

    async fn inject(&mut self, fault: Fault) -> Result<Option<String>, HarnessError> {
        let Some(slot) = self.settled_leader().await else {
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
                    let _ = killpg(group, Signal::SIGCONT);
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
        // A replica that could not reach a restarting server exits as unreachable at start:
        // start it again, as an orchestrator would.
        for slot in 0..self.replicas.len() {
            if let Ok(Some(_)) = self.replicas[slot].1.try_wait() {
                self.spawn(slot)?;
            }
        }
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

/// Runs the schedule workload against `backend` with `faults` in order.
///
/// # Errors
/// Something could not be set up; what goes wrong under the faults is in the report.
pub async fn run(
    backend: Backend,
    faults: &[Fault],
    settings: Settings,
    programs: &Programs,
    sink_url: &str,
) -> Result<FiringsReport, HarnessError> {
    let (tag, prefix) = token_sink(sink_url, "firing").await?;
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
    };
    let mut report = FiringsReport::default();
    let mut outcome = (0..settings.replicas).try_for_each(|slot| run.spawn(slot));
    if outcome.is_ok() {
        sleep(Duration::from_secs(3)).await;
        for (done, fault) in faults.iter().enumerate() {
            let injected = run.inject(*fault).await;
            report.faulted_at.extend(run.faulted_at.take());
            run.operate(done).await;
            match injected {
                Ok(Some(violation)) => report.violations.push(violation),
                Ok(None) => report.faults += 1,
                Err(err) => {
                    outcome = Err(err);
                    break;
                }
            }
            if (done + 1) % 100 == 0 {
                eprintln!(
                    "{} firings: {} of {} faults",
                    backend.name(),
                    done + 1,
                    faults.len()
                );
            }
        }
        sleep(Duration::from_secs(3)).await;
    }
    stop_replicas(&mut run.replicas).await;
    outcome?;

    report.triggers_sent = run.triggers;
    let started = parse(&dir.path().join("firings.log"));
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
            .unwrap_or_default();
        report
            .faulted_at
            .iter()
            .any(|at| *at - near <= *instant && *instant <= *at + near)
    };
    // The run ends (the replicas stopped) a few seconds after the last fault: a firing that
    // failed in its last seconds has no time left for its retry (--retry-backoff 1s).
    let last_start = started.iter().map(|s| s.wall_ms).max().unwrap_or_default();
    let cut_by_the_end = |instant: &DateTime<Utc>| instant.timestamp_millis() + 3_000 > last_start;
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
    let suspended = |instant: &DateTime<Utc>| {
        let lag = chrono::Duration::from_std(settings.lease * 2 + Duration::from_secs(3))
            .unwrap_or_default();
        run.suspensions
            .iter()
            .any(|(from, to)| *from <= *instant && *instant <= *to + lag)
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
    let mut scheduled = attempts.keys().filter(|at| !triggered(at));
    if let (Some(first), Some(last)) = (scheduled.next(), scheduled.next_back()) {
        let mut at = *first;
        while at <= *last {
            report.instants += 1;
            if !attempts.contains_key(&at) {
                if suspended(&at) {
                    report.suspended_missed += 1;
                } else if gave_up.contains(&at) && near_fault(&at) {
                    report.given_up += 1;
                } else {
                    report.lost += 1;
                    report.violations.push(format!("{at}: never started"));
                }
            }
            at += chrono::Duration::seconds(1);
        }
    }
    // Lateness: from each instant to its first start, by the wall clock (one machine).
    for s in &started {
        if let Ok(late) = u64::try_from(s.wall_ms - s.scheduled.timestamp_millis()) {
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

#[cfg(test)]
mod tests;
