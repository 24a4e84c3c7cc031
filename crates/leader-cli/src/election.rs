//! What `leader run`, `leader cron` and `leader run --shards` share: this replica's identity
//! and timings, COMMAND's grace, the election with its surfaces (`--serve`, `--label-pod`,
//! `--handover-to`, `--once`, `--exit-on-identity-conflict`), the signals that stop it, and the
//! exit code. Each mode gives the work of a term; none of them is known here.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::{
    CancellationToken, ElectionError, FileLock, LeaderElector, LeaderState, Leadership, StepDown,
    StepDownReason, Timings,
};
use tokio::sync::watch;

use crate::args::ElectionArgs;
use crate::child::Program;
use crate::exit;
use crate::label;
use crate::open::{code_for, fail, open_lock};
use crate::serve;

/// COMMAND's default time between SIGTERM and SIGKILL.
const DEFAULT_GRACE: Duration = Duration::from_secs(3);

/// What a mode does in each term, made from the [`Term`] once the lock is open: run COMMAND for
/// the whole term (`leader run`), or once per firing of a schedule (`leader cron`).
pub(crate) type TermWork =
    Box<dyn Fn(Leadership) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Runs for leadership with `args` and does the work `make` gives for the term in each term,
/// until a signal or an exit. With `once`, a term that ends other than by a shutdown ends
/// `leader` with 75.
pub(crate) async fn elect(
    args: ElectionArgs,
    once: bool,
    command: Vec<String>,
    make: impl FnOnce(Term) -> Result<TermWork, String>,
) -> u8 {
    let (identity, timings) = match identity_and_timings(&args) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let grace = command_grace(args.grace, timings);
    let (lock, file_lock) = match open_lock(&args.lock, &identity, args.renew_deadline / 2).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    if let Err(err) = lock.check_lease(args.lease_duration).await {
        return fail(code_for(&err), err);
    }
    let describe = lock.describe();
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
    let work = match make(term) {
        Ok(work) => work,
        Err(err) => return fail(exit::USAGE, err),
    };
    builder = builder.on_started_leading(work);
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
        let endpoints = leader::LeaderEndpointsLayer::new(&elector)
            .ready_only_while_leading(args.ready_only_while_leading);
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
    if let Err(err) = elector.run(shutdown).await {
        return fail(exit::BAD_LOCK, err);
    }
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

    pub(crate) fn get(&self) -> Option<u8> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// On SIGTERM, SIGINT or SIGHUP: with `handover_to`, a leader hands its lease over (COMMAND
/// stopped, the lease released to that replica) before shutting down; otherwise a plain
/// shutdown, which stops COMMAND and releases the lease.
async fn on_signal(
    shutdown: CancellationToken,
    stopping: CancellationToken,
    mut state: watch::Receiver<LeaderState>,
    handover_to: Option<String>,
) {
    stop_signal().await;
    cut_graces_short_on_another_signal();
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

/// Once `leader` is stopping: a SIGTERM or SIGINT (a second Ctrl-C, an impatient supervisor)
/// ends COMMAND's grace at once ([`crate::child::cut_graces_short`]). Not SIGHUP: systemd
/// sends one right after its SIGTERM (`SendSIGHUP=`), and a closed terminal may send two.
pub(crate) fn cut_graces_short_on_another_signal() {
    tokio::spawn(async {
        leader_core::shutdown_signal().await;
        crate::child::cut_graces_short();
    });
}

/// Resolves on the signals that stop `leader`: SIGTERM, SIGINT, and SIGHUP ([`hangup`]).
pub(crate) async fn stop_signal() {
    tokio::select! {
        () = leader_core::shutdown_signal() => {}
        () = hangup() => {}
    }
}

/// Resolves on SIGHUP: the terminal or ssh session `leader` ran in was closed, which would
/// otherwise kill it without a release or COMMAND's grace. Never, when `leader` was started with
/// SIGHUP ignored (`nohup`): whoever started it asked for it to outlive its session.
async fn hangup() {
    use tokio::signal::unix::{SignalKind, signal};
    if ignored_at_start(nix::sys::signal::Signal::SIGHUP) {
        return std::future::pending().await;
    }
    match signal(SignalKind::hangup()) {
        Ok(mut hangup) => {
            hangup.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

/// Whether this process ignores `signal` (`SigIgn` of `/proc/self/status`, the mask it was
/// started with until a handler is installed); false where that cannot be read.
fn ignored_at_start(signal: nix::sys::signal::Signal) -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (signal as i32 - 1)) != 0)
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
