//! A term of a job: its loop, from reading the schedule's state to the term's end, and how each
//! firing's start and outcome are written and its work run.

use chrono::{DateTime, Utc};
use leader_core::{CancellationToken, ExtensionError, Leadership};
use tokio::sync::mpsc;

use crate::job::{CronError, CronEvent, CronJob, Firing};
use crate::policy::Interrupted;
use crate::schedule::Schedule;
use crate::state::{CronState, FORMAT, Outcome, Revision, ScheduleChange, Started};
use crate::term::{CONTROL_POLL, Running, Start, Term, take_running};

/// The term is over (or was given up): stop.
struct Stop;

/// The most instants of an old schedule counted as missed when it is changed.
const MOST_COUNTED: usize = 100_000;

/// What a replica does with a stored schedule other than its own.
enum Decision {
    /// Its configuration is newer: it changes the stored schedule to its own.
    Change,
    /// The stored schedule's is newer (why): it runs the stored schedule.
    Follow(&'static str),
    /// Neither is newer, and it does not adopt: it is refused.
    Refuse,
}

impl CronJob {
    /// Runs the schedule for the term `leadership`: returns `Ok` when the term ends, and an
    /// error (ending the term's work, and so the term) when the store holds another schedule
    /// under this name or a state it cannot read.
    ///
    /// At the start of the term it reads the schedule's state from the record, settles the
    /// firings an earlier leader started and did not finish ([`Interrupted`]), and the
    /// firings nobody started in time ([`Missed`](crate::Missed)); then it sleeps until the next firing, records
    /// it as started (a compare-and-swap write of the record, fenced by the term) and only then
    /// starts the work, and records its outcome when it ends (a second write). A write that does
    /// not succeed starts nothing: when its outcome is unknown the leader steps down, and the
    /// next leader finds the firing started or not in the store.
    ///
    /// # Errors
    /// [`CronError::ScheduleMismatch`], [`CronError::BadState`].
    pub async fn run(&self, leadership: Leadership) -> Result<(), CronError> {
        let inner = &self.inner;
        let (mut state, schedule, write) = self.load(&leadership)?;
        let token = leadership.fencing_token();
        let (done, mut finished) = mpsc::unbounded_channel();
        let mut term = Term::default();
        // Firings started by earlier terms and never ended: their leader died or lost its
        // lease. Retried or given up, never silently either.
        let mut interrupted = std::mem::take(&mut state.running);
        interrupted.sort_by_key(|firing| firing.scheduled);
        let mut dirty = write || !interrupted.is_empty();
        for firing in interrupted {
            match inner.interrupted {
                Interrupted::Retry { max_attempts } if firing.attempt < max_attempts => {
                    tracing::warn!(
                        schedule = %inner.name,
                        scheduled = %firing.scheduled,
                        attempt = firing.attempt + 1,
                        "a firing whose leader died before it ended runs again"
                    );
                    self.resume_interrupted(&mut state, &firing, &mut term);
                }
                policy => {
                    let reason = match policy {
                        Interrupted::GiveUp => "its leader died before it ended".to_owned(),
                        _ => format!(
                            "its leader died before it ended, {} attempts in all",
                            firing.attempt
                        ),
                    };
                    tracing::warn!(schedule = %inner.name, scheduled = %firing.scheduled, %reason, "a firing is given up");
                    metrics::counter!("leader_cron_firings_given_up_total", "name" => inner.name.clone())
                        .increment(1);
                    self.ended(
                        &mut state,
                        firing.scheduled,
                        firing.attempt,
                        Some(&firing),
                        Outcome::GaveUp { reason },
                    );
                }
            }
        }
        loop {
            let mut now = inner.clock.now();
            let control = self.control(&leadership, &mut term.waits);
            let suspended = control.suspended.is_some();
            if suspended != term.waits.suspended {
                term.waits.suspended = suspended;
                match &control.suspended {
                    Some(by) => {
                        tracing::info!(schedule = %inner.name, by = %by.by, "suspended: firings due are not started")
                    }
                    None => tracing::info!(schedule = %inner.name, "resumed"),
                }
            }
            dirty |= self.clock_far_behind(&mut state, now, &mut term.waits);
            if let Some(request) = control
                .cancel
                .clone()
                .filter(|c| state.last_cancel.is_none_or(|last| c.at > last))
            {
                dirty |= self.cancelled(&mut state, request, &mut term);
            }
            if self.pass_over_backlog(&schedule, &mut state, now).await {
                dirty = true;
                // Passing over took its time: what is due is judged from now.
                now = inner.clock.now();
            }
            let trigger = control
                .trigger
                .filter(|t| state.last_trigger.is_none_or(|last| t.at > last));
            let (changed, blocked) =
                self.take_turns(&schedule, &mut state, now, trigger, &mut term);
            dirty |= changed;
            if dirty || !term.starts.is_empty() {
                for start in &term.starts {
                    state.running.push(Started {
                        scheduled: start.scheduled,
                        attempt: start.attempt,
                        fencing_token: token,
                        started_at: now,
                        identity: Some(leadership.identity().to_owned()),
                        triggered_by: start.triggered_by.clone(),
                        unknown_fields: Default::default(),
                    });
                }
                state.format = FORMAT;
                if self.write(&leadership, &state).await.is_err() {
                    return Ok(());
                }
                dirty = false;
                for start in term.starts.drain(..) {
                    term.running
                        .push(self.start(&leadership, start, now, &done));
                }
            }
            // Blocked: a missed firing waits for the running one to end (Overlap::Forbid).
            let scheduled = schedule.next_after(state.handled_until());
            if scheduled.is_none() && !term.waits.ran_out {
                term.waits.ran_out = true;
                tracing::warn!(schedule = %inner.name, after = %state.handled_until(), "the schedule has no instant after the last one handled: nothing more fires");
            }
            let next = (!blocked).then_some(scheduled).flatten();
            // A retry already due waits for a running firing to end, or for a resume.
            let retry = Self::next_retry(&state, now);
            let next = next.into_iter().chain(retry).min();
            let wait = next.map(|at| (at - inner.clock.now()).to_std().unwrap_or_default());
            let until = wait.map(|wait| tokio::time::Instant::now() + wait);
            let requests = leadership.extensions().remove(&inner.control_key);
            loop {
                tokio::select! {
                    biased;
                    () = leadership.lost() => return Ok(()),
                    Some((scheduled, attempt, outcome)) = finished.recv() => {
                        term.running.retain(|r: &Running| (r.scheduled, r.attempt) != (scheduled, attempt));
                        // A replaced firing was recorded when it was replaced.
                        if let Some(started) = take_running(&mut state, scheduled, attempt) {
                            self.retry_if_failed(&mut state, &started, &outcome);
                            self.ended(&mut state, scheduled, attempt, Some(&started), outcome);
                            dirty = true;
                        }
                        break;
                    }
                    () = sleep_until(until) => break,
                    // Operators' requests arrive with the term's renewals: look again only
                    // when they changed. The wait is timed on the monotonic clock: a wall
                    // clock stepped forward (back from a step back, say) brings the next
                    // instant nearer than the timer, so the wall clock is read again too.
                    () = tokio::time::sleep(CONTROL_POLL) => {
                        if leadership.extensions().remove(&inner.control_key) != requests
                            || next.is_some_and(|at| inner.clock.now() >= at)
                        {
                            break;
                        }
                    }
                }
            }
        }
    }

    /// The schedule's state as the term's record holds it, or a new one; the schedule the
    /// term runs; and whether the state is to be written at once (new, or its schedule or
    /// revision changed by this replica's configuration, [`CronJobBuilder::adopt_schedule`]).
    ///
    /// [`CronJobBuilder::adopt_schedule`]: crate::CronJobBuilder::adopt_schedule
    fn load(&self, leadership: &Leadership) -> Result<(CronState, Schedule, bool), CronError> {
        let inner = &self.inner;
        let ours = inner.schedule.spec();
        let revision = inner.schedule_revision;
        let Some(stored) = leadership.extensions().get(&inner.key).cloned() else {
            // Written at once, so that `leader status` and operators' requests find it.
            let mut state = CronState::new(ours, inner.clock.now());
            state.revision = self.our_revision();
            return Ok((state, inner.schedule.clone(), true));
        };
        let mut state = CronState::from_json(&stored).map_err(|err| CronError::BadState {
            name: inner.name.clone(),
            reason: err.to_string(),
        })?;
        let stored_revision = state.revision_number();
        let same = state.schedule == ours
            || Schedule::from_spec(&state.schedule).is_ok_and(|s| s.same_instants(&inner.schedule));
        if same {
            // A newer revision of the same schedule is kept, so that an older configuration
            // of another schedule cannot come back.
            let newer = revision > stored_revision;
            if newer {
                state.revision = self.our_revision();
                if let Some(r) = &mut state.revision {
                    r.schedule.clone_from(&state.schedule);
                }
            }
            return Ok((state, inner.schedule.clone(), newer));
        }
        let changed_after_start = state
            .changed
            .as_ref()
            .is_some_and(|c| c.at > inner.built_at);
        let decision = match revision.cmp(&stored_revision) {
            std::cmp::Ordering::Greater => Decision::Change,
            std::cmp::Ordering::Less => Decision::Follow("a higher revision"),
            std::cmp::Ordering::Equal if changed_after_start => {
                Decision::Follow("the same revision, changed after this replica started")
            }
            std::cmp::Ordering::Equal if inner.adopt_schedule => Decision::Change,
            std::cmp::Ordering::Equal => Decision::Refuse,
        };
        match decision {
            Decision::Change => {
                let now = inner.clock.now();
                tracing::warn!(schedule = %inner.name, from = %state.schedule, from_revision = stored_revision, to = %ours, revision, "changing the stored schedule to this replica's newer configuration: its first firing is its first instant after now");
                // The old schedule's instants not handled by now do not run: counted missed.
                let (missed, latest) = Schedule::from_spec(&state.schedule)
                    .map(|old| old.count_between(state.handled_until(), now, MOST_COUNTED))
                    .unwrap_or_default();
                self.missed(&mut state, missed, latest);
                state.changed = Some(ScheduleChange {
                    from: std::mem::replace(&mut state.schedule, ours.to_owned()),
                    at: now,
                    by: leadership.identity().to_owned(),
                    revision: (revision > 0).then_some(revision),
                    unknown_fields: Default::default(),
                });
                state.revision = self.our_revision();
                // The new schedule's first instant is its first after the change, never one
                // between the last firing and the change (S17).
                state.cursor = Some(now.max(state.handled_until()));
                Ok((state, inner.schedule.clone(), true))
            }
            Decision::Follow(why) => match Schedule::from_spec(&state.schedule) {
                Ok(stored) => {
                    tracing::warn!(schedule = %inner.name, stored = %state.schedule, stored_revision, ours, revision, "this replica's schedule differs from the stored one, which has {why}: running the stored schedule, never writing this one back (to change it, give the new configuration a higher --schedule-revision)");
                    Ok((state, stored, false))
                }
                Err(err) => Err(CronError::BadState {
                    name: inner.name.clone(),
                    reason: format!(
                        "the stored schedule {:?} has {why} than this replica's {ours:?}, and this release cannot run it: {err}",
                        state.schedule
                    ),
                }),
            },
            Decision::Refuse => Err(CronError::ScheduleMismatch {
                name: inner.name.clone(),
                stored: state.schedule,
                ours: ours.to_owned(),
                revision,
            }),
        }
    }

    /// This replica's revision as the state keeps it (none for 0).
    fn our_revision(&self) -> Option<Revision> {
        let inner = &self.inner;
        (inner.schedule_revision > 0).then(|| Revision {
            number: inner.schedule_revision,
            schedule: inner.schedule.spec().to_owned(),
            unknown_fields: Default::default(),
        })
    }

    /// Writes `state` into the record; `Err` when the term is over or given up (a write whose
    /// outcome is unknown: the leader steps down rather than guess).
    async fn write(&self, leadership: &Leadership, state: &CronState) -> Result<(), Stop> {
        match leadership
            .set_extension(self.inner.key.clone(), Some(state.to_json()))
            .await
        {
            Ok(()) => Ok(()),
            Err(ExtensionError::Lost(_)) => Err(Stop),
            Err(err) => {
                tracing::warn!(schedule = %self.inner.name, error = %err, "recording a firing failed: stepping down, so that the next leader reads what the store holds");
                let _ = leadership.step_down();
                Err(Stop)
            }
        }
    }

    /// Starts the work of a firing whose start is recorded. The task holds a clone of the
    /// leadership, so that the term's end waits for the work (S6).
    fn start(
        &self,
        leadership: &Leadership,
        start: Start,
        now: DateTime<Utc>,
        done: &mpsc::UnboundedSender<(DateTime<Utc>, u32, Outcome)>,
    ) -> Running {
        let inner = &self.inner;
        let Start {
            scheduled,
            attempt,
            triggered_by,
            ..
        } = start;
        let lateness = (now - scheduled).to_std().unwrap_or_default();
        metrics::counter!("leader_cron_firings_started_total", "name" => inner.name.clone())
            .increment(1);
        // How late the schedule's own first attempts start: a retry waits for its back-off
        // and a trigger has no schedule to be late for.
        if attempt == 1 && triggered_by.is_none() {
            metrics::histogram!("leader_cron_firing_lateness_seconds", "name" => inner.name.clone())
                .record(lateness.as_secs_f64());
        }
        tracing::info!(schedule = %inner.name, %scheduled, attempt, ?lateness, "firing started");
        let firing = Firing {
            name: inner.name.clone(),
            scheduled,
            attempt,
            fencing_token: leadership.fencing_token(),
            lateness,
            triggered_by,
            deadline: leadership.deadline(),
        };
        let _ = inner.events.send(CronEvent::Started(firing.clone()));
        let cancel = leadership.cancellation_token().child_token();
        let asked = CancellationToken::new();
        let work = (inner.work)(firing, cancel.clone());
        let (held, done) = (leadership.clone(), done.clone());
        let (limit, grace, stop) = (inner.timeout, inner.timeout_grace, cancel.clone());
        let (name, stopped) = (inner.name.clone(), asked.clone());
        tokio::spawn(async move {
            let mut work = tokio::spawn(work);
            let timed_out = async {
                match limit {
                    Some(limit) => tokio::time::sleep(limit).await,
                    None => std::future::pending().await,
                }
            };
            let joined = tokio::select! {
                joined = &mut work => Some(joined),
                () = timed_out => None,
                () = stopped.cancelled() => None,
            };
            let Some(joined) = joined else {
                // An operator's cancel was recorded when it was handled; a timeout is recorded
                // when the work has returned.
                let (outcome, why) = if stopped.is_cancelled() {
                    (Outcome::Cancelled { by: String::new() }, "its cancel")
                } else {
                    (Outcome::TimedOut, "its timeout")
                };
                stop.cancel();
                // Work that ignores its cancellation does not hold the schedule up.
                if tokio::time::timeout(grace, &mut work).await.is_err() {
                    work.abort();
                    tracing::warn!(schedule = %name, %scheduled, attempt, ?grace, "the work went on past {why} and grace, ignoring its cancellation: dropped, and its slot freed");
                }
                let _ = done.send((scheduled, attempt, outcome));
                drop(held);
                return;
            };
            let outcome = match joined {
                Ok(Ok(())) => Outcome::Succeeded,
                Ok(Err(err)) => Outcome::Failed {
                    message: err.to_string(),
                },
                Err(err) => Outcome::Failed {
                    message: if err.is_panic() {
                        "the job panicked".to_owned()
                    } else {
                        "the job was cancelled".to_owned()
                    },
                },
            };
            let _ = done.send((scheduled, attempt, outcome));
            drop(held);
        });
        Running {
            scheduled,
            attempt,
            cancel,
            stop: asked,
            ended: false,
        }
    }
}

/// Sleeps until `until`, or forever without a next firing.
async fn sleep_until(until: Option<tokio::time::Instant>) {
    match until {
        Some(until) => tokio::time::sleep_until(until).await,
        None => std::future::pending().await,
    }
}
