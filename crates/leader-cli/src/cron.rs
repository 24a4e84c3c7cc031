//! `leader cron`: COMMAND once per firing of a schedule, on whichever replica leads. The
//! schedule runner is `leader_cron`'s: each firing is recorded in the lock's record before
//! COMMAND starts, and COMMAND's exit status is recorded as its outcome.

use leader::cron::{
    CronError, CronJob, CronJobBuilder, Firing, Interrupted, Missed, Overlap, Schedule,
};
use leader_core::{CancellationToken, FileLock, Leadership};

use crate::args::CronArgs;
use crate::child::{self, Backstop, Ended};
use crate::exit;
use crate::open::fail;
use crate::run::{Term, Work, elect};

pub(crate) async fn cron(args: CronArgs) -> u8 {
    let schedule = match (&args.schedule, args.every) {
        (Some(expression), None) => Schedule::cron(expression, &args.time_zone),
        (None, Some(period)) => Schedule::every(period),
        _ => return fail(exit::USAGE, "give one of --schedule and --every"),
    };
    let schedule = match schedule {
        Ok(schedule) => schedule,
        Err(err) => return fail(exit::BAD_SCHEDULE, err),
    };
    let missed = match args.missed.as_str() {
        "all" => Missed::All {
            max: args.missed_max,
        },
        "skip" => Missed::Skip,
        _ => Missed::Latest,
    };
    let overlap = match args.overlap.as_str() {
        "allow" => Overlap::Allow,
        "replace" => Overlap::Replace,
        _ => Overlap::Forbid,
    };
    let interrupted = if args.attempts <= 1 {
        Interrupted::GiveUp
    } else {
        Interrupted::Retry {
            max_attempts: args.attempts,
        }
    };
    let mut job = CronJob::builder(args.election.lock.name.clone(), schedule)
        .missed(missed)
        .overlap(overlap)
        .max_running(usize::from(args.max_running))
        .history(usize::from(args.history))
        .misfire_threshold(args.misfire_threshold)
        .interrupted(interrupted);
    if let Some(deadline) = args.starting_deadline {
        job = job.starting_deadline(deadline);
    }
    tracing::info!(schedule = %job_schedule(&args), "scheduled");
    elect(
        args.election,
        Work::Cron {
            job,
            command: args.command,
        },
    )
    .await
}

fn job_schedule(args: &CronArgs) -> String {
    match (&args.schedule, args.every) {
        (Some(expression), _) => format!("{expression} in {}", args.time_zone),
        (_, Some(period)) => format!("every {}", humantime::format_duration(period)),
        _ => String::new(),
    }
}

/// The job with its work: COMMAND per firing.
pub(crate) fn work(job: CronJobBuilder, term: Term) -> Result<CronJob, CronError> {
    job.build(move |firing: Firing, cancel: CancellationToken| {
        let term = term.clone();
        async move { fire(term, firing, cancel).await }
    })
}

/// One term of `leader cron`: the schedule runs until the term ends; a schedule the store
/// refuses ends `leader` with its exit code.
pub(crate) async fn run_term(job: CronJob, term: Term, leadership: Leadership) {
    let Err(err) = job.run(leadership).await else {
        return;
    };
    let code = match err {
        CronError::ScheduleMismatch { .. } => exit::SCHEDULE_MISMATCH,
        _ => exit::REFUSED,
    };
    eprintln!("leader: {err}");
    term.outcome.set_once(code);
    term.shutdown.cancel();
}

/// COMMAND for one firing, with the firing in its environment; stopped (SIGTERM, then SIGKILL
/// after the grace) when the term ends. `Ok` when it exits with 0.
async fn fire(
    mut term: Term,
    firing: Firing,
    cancel: CancellationToken,
) -> Result<(), leader::cron::BoxError> {
    term.program.env = vec![
        ("LEADER_SCHEDULE_NAME".to_owned(), firing.name.clone()),
        (
            "LEADER_FIRING_SCHEDULED".to_owned(),
            firing.scheduled.to_rfc3339(),
        ),
        (
            "LEADER_FIRING_ATTEMPT".to_owned(),
            firing.attempt.to_string(),
        ),
    ];
    let term_lock = term.file_lock.as_ref().and_then(FileLock::term_lock);
    let backstop = Backstop::new(firing.deadline.clone(), term.grace, term.timings);
    let mut running = match term
        .program
        .spawn(firing.fencing_token, term_lock, backstop)
    {
        Ok(child) => child,
        Err(err) => {
            eprintln!("leader: cannot start {:?}: {err}", term.program.command[0]);
            term.outcome.set_once(child::spawn_error_code(&err));
            term.shutdown.cancel();
            return Err(err.into());
        }
    };
    tokio::select! {
        ended = running.wait() => match ended {
            Ended::Itself(exit::OK) => Ok(()),
            Ended::Itself(code) => Err(format!("COMMAND exited with {code}").into()),
            Ended::PastDeadline => {
                Err("killed: COMMAND still ran past its term's deadline".into())
            }
        },
        () = cancel.cancelled() => {
            let status = child::terminate(&mut running, term.grace).await;
            tracing::info!(?status, "COMMAND stopped: the term ended or a later firing replaced it");
            Err("stopped: the term ended or a later firing replaced it".into())
        }
    }
}
