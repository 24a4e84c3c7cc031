//! `leader run --shards K`: take part in a shard set and run COMMAND once per shard owned.
//!
//! One COMMAND per shard, rather than one for the whole set told of changes: each shard's
//! process is stopped (SIGTERM, then SIGKILL after the grace) before its shard is released or
//! lost, exactly as a leader's COMMAND is before its lease (S3, S6), and a shard moving never
//! disturbs the others' work. A large set is better served by the library's `run_per_shard`.

use std::time::Duration;

use leader_core::{CancellationToken, Leadership, Shards, ShardsError, Timings};

use crate::args::ElectionArgs;
use crate::child::{self, Backstop, Ended, Program};
use crate::election::{command_grace, identity_and_timings};
use crate::exit;
use crate::open::{code_for, fail};
use crate::serve;

/// How this replica takes part in the set: `--shards`, `--static-membership`, `--weight`.
pub(crate) struct Membership {
    pub(crate) count: u32,
    pub(crate) static_membership: bool,
    pub(crate) weight: u32,
}

pub(crate) async fn run(args: ElectionArgs, membership: Membership, command: Vec<String>) -> u8 {
    let Membership {
        count,
        static_membership,
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
        ("--fencing-token-floor", args.fencing_token_floor != 0),
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
        env: vec![("LEADER_SHARD_COUNT".into(), count.to_string())],
    };
    let grace = command_grace(args.grace, timings);
    // The shard's term (a counted clone) stays with its COMMAND until COMMAND is gone: the
    // shard is released only then (S6).
    let shards = match Shards::builder(name.clone(), count, set)
        .timings(timings)
        .stop_grace(timings.stop_window())
        .static_membership(static_membership)
        .weight(weight)
        .on_shard_started(move |shard, term| {
            tokio::spawn(per_shard(program.clone(), grace, timings, shard, term));
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
            leader_core::shutdown_signal().await;
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
        Err(err) => fail(exit::FAILURE, err),
    }
}

/// One shard's COMMAND: started with the shard's number and token, stopped when the shard's
/// term ends. A COMMAND that cannot start (where `leader run` exits with 126 or 127) or that
/// exits by itself gives the shard up: another replica may take it, and this one takes it
/// again only after a back-off that grows while COMMAND keeps failing.
async fn per_shard(
    mut program: Program,
    grace: Duration,
    timings: Timings,
    shard: u32,
    term: Leadership,
) {
    program.env.push(("LEADER_SHARD".into(), shard.to_string()));
    let token = term.fencing_token();
    let backstop = Backstop::new(term.deadline(), grace, timings);
    let mut process = match program.spawn(token, None, backstop) {
        Ok(process) => process,
        Err(err) => {
            eprintln!(
                "leader: cannot start {:?} for shard {shard}: {err}: giving the shard up",
                program.command[0]
            );
            let _ = term.step_down();
            return;
        }
    };
    tracing::info!(
        shard,
        fencing_token = token,
        pid = process.id(),
        "COMMAND started for the shard"
    );
    tokio::select! {
        ended = process.wait() => match ended {
            Ended::PastDeadline => {
                let _ = term.step_down();
                term.lost().await;
            }
            Ended::Itself(code) => {
                tracing::warn!(shard, code, "COMMAND exited by itself: giving the shard up");
                let _ = term.step_down();
            }
        },
        () = term.lost() => {
            let status = child::terminate(&mut process, grace).await;
            tracing::info!(shard, ?status, "COMMAND stopped: the shard's term ended");
        }
    }
}
