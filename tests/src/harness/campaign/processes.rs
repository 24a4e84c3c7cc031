//! The replicas' processes as the harness sees them: their state in `/proc`, the COMMANDs'
//! log, their process groups, and stopping them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::Command;
use tokio::time::sleep;

use super::{HarnessError, Settings};
use crate::harness::checker::Marks;
use crate::harness::servers::{PrivateServer, ServerError};
use crate::{TermEvent as Event, now_ns};

/// The state letter of `/proc/PID/stat` (R, S, T, Z, ...); `None` once the process is gone.
pub(super) fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Gone, or a zombie nobody reaped yet: it runs no more code either way.
pub fn process_gone(pid: i32) -> bool {
    matches!(process_state(pid), None | Some('Z' | 'X'))
}

pub(crate) fn process_stopped(pid: i32) -> bool {
    process_state(pid) == Some('T')
}

/// Resumes (SIGCONT) every process of COMMAND's frozen `group` but the group's leader, its
/// supervisor: a thaw that lets the job run before anything of its replica can stop it (the
/// supervisor kills a group past its term's deadline), so that the job's writes with its
/// stale token reach the fence. [`resume_supervisor`] follows.
pub(crate) fn resume_command_first(group: Pid) {
    for pid in members_of(&[group]) {
        if pid != group.as_raw() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
        }
    }
}

/// The processes whose process group is one of `groups` (`/proc/PID/stat`, field 5).
pub fn members_of(groups: &[Pid]) -> BTreeSet<i32> {
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

/// Resumes the supervisor of COMMAND's `group`, after [`resume_command_first`].
pub(crate) fn resume_supervisor(group: Pid) {
    let _ = kill(group, Signal::SIGCONT);
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
pub(super) fn between(earlier: i128, later: i128) -> Duration {
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

/// A private server crashed and started again.
pub(crate) struct Restarted {
    /// When it answered again (`CLOCK_MONOTONIC` ns).
    pub(crate) back: i128,
    /// How long its clients had no server: from the crash to its answering again (the time
    /// down and the server's own start).
    pub(crate) away: Duration,
}

/// Crashes the private server, waits `down`, starts it again and waits until it answers.
pub(crate) async fn crash_and_restart(
    server: &mut Option<PrivateServer>,
    down: Duration,
) -> Result<Restarted, HarnessError> {
    let mut taken = server.take();
    let (taken, restarted) = tokio::task::spawn_blocking(move || {
        let crashed = now_ns();
        if let Some(server) = taken.as_mut() {
            server.kill();
            std::thread::sleep(down);
            server.restart()?;
        }
        let back = now_ns();
        let away = between(crashed, back);
        Ok::<_, ServerError>((taken, Restarted { back, away }))
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
pub(super) async fn stop_inside_a_write(pid: Pid) -> Result<(), HarnessError> {
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
pub(super) fn is_peer(identity: &str) -> bool {
    identity.starts_with('k')
}

/// The `leader` options of the timings in `settings`: lease duration, renew deadline and retry
/// period, in milliseconds.
pub(crate) fn timing_args(settings: &Settings) -> [String; 6] {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    [
        "--lease-duration".into(),
        ms(settings.lease),
        "--renew-deadline".into(),
        ms(settings.renew),
        "--retry-period".into(),
        ms(settings.retry),
    ]
}

/// A replica's log filter: `FAULT_LOG`, or `default`.
pub(crate) fn replica_log_filter(default: &str) -> String {
    std::env::var("FAULT_LOG").unwrap_or_else(|_| default.into())
}

/// Puts `replica` in `slot`: in place of the one there (an earlier incarnation), or after the
/// last one started.
pub(crate) fn place<T>(replicas: &mut Vec<T>, slot: usize, replica: T) {
    if slot < replicas.len() {
        replicas[slot] = replica;
    } else {
        replicas.push(replica);
    }
}
