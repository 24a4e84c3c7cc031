//! A term of a job: its loop, from reading the schedule's state to the term's end, and how each
//! firing's start and outcome are written and its work run.

use chrono::{DateTime, Utc};
use leader_core::{ExtensionError, Leadership};
use tokio::sync::mpsc;

use crate::job::{CronError, CronEvent, CronJob, Firing};
use crate::policy::Interrupted;
use crate::schedule::Schedule;
use crate::state::{CronState, Outcome, ScheduleChange, Started};
use crate::term::{CONTROL_POLL, Running, Start, Term, take_running};

/// The term is over (or was given up): stop.
struct Stop;

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
        let interrupted = std::mem::take(&mut state.running);
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
                    term.starts.push(Start {
                        scheduled: firing.scheduled,
                        attempt: firing.attempt + 1,
                        triggered_by: firing.triggered_by.clone(),
                    });
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
            dirty |= self.retries_due(&mut state, now, &mut term);
            if self.pass_over_backlog(&schedule, &mut state, now).await {
                dirty = true;
                // Passing over took its time: what is due is judged from now.
                now = inner.clock.now();
            }
            let (changed, blocked) = self.due(&schedule, &mut state, now, &mut term);
            dirty |= changed;
            if let Some(request) = control
                .trigger
                .filter(|t| state.last_trigger.is_none_or(|last| t.at > last))
            {
                dirty |= self.triggered(&mut state, request, &mut term);
            }
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
            let next = (!blocked)
                .then(|| schedule.next_after(state.handled_until()))
                .flatten();
            let retry = state.retrying.iter().map(|r| r.at).min();
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
                    // when they changed.
                    () = tokio::time::sleep(CONTROL_POLL) => {
                        if leadership.extensions().remove(&inner.control_key) != requests {
                            break;
                        }
                    }
                }
            }
        }
    }

    /// The schedule's state as the term's record holds it, or a new one; the schedule the
    /// term runs; and whether the state is to be written at once (new, or changed by
    /// [`CronJobBuilder::adopt_schedule`]).
    fn load(&self, leadership: &Leadership) -> Result<(CronState, Schedule, bool), CronError> {
        let inner = &self.inner;
        let ours = inner.schedule.spec();
        let Some(stored) = leadership.extensions().get(&inner.key).cloned() else {
            // Written at once, so that `leader status` and operators' requests find it.
            let state = CronState::new(ours, inner.clock.now());
            return Ok((state, inner.schedule.clone(), true));
        };
        let mut state = CronState::from_json(&stored).map_err(|err| CronError::BadState {
            name: inner.name.clone(),
            reason: err.to_string(),
        })?;
        if state.schedule == ours {
            return Ok((state, inner.schedule.clone(), false));
        }
        if inner.adopt_schedule {
            tracing::warn!(schedule = %inner.name, from = %state.schedule, to = %ours, "changing the stored schedule to this replica's");
            state.changed = Some(ScheduleChange {
                from: std::mem::replace(&mut state.schedule, ours.to_owned()),
                at: inner.clock.now(),
                by: leadership.identity().to_owned(),
                unknown_fields: Default::default(),
            });
            return Ok((state, inner.schedule.clone(), true));
        }
        // A schedule changed after this replica was configured is newer: follow it.
        let newer = state
            .changed
            .as_ref()
            .is_some_and(|c| c.at > inner.built_at);
        if let Some(stored) = newer
            .then(|| Schedule::from_spec(&state.schedule).ok())
            .flatten()
        {
            tracing::warn!(schedule = %inner.name, stored = %state.schedule, ours, "the stored schedule was changed after this replica started: running it instead of this replica's");
            return Ok((state, stored, false));
        }
        Err(CronError::ScheduleMismatch {
            name: inner.name.clone(),
            stored: state.schedule,
            ours: ours.to_owned(),
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
        } = start;
        let lateness = (now - scheduled).to_std().unwrap_or_default();
        metrics::counter!("leader_cron_firings_started_total", "name" => inner.name.clone())
            .increment(1);
        metrics::histogram!("leader_cron_firing_lateness_seconds", "name" => inner.name.clone())
            .record(lateness.as_secs_f64());
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
        let work = (inner.work)(firing, cancel.clone());
        let (held, done) = (leadership.clone(), done.clone());
        let (limit, stop) = (inner.timeout, cancel.clone());
        tokio::spawn(async move {
            let mut work = tokio::spawn(work);
            let joined = match limit {
                Some(limit) => tokio::time::timeout(limit, &mut work).await.ok(),
                None => Some((&mut work).await),
            };
            let Some(joined) = joined else {
                stop.cancel();
                let _ = work.await;
                let _ = done.send((scheduled, attempt, Outcome::TimedOut));
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
            replaced: false,
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
