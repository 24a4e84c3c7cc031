//! `leader run --shards K`: take part in a shard set and run COMMAND once per shard owned.
//!
//! One COMMAND per shard, rather than one for the whole set told of changes: each shard's
//! process is stopped (SIGTERM, then SIGKILL after the grace) before its shard is released or
//! lost, exactly as a leader's COMMAND is before its lease (S3, S6), and a shard moving never
//! disturbs the others' work. A large set is better served by the library's `run_per_shard`.
//!
//! COMMAND is told the count in `LEADER_SHARD_COUNT`. When the set is resized, every COMMAND
//! of this replica is stopped and started again under the new count, in order: no COMMAND
//! starts under the new count while one of this replica still runs under the old (S17).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::{CancellationToken, Leadership, Shards, ShardsError, Timings};
use tokio::sync::{Notify, watch};

use crate::args::ElectionArgs;
use crate::child::{self, Backstop, Ended, Program};
use crate::election::{command_grace, identity_and_timings};
use crate::exit;
use crate::open::{code_for, fail};
use crate::serve;

/// How this replica takes part in the set: `--shards`, `--static-membership`,
/// `--static-membership-window`, `--weight`.
pub(crate) struct Membership {
    pub(crate) count: u32,
    pub(crate) static_membership: bool,
    pub(crate) static_membership_window: Option<Duration>,
    pub(crate) weight: u32,
}

pub(crate) async fn run(args: ElectionArgs, membership: Membership, command: Vec<String>) -> u8 {
    let Membership {
        count,
        static_membership,
        static_membership_window,
        weight,
    } = membership;
    let (identity, timings) = match identity_and_timings(&args) {
        Ok(both) => both,
        Err(code) => return code,
    };
    let single = [
        ("--handover-to", args.handover_to.is_some()),
        ("--label-pod", args.label_pod.is_some()),
        (
            "--exit-on-identity-conflict",
            args.exit_on_identity_conflict,
        ),
        ("--ready-only-while-leading", args.ready_only_while_leading),
    ];
    if let Some((flag, _)) = single.iter().find(|(_, given)| *given) {
        return fail(
            exit::USAGE,
            format!("{flag} applies to a single election and is not taken with --shards"),
        );
    }
    let pod_name = std::env::var("POD_NAME").is_ok_and(|p| !p.is_empty());
    if static_membership && args.identity.is_none() && !pod_name {
        return fail(
            exit::USAGE,
            "--static-membership needs an identity that outlives the process: give --identity \
             (or POD_NAME); the default, HOSTNAME-PID, changes with every start",
        );
    }
    let name = args.lock.name.clone();
    let url = match args.lock.lock.clone() {
        Some(url) => url,
        None => format!("file://{}", leader::default_file(&name).display()),
    };
    let set = match leader::open_set(&url, &name, &identity).await {
        Ok(set) => set,
        Err(leader::OpenError::Url(err)) => return fail(exit::BAD_LOCK, err),
        Err(leader::OpenError::Lock(err)) => return fail(code_for(&err), err),
        Err(err) => return fail(exit::FAILURE, err),
    };
    let describe = set.describe();
    let program = Program {
        command,
        name: name.clone(),
        identity: identity.clone(),
        env: Vec::new(),
    };
    let grace = command_grace(args.grace, timings);
    let mut builder = Shards::builder(name.clone(), count, set);
    if let Some(window) = static_membership_window {
        builder = builder.static_membership_window(window);
    }
    let counts = Counts::new(builder.subscribe_count());
    // The shard's term (a counted clone) stays with its COMMAND until COMMAND is gone: the
    // shard is released only then (S6).
    let shards = match builder
        .timings(timings)
        .stop_grace(timings.stop_window())
        .fencing_token_floor(args.fencing_token_floor)
        .static_membership(static_membership)
        .weight(weight)
        .on_shard_started(move |shard, term| {
            let shard = Shard {
                program: program.clone(),
                grace,
                timings,
                shard,
                counts: counts.clone(),
            };
            tokio::spawn(shard.run(term));
        })
        .build()
    {
        Ok(shards) => shards,
        Err(err) => return fail(exit::USAGE, err),
    };
    if let Some(addr) = args.serve_addr()
        && let Err(err) = serve::start_shards(addr, shards.subscribe()).await
    {
        return fail(exit::USAGE, format!("--serve {addr}: {err}"));
    }
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            crate::election::stop_signal().await;
            crate::election::cut_graces_short_on_another_signal();
            tracing::info!(
                "signal received: stopping every shard's COMMAND and releasing the shards"
            );
            shutdown.cancel();
        }
    });
    tracing::info!(identity, lock = %describe, shards = count, "joining the shard set");
    match shards.run(shutdown).await {
        Ok(()) => exit::OK,
        Err(err @ (ShardsError::CountMismatch { .. } | ShardsError::InvalidRoster { .. })) => {
            fail(exit::SHARD_COUNT_MISMATCH, err)
        }
        Err(err @ ShardsError::LeaseNotKept { .. }) => fail(exit::BAD_LOCK, err),
        Err(err @ ShardsError::Fenced { .. }) => fail(exit::IDENTITY_CONFLICT, err),
        Err(err) => fail(exit::FAILURE, err),
    }
}

/// The shard count each COMMAND of this replica runs under: a COMMAND starts under a count
/// only while none of this replica runs under another, so that no key is worked under two
/// counts here, and a COMMAND under a count that is no longer the set's is stopped.
#[derive(Clone, Debug)]
struct Counts {
    /// The count the set follows, as this replica last read it.
    set: watch::Receiver<u32>,
    /// The count the running COMMANDs run under, and how many run.
    running: Arc<Mutex<(u32, usize)>>,
    /// Woken when a COMMAND stops.
    stopped: Arc<Notify>,
}

impl Counts {
    fn new(set: watch::Receiver<u32>) -> Self {
        Self {
            set,
            running: Arc::default(),
            stopped: Arc::default(),
        }
    }

    /// Waits until a COMMAND may start under `count`: none runs under another.
    async fn enter(&self, count: u32) -> Running {
        loop {
            let stopped = self.stopped.notified();
            {
                let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
                if running.1 == 0 || running.0 == count {
                    *running = (count, running.1 + 1);
                    return Running {
                        counts: self.clone(),
                    };
                }
            }
            stopped.await;
        }
    }
}

/// A COMMAND counted as running under its count, until dropped (once it has stopped).
#[derive(Debug)]
struct Running {
    counts: Counts,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut running = self
            .counts
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        running.1 = running.1.saturating_sub(1);
        drop(running);
        self.counts.stopped.notify_waiters();
    }
}

/// One shard's COMMAND and what it needs.
struct Shard {
    program: Program,
    grace: Duration,
    timings: Timings,
    shard: u32,
    counts: Counts,
}

impl Shard {
    /// One shard's COMMAND: started with the shard's number, its token and the count, stopped
    /// when the shard's term ends, and started again under the new count when the set is
    /// resized (once this replica's COMMANDs under the old count have all stopped). A COMMAND
    /// that cannot start (where `leader run` exits with 126 or 127) or that exits by itself
    /// gives the shard up: another replica may take it, and this one takes it again only after
    /// a back-off that grows while COMMAND keeps failing.
    async fn run(self, term: Leadership) {
        let Self {
            program,
            grace,
            timings,
            shard,
            counts,
        } = self;
        let token = term.fencing_token();
        let backstop = Backstop::new(term.deadline(), grace, timings);
        let mut set = counts.set.clone();
        loop {
            let count = *set.borrow_and_update();
            let running = tokio::select! {
                biased;
                () = term.lost() => return,
                running = counts.enter(count) => running,
            };
            // The count moved on while this waited: wait again, under the newest.
            if set.has_changed().unwrap_or(false) {
                continue;
            }
            let mut program = program.clone();
            program.env.extend([
                ("LEADER_SHARD".into(), shard.to_string()),
                ("LEADER_SHARD_COUNT".into(), count.to_string()),
            ]);
            let mut process = match program.spawn(token, None, backstop.clone()) {
                Ok(process) => process,
                Err(err) => {
                    eprintln!(
                        "leader: cannot start {:?} for shard {shard}: {err}: giving the shard up",
                        program.command[0]
                    );
                    give_up(&term).await;
                    return;
                }
            };
            tracing::info!(
                shard,
                count,
                fencing_token = token,
                pid = process.id(),
                "COMMAND started for the shard"
            );
            // A count that can no longer change (the set is stopping) is waited for no more.
            let resized = async {
                while set.changed().await.is_ok() {
                    if *set.borrow_and_update() != count {
                        return;
                    }
                }
                std::future::pending::<()>().await;
            };
            tokio::select! {
                ended = process.wait() => {
                    drop(running);
                    match ended {
                        Ended::PastDeadline => {
                            give_up(&term).await;
                            term.lost().await;
                        }
                        Ended::Itself(code) => {
                            tracing::warn!(shard, code, "COMMAND exited by itself: giving the shard up");
                            give_up(&term).await;
                        }
                    }
                    return;
                }
                () = term.lost() => {
                    let status = child::terminate(&mut process, grace).await;
                    tracing::info!(shard, ?status, "COMMAND stopped: the shard's term ended");
                    return;
                }
                () = resized => {
                    let status = child::terminate(&mut process, grace).await;
                    tracing::info!(
                        shard,
                        from = count,
                        to = *set.borrow(),
                        ?status,
                        "COMMAND stopped: the set was resized; starting it again under the new count"
                    );
                }
            }
            drop(running);
        }
    }
}

/// Gives the shard up ([`Leadership::step_down`]), asking again while the term's one request
/// slot is taken, until the member takes the request or the term ends: a give-up is never
/// lost, so a shard never stays owned with no COMMAND running.
async fn give_up(term: &Leadership) {
    while term.step_down().is_err() && !term.is_lost() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
