//! `leader run`: run for leadership, run COMMAND during each term, stop it when the term ends.

use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::{
    CancellationToken, ElectionError, FileLock, LeaderElector, LeaderState, Leadership, StepDown,
    StepDownReason, Timings,
};
use tokio::sync::watch;

use crate::args::{ElectionArgs, RunArgs};
use crate::child::{self, Backstop, Ended, Program};
use crate::exit;
use crate::label;
use crate::open::{fail, open_lock};
use crate::serve;

/// COMMAND's default time between SIGTERM and SIGKILL.
const DEFAULT_GRACE: Duration = Duration::from_secs(3);

pub(crate) async fn run(args: RunArgs) -> u8 {
    if let Some(count) = args.shards {
        return crate::shards::run(args.election, count, args.command).await;
    }
    let work = Work::Term {
        once: args.once,
        command: args.command,
    };
    elect(args.election, work).await
}

/// What a term does: run COMMAND for the whole term (`leader run`), or once per firing of a
/// schedule (`leader cron`).
pub(crate) enum Work {
    /// `leader run`.
    Term {
        /// `--once`.
        once: bool,
        /// COMMAND.
        command: Vec<String>,
    },
    /// `leader cron`.
    #[cfg(feature = "cron")]
    Cron {
        /// The job, without its work: [`crate::cron::work`] adds it.
        job: leader::cron::CronJobBuilder,
        /// COMMAND.
        command: Vec<String>,
    },
}

/// Runs for leadership with `args` and does `work` in each term, until a signal or an exit.
pub(crate) async fn elect(args: ElectionArgs, work: Work) -> u8 {
    let (identity, timings) = match identity_and_timings(&args) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let grace = command_grace(args.grace, timings);
    let (lock, file_lock) = match open_lock(&args.lock, &identity, args.renew_deadline / 2).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let describe = lock.describe();
    let (once, command) = match &work {
        Work::Term { once, command } => (*once, command.clone()),
        #[cfg(feature = "cron")]
        Work::Cron { command, .. } => (false, command.clone()),
    };
    let term = Term {
        program: Program {
            command,
            name: args.lock.name.clone(),
            identity: identity.clone(),
            env: Vec::new(),
        },
        file_lock,
        grace,
        timings,
        shutdown: CancellationToken::new(),
        outcome: Outcome::default(),
    };
    // Set once a signal asked this replica to stop: a planned end, not a lost term.
    let stopping = CancellationToken::new();
    let (shutdown, outcome) = (term.shutdown.clone(), term.outcome.clone());
    let mut builder = LeaderElector::builder(lock)
        .name(args.lock.name.clone())
        .lease_duration(args.lease_duration)
        .renew_deadline(args.renew_deadline)
        .retry_period(args.retry_period)
        .stop_grace(timings.stop_window())
        .fencing_token_floor(args.fencing_token_floor)
        .on_new_leader(|leader| tracing::info!(leader, "leader"))
        .on_stopped_leading(exit_when_lost(once, &stopping, &shutdown, &outcome))
        .on_error(exit_on_identity_conflict(
            args.exit_on_identity_conflict,
            &shutdown,
            &outcome,
        ));
    builder = match work {
        Work::Term { .. } => {
            builder.on_started_leading(move |leadership| term.clone().run(leadership))
        }
        #[cfg(feature = "cron")]
        Work::Cron { job, .. } => {
            let job = match crate::cron::work(job, term.clone()) {
                Ok(job) => job,
                Err(err) => return fail(exit::USAGE, err),
            };
            builder.on_started_leading(move |leadership| {
                crate::cron::run_term(job.clone(), term.clone(), leadership)
            })
        }
    };
    if let Some(key) = &args.label_pod {
        builder = match label::attach(builder, key, &args.lock.name, timings).await {
            Ok(builder) => builder,
            Err(err) => return fail(exit::USAGE, err),
        };
    }
    let elector = match builder.build() {
        Ok(elector) => elector,
        Err(err) => return fail(exit::USAGE, err),
    };
    if let Some(addr) = args.serve_addr() {
        let endpoints = serve::Endpoints {
            health: elector.health_check(Duration::from_secs(5)),
            status: elector.status(),
            ready_only_while_leading: args.ready_only_while_leading,
        };
        if let Err(err) = serve::start(addr, endpoints).await {
            return fail(exit::USAGE, format!("--serve {addr}: {err}"));
        }
    }
    tokio::spawn(on_signal(
        shutdown.clone(),
        stopping,
        elector.subscribe(),
        args.handover_to.clone(),
    ));
    tracing::info!(identity, lock = %describe, "running for leadership");
    elector.run(shutdown).await;
    outcome.get().unwrap_or(exit::OK)
}

/// This replica's identity (or the default one) and its timings, checked before connecting to
/// anything.
pub(crate) fn identity_and_timings(args: &ElectionArgs) -> Result<(String, Timings), u8> {
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(leader_core::default_identity);
    let timings = Timings {
        lease_duration: args.lease_duration,
        renew_deadline: args.renew_deadline,
        retry_period: args.retry_period,
    };
    timings.validate().map_err(|err| fail(exit::USAGE, err))?;
    Ok((identity, timings))
}

/// How long COMMAND gets between SIGTERM and SIGKILL: `requested` or the default, capped so
/// that COMMAND is dead and reaped before the lease can expire for another replica (a fifth of
/// the time between the step-down and the lease's end is kept for SIGKILL and reaping).
pub(crate) fn command_grace(requested: Option<Duration>, timings: Timings) -> Duration {
    let max_grace = timings.stop_window().mul_f64(0.8);
    match requested {
        Some(grace) if grace > max_grace => {
            tracing::warn!(
                requested = ?grace,
                capped = ?max_grace,
                "--grace capped: COMMAND must be stopped before the lease can expire for another replica"
            );
            max_grace
        }
        Some(grace) => grace,
        None => DEFAULT_GRACE.min(max_grace),
    }
}

/// What every term needs to run COMMAND.
#[derive(Clone)]
pub(crate) struct Term {
    pub(crate) program: Program,
    /// The file lock, whose term lock COMMAND inherits.
    pub(crate) file_lock: Option<FileLock>,
    pub(crate) grace: Duration,
    /// The election's timings: when a COMMAND must be gone after its term's deadline.
    pub(crate) timings: Timings,
    pub(crate) shutdown: CancellationToken,
    pub(crate) outcome: Outcome,
}

impl Term {
    /// One term: starts COMMAND, and stops it when the term ends. COMMAND exiting by itself
    /// ends `leader` with COMMAND's code (the lease is released on the way out).
    async fn run(self, leadership: Leadership) {
        let token = leadership.fencing_token();
        let term_lock: Option<File> = self.file_lock.as_ref().and_then(FileLock::term_lock);
        let backstop = Backstop::new(leadership.deadline(), self.grace, self.timings);
        let mut child = match self.program.spawn(token, term_lock, backstop) {
            Ok(child) => child,
            Err(err) => {
                eprintln!("leader: cannot start {:?}: {err}", self.program.command[0]);
                self.outcome.set_once(child::spawn_error_code(&err));
                self.shutdown.cancel();
                return;
            }
        };
        tracing::info!(fencing_token = token, pid = child.id(), "COMMAND started");
        tokio::select! {
            ended = child.wait() => match ended {
                Ended::PastDeadline => {
                    // The term is over (the elector ends it at its own deadline); should it not
                    // be yet, no term goes on without its COMMAND.
                    let _ = leadership.step_down();
                    leadership.lost().await;
                }
                Ended::Itself(code) => {
                    tracing::info!(code, "COMMAND exited by itself: releasing the lease");
                    self.outcome.set_once(code);
                    self.shutdown.cancel();
                }
            },
            () = leadership.lost() => {
                let status = child::terminate(&mut child, self.grace).await;
                tracing::info!(?status, "COMMAND stopped");
                if self.shutdown.is_cancelled()
                    && let Ok(status) = status
                    && status.code().is_some()
                {
                    // Shut down by a signal: report COMMAND's own code if it exited.
                    self.outcome.set_once(child::exit_code(status));
                }
            }
        }
    }
}

/// With `--once`: exit 75 when a term ends other than by a shutdown asked for.
fn exit_when_lost(
    once: bool,
    stopping: &CancellationToken,
    shutdown: &CancellationToken,
    outcome: &Outcome,
) -> impl Fn(StepDown) + Send + Sync + 'static {
    let (stopping, shutdown, outcome) = (stopping.clone(), shutdown.clone(), outcome.clone());
    move |step_down| {
        if once && step_down.reason != StepDownReason::Shutdown && !stopping.is_cancelled() {
            outcome.set_once(exit::LOST);
            shutdown.cancel();
        }
    }
}

/// With `--exit-on-identity-conflict`: exit 8 when another process leads with this identity
/// (the elector has said so in a line of its own).
fn exit_on_identity_conflict(
    enabled: bool,
    shutdown: &CancellationToken,
    outcome: &Outcome,
) -> impl Fn(&ElectionError) + Send + Sync + 'static {
    let (shutdown, outcome) = (shutdown.clone(), outcome.clone());
    move |err| {
        if enabled && matches!(err, ElectionError::IdentityConflict(_)) {
            outcome.set_once(exit::IDENTITY_CONFLICT);
            shutdown.cancel();
        }
    }
}

/// What the supervisor decided the exit code is, once it knows.
#[derive(Clone, Default)]
pub(crate) struct Outcome(Arc<Mutex<Option<u8>>>);

impl Outcome {
    pub(crate) fn set_once(&self, code: u8) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(code);
    }

    fn get(&self) -> Option<u8> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// On SIGTERM or SIGINT: with `handover_to`, a leader hands its lease over (COMMAND stopped,
/// the lease released to that replica) before shutting down; otherwise a plain shutdown, which
/// stops COMMAND and releases the lease.
async fn on_signal(
    shutdown: CancellationToken,
    stopping: CancellationToken,
    mut state: watch::Receiver<LeaderState>,
    handover_to: Option<String>,
) {
    wait_for_signal().await;
    stopping.cancel();
    let leading = state.borrow().leadership().cloned();
    if let (Some(to), Some(leadership)) = (handover_to, leading)
        && leadership.hand_over(to.clone()).is_ok()
    {
        tracing::info!(to, "signal received: handing the lease over");
        drop(leadership);
        // Stepped down: COMMAND is stopped and the lease released to `to`.
        let _ = state.wait_for(|s| !s.is_leading()).await;
    } else {
        tracing::info!("signal received: stopping COMMAND and releasing the lease");
    }
    shutdown.cancel();
}

pub(crate) async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grace_leaves_time_to_kill_command_before_the_lease_ends() {
        let timings = Timings {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        };
        assert_eq!(command_grace(None, timings), DEFAULT_GRACE);
        assert_eq!(
            command_grace(Some(Duration::from_secs(60)), timings),
            Duration::from_secs(4)
        );
        let tight = Timings {
            lease_duration: Duration::from_secs(3),
            renew_deadline: Duration::from_millis(2500),
            ..timings
        };
        assert_eq!(command_grace(None, tight), Duration::from_millis(400));
    }
}
