//! A term's decisions about firings: which instants are due and which start, wait or are
//! missed (the missed and overlap policies side by side), operators' requests, replacements,
//! and how each firing's end is recorded.

use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::backoff::Backoff;
use leader_core::{CancellationToken, Leadership};

use crate::control::{Control, Request};
use crate::job::{CronEvent, CronJob};
use crate::policy::{Missed, Overlap};
use crate::schedule::Schedule;
use crate::state::{CronState, Ended, Outcome, Retry, Started};

/// The longest back-off before a failed firing runs again, unless the first is longer
/// (Kubernetes Jobs' six minutes).
const MOST_BACKOFF: Duration = Duration::from_secs(6 * 60);

/// How many of an expression's instants are found between two yields when a long backlog is
/// passed over (about 5 ms).
const BACKLOG_STEP: usize = 10_000;

/// The most scheduled instants looked at in one go (a backlog beyond it is counted as missed).
const MOST_INSTANTS: usize = 100_000;

/// A firing this term started and whose work has not returned.
pub(crate) struct Running {
    pub(crate) scheduled: DateTime<Utc>,
    pub(crate) attempt: u32,
    pub(crate) cancel: CancellationToken,
    /// Cancelled by a later firing ([`Overlap::Replace`]) and recorded as replaced; the later
    /// one starts once this work has returned.
    pub(crate) replaced: bool,
}

/// A firing to start with the next write.
pub(crate) struct Start {
    pub(crate) scheduled: DateTime<Utc>,
    pub(crate) attempt: u32,
    pub(crate) triggered_by: Option<String>,
}

/// How often the schedule loop looks at the operators' requests, which the term's renewals
/// bring into the leadership's extensions.
pub(crate) const CONTROL_POLL: Duration = Duration::from_secs(1);

/// Whether one more firing may start, by the overlap policy, and the starts a replacement
/// superseded to make room (counted as missed), with the latest of them.
pub(crate) enum Room {
    /// It starts now.
    Now {
        superseded: u64,
        latest: Option<DateTime<Utc>>,
    },
    /// It waits.
    Later {
        superseded: u64,
        latest: Option<DateTime<Utc>>,
    },
}

/// What a term's loop keeps between its rounds besides the schedule's state.
#[derive(Default)]
pub(crate) struct Term {
    /// The firings this term started whose work has not returned.
    pub(crate) running: Vec<Running>,
    /// The firings to start with the next write.
    pub(crate) starts: Vec<Start>,
    /// A firing that waits for the work it replaced to return.
    pub(crate) replacing: Option<DateTime<Utc>>,
    pub(crate) waits: Waits,
}

/// What the loop said already, so that each wait and each bad request is said once.
#[derive(Default)]
pub(crate) struct Waits {
    /// The instant whose wait was said last.
    pub(crate) said: Option<DateTime<Utc>>,
    /// The schedule is suspended (as said last).
    pub(crate) suspended: bool,
    /// The requests cannot be read (said once until they can).
    pub(crate) bad_control: bool,
}

impl Waits {
    pub(crate) fn say(&mut self, schedule: &str, instant: DateTime<Utc>, what: &str) {
        if self.said != Some(instant) {
            self.said = Some(instant);
            tracing::info!(schedule, scheduled = %instant, "{what}");
        }
    }
}

impl CronJob {
    /// Settles the instants due by `now`: which to start (into `starts`), which are missed,
    /// which running firings a new one replaces; moves the cursor. Returns whether the state
    /// changed, and whether a due firing waits for a running one to end ([`Overlap::Forbid`],
    /// [`Overlap::Allow`] at its maximum, or [`Overlap::Replace`] until the replaced work has
    /// returned, for which `replacing` keeps the waiting instant on time).
    pub(crate) fn due(
        &self,
        schedule: &Schedule,
        state: &mut CronState,
        now: DateTime<Utc>,
        term: &mut Term,
    ) -> (bool, bool) {
        let inner = &self.inner;
        let on_time_until = term.replacing.take();
        let mut instants = std::collections::VecDeque::new();
        let mut at = state.handled_until();
        let mut beyond = 0_u64;
        // A backlog too long to look at: the oldest count as missed, passed over at once
        // where the schedule can count them, else one by one.
        if let Some((skipped_to, skipped)) = schedule.skip_to_last(at, now, MOST_INSTANTS) {
            at = skipped_to;
            beyond = skipped;
        }
        while let Some(next) = schedule.next_after(at).filter(|n| *n <= now) {
            if instants.len() == MOST_INSTANTS {
                instants.pop_front();
                beyond += 1;
            }
            instants.push_back(next);
            at = next;
        }
        if instants.is_empty() {
            return (false, false);
        }
        let waited = |instant: &DateTime<Utc>| (now - *instant).to_std().unwrap_or_default();
        // A firing that waited for replaced work to return is still on time.
        let late = |instant: &DateTime<Utc>| {
            on_time_until.is_none_or(|until| *instant > until)
                && waited(instant) > inner.misfire_threshold
        };
        let too_late =
            |instant: &DateTime<Utc>| inner.starting_deadline.is_some_and(|d| waited(instant) > d);
        let late_count = instants.iter().filter(|i| late(i)).count();
        let on_time_count = instants.len() - late_count;
        // The late instants to run, by the missed policy: the last `keep_late` of them.
        let keep_late = match inner.missed {
            // The latest unmet firing runs: an on-time one, when there is one, is the latest.
            Missed::Latest if on_time_count > 0 => 0,
            Missed::Latest => late_count.min(1),
            Missed::All { max } => late_count.min(usize::try_from(max).unwrap_or(usize::MAX)),
            Missed::Skip => 0,
        };
        let mut late_rank = 0;
        let mut missed = beyond;
        let mut latest_missed = None;
        let mut recorded = false;
        let mut cursor = state.cursor;
        let mut blocked = false;
        for instant in &instants {
            let wanted = !term.waits.suspended
                && (!late(instant) || {
                    late_rank += 1;
                    late_rank > late_count - keep_late
                });
            if !wanted || too_late(instant) {
                missed += 1;
                latest_missed = Some(*instant);
                cursor = Some(*instant);
                continue;
            }
            match self.room(state, term, *instant) {
                Room::Now { superseded, latest } => {
                    missed += superseded;
                    latest_missed = latest.or(latest_missed);
                    recorded |= inner.overlap == Overlap::Replace;
                }
                // This firing and the later ones wait; the missed policy decides about them
                // then (Kubernetes CronJob's Forbid keeps its unmet times likewise).
                Room::Later { superseded, latest } => {
                    missed += superseded;
                    latest_missed = latest.or(latest_missed);
                    if inner.overlap == Overlap::Replace {
                        recorded = true;
                        term.replacing = Some(*instant);
                    }
                    blocked = true;
                    break;
                }
            }
            term.starts.push(Start {
                scheduled: *instant,
                attempt: 1,
                triggered_by: None,
            });
            cursor = Some(*instant);
        }
        self.missed(state, missed, latest_missed);
        let changed = cursor != state.cursor || missed > 0 || recorded;
        state.cursor = cursor;
        (changed, blocked)
    }

    /// The operators' requests as the term's record holds them (none when they cannot be
    /// read, which is said once).
    pub(crate) fn control(&self, leadership: &Leadership, waits: &mut Waits) -> Control {
        let inner = &self.inner;
        let Some(value) = leadership.extensions().remove(&inner.control_key) else {
            return Control::default();
        };
        match Control::from_json(&value) {
            Ok(control) => {
                waits.bad_control = false;
                control
            }
            Err(err) => {
                if !waits.bad_control {
                    waits.bad_control = true;
                    tracing::warn!(schedule = %inner.name, key = %inner.control_key, error = %err, "the operators' requests cannot be read; ignored until they can");
                }
                Control::default()
            }
        }
    }

    /// A firing asked for now and not started yet: starts it with the next write (which records
    /// the request as handled) when the overlap policy lets it, else leaves it for later.
    /// Returns whether the state changed.
    pub(crate) fn triggered(
        &self,
        state: &mut CronState,
        request: Request,
        term: &mut Term,
    ) -> bool {
        let inner = &self.inner;
        match self.room(state, term, request.at) {
            Room::Now { superseded, latest } => self.missed(state, superseded, latest),
            Room::Later { superseded, latest } => {
                self.missed(state, superseded, latest);
                return inner.overlap == Overlap::Replace;
            }
        }
        tracing::info!(schedule = %inner.name, by = %request.by, at = %request.at, "a firing asked for now starts");
        state.last_trigger = Some(request.at);
        term.starts.push(Start {
            scheduled: request.at,
            attempt: 1,
            triggered_by: Some(request.by),
        });
        true
    }

    /// Makes room for one more firing (`instant`) by the overlap policy: now, or later (said
    /// once): when a running firing ended, or when the work it replaced has returned, since two
    /// never run at once under [`Overlap::Replace`]. Says how many starts not begun yet a
    /// replacement superseded (counted as missed), and the latest of them.
    fn room(&self, state: &mut CronState, term: &mut Term, instant: DateTime<Utc>) -> Room {
        let inner = &self.inner;
        let busy = term.running.len() + term.starts.len();
        let free = Room::Now {
            superseded: 0,
            latest: None,
        };
        match inner.overlap {
            _ if busy == 0 => free,
            Overlap::Allow if busy < inner.max_running => free,
            Overlap::Allow | Overlap::Forbid => {
                term.waits
                    .say(&inner.name, instant, "waits for the previous firing to end");
                Room::Later {
                    superseded: 0,
                    latest: None,
                }
            }
            Overlap::Replace => {
                let (superseded, latest) = self.replace(state, term);
                if term.running.is_empty() {
                    Room::Now { superseded, latest }
                } else {
                    term.waits.say(
                        &inner.name,
                        instant,
                        "waits for the replaced firing to stop",
                    );
                    Room::Later { superseded, latest }
                }
            }
        }
    }

    /// A long backlog of an expression's instants (a cursor a year old on `* * * * * *`: 31.5
    /// million, about 15 s of finding them): the late instants the missed policy cannot run
    /// (all but the latest, or the latest `max` of [`Missed::All`]) are counted and passed over
    /// in steps, yielding between them so that the term's renewals go on (the command runs on
    /// one thread); [`due`](Self::due) then settles the few left. A fixed period's backlog is
    /// passed over by arithmetic in `due`. Returns whether the state changed.
    pub(crate) async fn pass_over_backlog(
        &self,
        schedule: &Schedule,
        state: &mut CronState,
        now: DateTime<Utc>,
    ) -> bool {
        if schedule.is_fixed_period() {
            return false;
        }
        let inner = &self.inner;
        let keep = match inner.missed {
            Missed::All { max } => usize::try_from(max).unwrap_or(MOST_INSTANTS),
            Missed::Latest | Missed::Skip => 1,
        }
        .clamp(1, MOST_INSTANTS);
        // Instants later than this are on time: `due` decides about them.
        let late_until =
            now - chrono::Duration::from_std(inner.misfire_threshold).unwrap_or_default();
        let mut kept = std::collections::VecDeque::new();
        let (mut at, mut passed, mut last_passed) = (state.handled_until(), 0_u64, None);
        let mut walked = 0_usize;
        while let Some(next) = schedule.next_after(at).filter(|n| *n <= late_until) {
            if kept.len() == keep {
                last_passed = kept.pop_front();
                passed += 1;
            }
            kept.push_back(next);
            at = next;
            walked += 1;
            if walked.is_multiple_of(BACKLOG_STEP) {
                tokio::task::yield_now().await;
            }
        }
        if passed == 0 {
            return false;
        }
        tracing::info!(schedule = %self.inner.name, passed, "a long backlog passed over");
        state.cursor = last_passed;
        self.missed(state, passed, last_passed);
        true
    }

    /// Failed firings whose retry is due by `now`: started with the next write when the
    /// overlap policy makes room, oldest first; the rest wait. Returns whether the state
    /// changed.
    pub(crate) fn retries_due(
        &self,
        state: &mut CronState,
        now: DateTime<Utc>,
        term: &mut Term,
    ) -> bool {
        let mut changed = false;
        while let Some(index) = state.retrying.iter().position(|r| r.at <= now) {
            let retry = state.retrying.remove(index);
            match self.room(state, term, retry.scheduled) {
                Room::Now { superseded, latest } => {
                    self.missed(state, superseded, latest);
                    term.starts.push(Start {
                        scheduled: retry.scheduled,
                        attempt: retry.attempt,
                        triggered_by: retry.triggered_by,
                    });
                    changed = true;
                }
                Room::Later { superseded, latest } => {
                    self.missed(state, superseded, latest);
                    state.retrying.insert(0, retry);
                    return changed || self.inner.overlap == Overlap::Replace;
                }
            }
        }
        changed
    }

    /// A firing that failed with attempts left ([`retries`](crate::CronJobBuilder::retries)):
    /// its next attempt waits in the state for its back-off.
    pub(crate) fn retry_if_failed(
        &self,
        state: &mut CronState,
        started: &Started,
        outcome: &Outcome,
    ) {
        let inner = &self.inner;
        let failed = matches!(outcome, Outcome::Failed { .. } | Outcome::TimedOut);
        if !failed || started.attempt > inner.retries {
            return;
        }
        let backoff = Backoff::new(inner.retry_backoff, MOST_BACKOFF).wait_after(started.attempt);
        let at = inner.clock.now() + chrono::Duration::from_std(backoff).unwrap_or_default();
        tracing::warn!(schedule = %inner.name, scheduled = %started.scheduled, attempt = started.attempt, outcome = outcome.name(), ?backoff, "firing failed: it runs again after a back-off");
        state.retrying.push(Retry {
            scheduled: started.scheduled,
            attempt: started.attempt + 1,
            at,
            triggered_by: started.triggered_by.clone(),
            unknown_fields: Default::default(),
        });
    }

    /// [`Overlap::Replace`]: cancels the running firings, recorded as replaced at once (their
    /// work is waited for before anything starts), and drops the starts not begun yet, which a
    /// later firing supersedes: a first attempt counts as missed, a retry ends as replaced;
    /// none goes untold. Returns how many were missed, and the latest of them.
    fn replace(&self, state: &mut CronState, term: &mut Term) -> (u64, Option<DateTime<Utc>>) {
        let (mut missed, mut latest) = (0, None);
        for retry in std::mem::take(&mut state.retrying) {
            self.ended(
                state,
                retry.scheduled,
                retry.attempt,
                None,
                Outcome::Replaced,
            );
        }
        for start in term.starts.drain(..) {
            if start.attempt == 1 {
                missed += 1;
                latest = Some(start.scheduled);
            } else {
                self.ended(
                    state,
                    start.scheduled,
                    start.attempt,
                    None,
                    Outcome::Replaced,
                );
            }
        }
        for replaced in term.running.iter_mut().filter(|r| !r.replaced) {
            replaced.cancel.cancel();
            replaced.replaced = true;
            let (scheduled, attempt) = (replaced.scheduled, replaced.attempt);
            let started = take_running(state, scheduled, attempt);
            self.ended(
                state,
                scheduled,
                attempt,
                started.as_ref(),
                Outcome::Replaced,
            );
        }
        (missed, latest)
    }

    /// Counts `count` firings as missed, the latest of them `latest`: in the state, the
    /// metrics, the log and the events.
    fn missed(&self, state: &mut CronState, count: u64, latest: Option<DateTime<Utc>>) {
        if count == 0 {
            return;
        }
        let inner = &self.inner;
        tracing::info!(schedule = %inner.name, missed = count, "firings missed");
        metrics::counter!("leader_cron_firings_missed_total", "name" => inner.name.clone())
            .increment(count);
        let _ = inner.events.send(CronEvent::Missed { count, latest });
        state.missed += count;
    }

    /// Records the end of a firing in `state` (written with the next write): the last
    /// outcome, and the history, which keeps the job's number of the latest.
    pub(crate) fn ended(
        &self,
        state: &mut CronState,
        scheduled: DateTime<Utc>,
        attempt: u32,
        started: Option<&Started>,
        outcome: Outcome,
    ) {
        let inner = &self.inner;
        tracing::info!(schedule = %inner.name, %scheduled, attempt, outcome = outcome.name(), "firing ended");
        metrics::counter!(
            "leader_cron_firings_completed_total",
            "name" => inner.name.clone(),
            "outcome" => outcome.name()
        )
        .increment(1);
        let _ = inner.events.send(CronEvent::Ended {
            scheduled,
            attempt,
            outcome: outcome.clone(),
        });
        let ended = Ended {
            scheduled,
            attempt,
            outcome,
            ended_at: inner.clock.now(),
            started_at: started.map(|s| s.started_at),
            fencing_token: started.map(|s| s.fencing_token),
            identity: started.and_then(|s| s.identity.clone()),
            triggered_by: started.and_then(|s| s.triggered_by.clone()),
            unknown_fields: Default::default(),
        };
        state.last = Some(ended.clone());
        state.history.push(ended);
        let beyond = state.history.len().saturating_sub(inner.history);
        state.history.drain(..beyond);
    }
}

/// Takes firing (`scheduled`, `attempt`) out of the state's running firings, if it is there.
pub(crate) fn take_running(
    state: &mut CronState,
    scheduled: DateTime<Utc>,
    attempt: u32,
) -> Option<Started> {
    let index = state
        .running
        .iter()
        .position(|s| (s.scheduled, s.attempt) == (scheduled, attempt))?;
    Some(state.running.remove(index))
}
