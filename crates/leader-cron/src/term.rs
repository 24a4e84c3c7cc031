//! A term's decisions about firings: which instants are due and which start, wait or are
//! missed (the missed and overlap policies side by side), operators' requests, replacements,
//! and how each firing's end is recorded.

use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::backend::Backoff;
use leader_core::{CancellationToken, Leadership};

use crate::control::{Control, Request};
use crate::job::{CronEvent, CronJob};
use crate::policy::{Missed, Overlap};
use crate::schedule::Schedule;
use crate::state::{CronState, Ended, MAX_RETRYING, Outcome, Retry, Started, bounded};

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
    /// Asks the work to stop as a timeout stops it: its cancellation, then dropped after the
    /// grace ([`cancel`](crate::cancel)).
    pub(crate) stop: CancellationToken,
    /// Its end is recorded already: cancelled by a later firing ([`Overlap::Replace`]) and
    /// recorded as replaced, or by an operator; a later firing takes its slot once this work
    /// has returned.
    pub(crate) ended: bool,
}

/// A firing to start with the next write.
pub(crate) struct Start {
    pub(crate) scheduled: DateTime<Utc>,
    pub(crate) attempt: u32,
    pub(crate) triggered_by: Option<String>,
    /// For the retry of a failed firing, when it was due: a replacement that supersedes it
    /// before it started puts it back to wait ([`Overlap::Replace`]).
    pub(crate) retry_at: Option<DateTime<Utc>>,
}

/// How far ahead of a leader's clock the instants of a schedule's state may lie before they
/// are read as written by a clock that ran ahead, and the schedule goes on from the leader's
/// clock: one day. A clock stepped back by less waits until it reads past the cursor again (no
/// firing repeated); a clock further behind than this would run again the instants of that
/// span.
pub const CLOCK_HORIZON: Duration = Duration::from_secs(24 * 60 * 60);

/// How often the schedule loop looks at the operators' requests, which the term's renewals
/// bring into the leadership's extensions, and at the wall clock, which may have stepped
/// forward past the next instant.
pub(crate) const CONTROL_POLL: Duration = Duration::from_secs(1);

/// Whether one more firing may start, by the overlap policy, and what a replacement did to
/// make room.
pub(crate) enum Room {
    /// It starts now.
    Now(Made),
    /// It waits.
    Later(Made),
}

/// What a replacement did to make room ([`Overlap::Replace`]).
#[derive(Default)]
pub(crate) struct Made {
    /// Starts not begun yet that it superseded (counted as missed).
    superseded: u64,
    /// The latest of them.
    latest: Option<DateTime<Utc>>,
    /// Whether it changed the state (a firing recorded as replaced, a retry put back).
    changed: bool,
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
    /// The trigger waiting to start (its request's instant) and when this leader first saw it,
    /// by its own clock.
    pub(crate) trigger_seen: Option<(DateTime<Utc>, DateTime<Utc>)>,
    pub(crate) waits: Waits,
}

/// What may take a free slot: the retries due, the scheduled instants due, a trigger.
#[derive(Clone, Copy)]
enum Turn {
    Retries,
    Scheduled,
    Trigger,
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
    /// The schedule has no instant left (said once).
    pub(crate) ran_out: bool,
    /// This leader's clock reads far past what the record holds (said once).
    pub(crate) far_ahead: bool,
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
    /// Settles what is due by `now`, each in its turn: the retries due, the schedule's
    /// instants due and a trigger not started yet take the slots the overlap policy gives in
    /// the order they were due (a retry first among equals, then a scheduled instant), so that
    /// none waits for ever behind the others under [`Overlap::Forbid`]. A trigger is due when
    /// it was asked: the request's instant, or when this leader first saw it if that is
    /// earlier by its clock (an asker's clock ahead of the leader's would otherwise put it
    /// behind every scheduled firing). Returns whether the state changed, and whether a due
    /// scheduled firing waits for a slot (see [`due`](Self::due)).
    pub(crate) fn take_turns(
        &self,
        schedule: &Schedule,
        state: &mut CronState,
        now: DateTime<Utc>,
        trigger: Option<Request>,
        term: &mut Term,
    ) -> (bool, bool) {
        let first_instant = schedule
            .next_after(state.handled_until())
            .filter(|i| *i <= now);
        let first_retry = state
            .retrying
            .iter()
            .map(|r| r.at)
            .filter(|at| *at <= now)
            .min();
        term.trigger_seen = trigger.as_ref().map(|request| match term.trigger_seen {
            Some((at, seen)) if at == request.at => (at, seen),
            _ => (request.at, now),
        });
        let trigger_due = term.trigger_seen.map(|(at, seen)| at.min(seen));
        // Nothing due sorts last; among equals, the order of this list.
        let mut turns = [
            (first_retry, Turn::Retries),
            (first_instant, Turn::Scheduled),
            (trigger_due, Turn::Trigger),
        ];
        turns.sort_by_key(|(due, _)| (due.is_none(), *due));
        let (mut changed, mut blocked) = (false, false);
        let mut trigger = trigger;
        for (_, turn) in turns {
            match turn {
                Turn::Retries => changed |= self.retries_due(state, now, term),
                Turn::Scheduled => {
                    let (moved, waits) = self.due(schedule, state, now, term);
                    changed |= moved;
                    blocked = waits;
                }
                Turn::Trigger => {
                    if let Some(request) = trigger.take() {
                        changed |= self.triggered(state, request, term);
                    }
                }
            }
        }
        (changed, blocked)
    }

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
        let mut late_rank = 0_usize;
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
                Room::Now(made) => {
                    missed += made.superseded;
                    latest_missed = made.latest.or(latest_missed);
                    recorded |= made.changed;
                }
                // This firing and the later ones wait; the missed policy decides about them
                // then (Kubernetes CronJob's Forbid keeps its unmet times likewise).
                Room::Later(made) => {
                    missed += made.superseded;
                    latest_missed = made.latest.or(latest_missed);
                    recorded |= made.changed;
                    if inner.overlap == Overlap::Replace {
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
                retry_at: None,
            });
            cursor = Some(*instant);
        }
        self.missed(state, missed, latest_missed);
        let changed = cursor != state.cursor || missed > 0 || recorded;
        state.cursor = cursor;
        (changed, blocked)
    }

    /// A state whose instants lie more than [`CLOCK_HORIZON`] ahead of this leader's clock was
    /// written by a leader whose clock ran ahead (a clock reading year 9999 would otherwise
    /// hold the schedule until then): said in one line, and the schedule goes on from this
    /// clock (the cursor and the retries waiting are brought back to now). A clock reading far
    /// past what the record holds is said once (no leader for that long, or this clock runs
    /// ahead): its firings run, and a later leader with a right clock goes on from its own.
    /// Returns whether the state changed.
    pub(crate) fn clock_far_behind(
        &self,
        state: &mut CronState,
        now: DateTime<Utc>,
        waits: &mut Waits,
    ) -> bool {
        let inner = &self.inner;
        let horizon = chrono::Duration::from_std(CLOCK_HORIZON).unwrap_or_default();
        let mut changed = false;
        let handled = state.handled_until();
        if handled > now + horizon {
            tracing::warn!(schedule = %inner.name, cursor = %handled, clock = %now, "the record's cursor is more than a day ahead of this leader's clock: a leader's clock ran ahead; the schedule goes on from this clock");
            state.since = state.since.min(now);
            state.cursor = Some(now);
            changed = true;
        }
        for retry in state.retrying.iter_mut().filter(|r| r.at > now + horizon) {
            retry.at = now;
            changed = true;
        }
        if !waits.far_ahead && now > state.latest_recorded() + horizon {
            waits.far_ahead = true;
            tracing::warn!(schedule = %inner.name, clock = %now, recorded = %state.latest_recorded(), "this leader's clock reads more than a day past the latest instant the record holds: no leader for that long, or this clock runs ahead");
        }
        changed
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
            Room::Now(made) => self.missed(state, made.superseded, made.latest),
            Room::Later(made) => {
                self.missed(state, made.superseded, made.latest);
                return made.changed;
            }
        }
        tracing::info!(schedule = %inner.name, by = %request.by, at = %request.at, "a firing asked for now starts");
        state.last_trigger = Some(request.at);
        term.starts.push(Start {
            scheduled: request.at,
            attempt: 1,
            triggered_by: Some(request.by),
            retry_at: None,
        });
        true
    }

    /// An operator's request to cancel firings ([`cancel`](crate::cancel)), not handled yet:
    /// the firings it names that this term runs are stopped as a timeout stops them (their slot
    /// is freed once their work has returned), those about to start and those waiting for a
    /// retry are dropped; each is recorded as cancelled at once, in the same write as the
    /// request handled, so that no leader retries it. A firing it names that ended already is
    /// left as it ended. Returns whether the state changed (always: the request is handled).
    pub(crate) fn cancelled(
        &self,
        state: &mut CronState,
        request: Request,
        term: &mut Term,
    ) -> bool {
        let inner = &self.inner;
        let named = |scheduled: &DateTime<Utc>| request.firings.contains(scheduled);
        let outcome = || Outcome::Cancelled {
            by: request.by.clone(),
        };
        let mut count = 0_usize;
        for running in term
            .running
            .iter_mut()
            .filter(|r| !r.ended && named(&r.scheduled))
        {
            running.stop.cancel();
            running.ended = true;
            let (scheduled, attempt) = (running.scheduled, running.attempt);
            let started = take_running(state, scheduled, attempt);
            self.ended(state, scheduled, attempt, started.as_ref(), outcome());
            count += 1;
        }
        // The named firings not begun: starts of this round, and retries waiting their turn.
        let not_begun: Vec<(DateTime<Utc>, u32)> = term
            .starts
            .extract_if(.., |start| named(&start.scheduled))
            .map(|start| (start.scheduled, start.attempt))
            .chain(
                state
                    .retrying
                    .extract_if(.., |retry| named(&retry.scheduled))
                    .map(|retry| (retry.scheduled, retry.attempt)),
            )
            .collect();
        for (scheduled, attempt) in not_begun {
            self.ended(state, scheduled, attempt, None, outcome());
            count += 1;
        }
        tracing::info!(schedule = %inner.name, by = %request.by, at = %request.at, asked = request.firings.len(), cancelled = count, "a request to cancel firings is handled");
        state.last_cancel = Some(request.at);
        true
    }

    /// Makes room for one more firing (`instant`) by the overlap policy: now, or later (said
    /// once): when a running firing ended, or when the work it replaced has returned, since two
    /// never run at once under [`Overlap::Replace`]. Says how many starts not begun yet a
    /// replacement superseded (counted as missed), and the latest of them.
    fn room(&self, state: &mut CronState, term: &mut Term, instant: DateTime<Utc>) -> Room {
        let inner = &self.inner;
        let busy = term.running.len() + term.starts.len();
        match inner.overlap {
            _ if busy == 0 => Room::Now(Made::default()),
            Overlap::Allow if busy < inner.max_running => Room::Now(Made::default()),
            Overlap::Allow | Overlap::Forbid => {
                term.waits
                    .say(&inner.name, instant, "waits for the previous firing to end");
                Room::Later(Made::default())
            }
            Overlap::Replace => {
                let made = self.replace(state, term);
                if term.running.is_empty() {
                    Room::Now(made)
                } else {
                    term.waits.say(
                        &inner.name,
                        instant,
                        "waits for the replaced firing to stop",
                    );
                    Room::Later(made)
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
    /// overlap policy makes room, the earliest due first; the rest wait, in the state, for a
    /// running firing to end (they are not waited for by time: [`next_retry`](Self::next_retry)).
    /// None starts while the schedule is suspended, and a retry replaces nothing: under
    /// [`Overlap::Replace`] it waits for the slot to be free. Returns whether the state changed.
    pub(crate) fn retries_due(
        &self,
        state: &mut CronState,
        now: DateTime<Utc>,
        term: &mut Term,
    ) -> bool {
        if term.waits.suspended {
            return false;
        }
        let mut changed = false;
        while let Some(index) = earliest_due(&state.retrying, now) {
            let scheduled = state.retrying[index].scheduled;
            // A retry replaces nothing: under Replace it waits for the slot to be free.
            let busy = !term.running.is_empty() || !term.starts.is_empty();
            if self.inner.overlap == Overlap::Replace && busy {
                term.waits.say(
                    &self.inner.name,
                    scheduled,
                    "a retry waits for the running firing to end",
                );
                return changed;
            }
            match self.room(state, term, scheduled) {
                Room::Now(made) => {
                    self.missed(state, made.superseded, made.latest);
                    let retry = state.retrying.remove(index);
                    term.starts.push(Start {
                        scheduled: retry.scheduled,
                        attempt: retry.attempt,
                        triggered_by: retry.triggered_by,
                        retry_at: Some(retry.at),
                    });
                    changed = true;
                }
                Room::Later(made) => {
                    self.missed(state, made.superseded, made.latest);
                    return changed || made.changed;
                }
            }
        }
        changed
    }

    /// When the next retry not due yet by `now` is due: a retry already due waits for a
    /// running firing to end (or for the schedule to resume), which wakes the loop, not a timer.
    pub(crate) fn next_retry(state: &CronState, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        state
            .retrying
            .iter()
            .map(|r| r.at)
            .filter(|at| *at > now)
            .min()
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
        self.wait_to_retry(
            state,
            Retry {
                scheduled: started.scheduled,
                attempt: started.attempt + 1,
                at,
                triggered_by: started.triggered_by.clone(),
                unknown_fields: Default::default(),
            },
        );
    }

    /// A firing an earlier leader started and never ended (its leader died or lost its
    /// lease), to run again as attempt `firing.attempt + 1`: it takes its turn by the overlap
    /// policy as any firing does, the interrupted ones in the order of their instants. It
    /// starts now when there is room; under [`Overlap::Forbid`] (or [`Overlap::Allow`] at
    /// its maximum) it waits among the retries, due at its instant, so that it runs before
    /// anything due later; under [`Overlap::Replace`] the latest interrupted firing replaces
    /// the earlier ones, which end as replaced. An earlier leader under another policy (a
    /// configuration changed, a rollout under way) may have left several running at once.
    pub(crate) fn resume_interrupted(
        &self,
        state: &mut CronState,
        firing: &Started,
        term: &mut Term,
    ) {
        match self.room(state, term, firing.scheduled) {
            Room::Now(made) => {
                self.missed(state, made.superseded, made.latest);
                term.starts.push(Start {
                    scheduled: firing.scheduled,
                    attempt: firing.attempt + 1,
                    triggered_by: firing.triggered_by.clone(),
                    retry_at: None,
                });
            }
            Room::Later(made) => {
                self.missed(state, made.superseded, made.latest);
                self.wait_to_retry(
                    state,
                    Retry {
                        scheduled: firing.scheduled,
                        attempt: firing.attempt + 1,
                        at: firing.scheduled,
                        triggered_by: firing.triggered_by.clone(),
                        unknown_fields: Default::default(),
                    },
                );
            }
        }
    }

    /// Puts `retry` among the firings that wait for a retry, keeping the record bounded:
    /// beyond [`MAX_RETRYING`] waiting, the oldest is given up.
    fn wait_to_retry(&self, state: &mut CronState, retry: Retry) {
        let inner = &self.inner;
        while state.retrying.len() >= MAX_RETRYING {
            let Some(index) =
                (0..state.retrying.len()).min_by_key(|&i| state.retrying[i].scheduled)
            else {
                break;
            };
            let oldest = state.retrying.remove(index);
            let reason = format!(
                "more than {MAX_RETRYING} failed firings waited for a retry: the oldest is given up"
            );
            tracing::warn!(schedule = %inner.name, scheduled = %oldest.scheduled, attempt = oldest.attempt, %reason, "a retry is given up");
            metrics::counter!("leader_cron_firings_given_up_total", "name" => inner.name.clone())
                .increment(1);
            self.ended(
                state,
                oldest.scheduled,
                oldest.attempt,
                None,
                Outcome::GaveUp { reason },
            );
        }
        state.retrying.push(retry);
    }

    /// [`Overlap::Replace`]: cancels the running firings, recorded as replaced at once (their
    /// work is waited for before anything starts), and drops the starts not begun yet, which a
    /// later firing supersedes: a first attempt counts as missed, the retry of a failed firing
    /// goes back to wait for its turn, the retry of an interrupted one ends as replaced; none
    /// goes untold. Retries waiting in the state are left to wait.
    fn replace(&self, state: &mut CronState, term: &mut Term) -> Made {
        let mut made = Made::default();
        for start in std::mem::take(&mut term.starts) {
            made.changed = true;
            if let Some(at) = start.retry_at {
                state.retrying.push(Retry {
                    scheduled: start.scheduled,
                    attempt: start.attempt,
                    at,
                    triggered_by: start.triggered_by,
                    unknown_fields: Default::default(),
                });
            } else if start.attempt == 1 {
                made.superseded += 1;
                made.latest = Some(start.scheduled);
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
        for replaced in term.running.iter_mut().filter(|r| !r.ended) {
            made.changed = true;
            replaced.cancel.cancel();
            replaced.ended = true;
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
        made
    }

    /// Counts `count` firings as missed, the latest of them `latest`: in the state, the
    /// metrics, the log and the events.
    pub(crate) fn missed(&self, state: &mut CronState, count: u64, latest: Option<DateTime<Utc>>) {
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
        let outcome = match outcome {
            Outcome::Failed { message } => Outcome::Failed {
                message: bounded(message),
            },
            Outcome::GaveUp { reason } => Outcome::GaveUp {
                reason: bounded(reason),
            },
            outcome => outcome,
        };
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

/// The retry due by `now` that was due first (the earlier scheduled instant first among equals).
fn earliest_due(retrying: &[Retry], now: DateTime<Utc>) -> Option<usize> {
    (0..retrying.len())
        .filter(|&i| retrying[i].at <= now)
        .min_by_key(|&i| (retrying[i].at, retrying[i].scheduled))
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
