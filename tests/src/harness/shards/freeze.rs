//! A replica frozen with its COMMANDs: which processes were stopped, which terms that marks as
//! frozen, and how a write resumed after the freeze is judged.

use std::collections::BTreeSet;
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::TermEvent;
use crate::harness::campaign::{command_groups, members_of, poll, process_gone, process_stopped};
use crate::harness::checker::{self, Marks};

/// One freeze of a replica: the processes of its COMMANDs it stopped, when they were all
/// stopped, and when they were resumed.
#[derive(Clone, Debug)]
pub(super) struct Freeze {
    pub(super) pids: BTreeSet<i32>,
    pub(super) stopped: i128,
    pub(super) thawed: i128,
}

/// How long after a thaw a start line can still be the one a frozen COMMAND had yet to write:
/// `leader`'s watchdog kills such a COMMAND as soon as both run again, its term long past its
/// deadline. Far too short for its process id to be another's by then (they wrap around after
/// tens of thousands of processes).
pub(super) const LATE_START: i128 = 1_000_000_000;

/// Stops replica `leader` and every process of its COMMANDs, and says which groups and
/// processes: its children by process as well as by group (a child caught between its fork
/// and its own `setpgid` has no group of its own yet, and a signal to that group would stop
/// nothing: its COMMAND would then start and run through the freeze), over again until no
/// process is new, then waits until each shows stopped.
pub(super) async fn freeze(leader: Pid) -> (Vec<Pid>, BTreeSet<i32>) {
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
pub(super) fn mark_frozen_by_pid(
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
        // This run's own stop: the first after its start (a term may run its COMMAND twice,
        // one run after the other, when its set is resized).
        let stopped = stops
            .iter()
            .filter(|(identity, token, at)| {
                *identity == event.identity && *token == event.token && *at >= event.at
            })
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
pub(super) fn judge_write(
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
pub(super) enum Judged {
    Fine,
    Refused,
    Resumed,
    /// Accepted, though a term with this higher token had started.
    Stale(u64),
}
