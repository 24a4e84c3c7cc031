//! `leader run`: run for leadership, run COMMAND during each term, stop it when the term ends.

use std::fs::File;

use leader_core::{FileLock, Leadership};

use crate::args::RunArgs;
use crate::child::{self, Backstop, Ended};
use crate::election::{Term, TermWork, elect};

pub(crate) async fn run(args: RunArgs) -> u8 {
    if let Some(count) = args.shards {
        let membership = crate::shards::Membership {
            count,
            static_membership: args.static_membership,
            static_membership_window: args.static_membership_window,
            weight: args.weight,
        };
        return crate::shards::run(args.election, membership, args.command).await;
    }
    elect(args.election, args.once, args.command, |term| {
        let work: TermWork =
            Box::new(move |leadership| Box::pin(command(term.clone(), leadership)));
        Ok(work)
    })
    .await
}

/// One term: starts COMMAND, and stops it when the term ends. COMMAND exiting by itself ends
/// `leader` with COMMAND's code (the lease is released on the way out).
async fn command(term: Term, leadership: Leadership) {
    let token = leadership.fencing_token();
    let term_lock: Option<File> = term.file_lock.as_ref().and_then(FileLock::term_lock);
    let backstop = Backstop::new(leadership.deadline(), term.grace, term.timings);
    let mut child = match term.program.spawn(token, term_lock, backstop) {
        Ok(child) => child,
        Err(err) => {
            eprintln!("leader: cannot start {:?}: {err}", term.program.command[0]);
            term.outcome.set_once(child::spawn_error_code(&err));
            term.shutdown.cancel();
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
                term.outcome.set_once(code);
                term.shutdown.cancel();
            }
        },
        () = leadership.lost() => {
            let status = child::terminate(&mut child, term.grace).await;
            tracing::info!(?status, "COMMAND stopped");
            if term.shutdown.is_cancelled()
                && let Ok(status) = status
                && status.code().is_some()
            {
                // Shut down by a signal: report COMMAND's own code if it exited.
                term.outcome.set_once(child::exit_code(status));
            }
        }
    }
}
