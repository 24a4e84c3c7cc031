//! `leader cron`: COMMAND once per firing of a schedule, on whichever replica leads. The
//! schedule runner is `leader_cron`'s: each firing is recorded in the lock's record before
//! COMMAND starts, and COMMAND's exit status is recorded as its outcome.

use std::time::Duration;

use leader::cron::{
    ControlError, CronError, CronJob, CronJobBuilder, Firing, Interrupted, Missed, Overlap,
    Schedule,
};
use leader_core::{CancellationToken, FileLock, Leadership};

use crate::args::{CronArgs, CronRequest, CronRequestArgs};
use crate::child::{self, Backstop, Ended};
use crate::election::{Term, TermWork, elect};
use crate::exit;
use crate::open::{code_for, fail, open_lock};

/// `leader cron suspend|resume|trigger|cancel`: written into the record with a
/// compare-and-swap, for whichever replica leads.
pub(crate) async fn request(request: CronRequest) -> u8 {
    let (what, args): (&str, &CronRequestArgs) = match &request {
        CronRequest::Suspend(args) => ("suspend", args),
        CronRequest::Resume(args) => ("resume", args),
        CronRequest::Trigger(args) => ("trigger", args),
        CronRequest::Cancel(args) => ("cancel", &args.request),
    };
    let lock = match open_lock(&args.lock, "leader-cron-request", Duration::from_secs(5)).await {
        Ok((lock, _)) => lock,
        Err(code) => return code,
    };
    let name = &args.lock.name;
    let by = args.by.clone().unwrap_or_else(asker);
    let written = match &request {
        CronRequest::Suspend(_) => leader::cron::suspend(&*lock, name, &by).await,
        CronRequest::Resume(_) => leader::cron::resume(&*lock, name).await,
        CronRequest::Trigger(_) => leader::cron::trigger(&*lock, name, &by).await,
        CronRequest::Cancel(args) => leader::cron::cancel(&*lock, name, &by, args.firing).await,
    };
    match written {
        Ok(control) => {
            match (what, &control.suspended, &control.trigger) {
                ("suspend", Some(since), _) => println!(
                    "{name}: suspended (by {} at {}); the leader starts no firing until resumed",
                    since.by,
                    since.at.to_rfc3339()
                ),
                ("resume", _, _) => println!("{name}: runs as scheduled"),
                ("cancel", _, _) => {
                    let firings = control.cancel.as_ref().map(|c| &c.firings);
                    for at in firings.into_iter().flatten() {
                        println!(
                            "{name}: cancels the firing scheduled at {}; the leader stops its COMMAND or drops its retry",
                            at.to_rfc3339()
                        );
                    }
                }
                (_, _, Some(asked)) => {
                    println!(
                        "{name}: asked for a firing now (at {}); the leader starts it once the overlap policy lets it",
                        asked.at.to_rfc3339()
                    );
                    if asked.at > chrono::Utc::now() + chrono::Duration::seconds(1) {
                        println!(
                            "{name}: this machine's clock is behind the last trigger handled: the request is dated just after it"
                        );
                    }
                }
                _ => println!("{name}: done"),
            }
            exit::OK
        }
        Err(
            err @ (ControlError::NoElection { .. }
            | ControlError::NoSchedule { .. }
            | ControlError::NothingToCancel { .. }),
        ) => fail(exit::NO_ELECTION, err),
        Err(ControlError::Lock(err)) => fail(code_for(&err), err),
        Err(err @ ControlError::BadControl { .. }) => fail(exit::REFUSED, err),
        Err(err) => fail(exit::FAILURE, err),
    }
}

/// Who asks, when `--by` does not say: USER@HOSTNAME.
fn asker() -> String {
    let user = std::env::var("USER").unwrap_or_else(|_| "someone".to_owned());
    let host = std::env::var("HOSTNAME").ok().or_else(|| {
        std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
    });
    match host {
        Some(host) if !host.is_empty() => format!("{user}@{host}"),
        _ => user,
    }
}

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
        .adopt_schedule(args.adopt_schedule)
        .schedule_revision(args.schedule_revision)
        .retries(args.retries)
        .retry_backoff(args.retry_backoff)
        .misfire_threshold(args.misfire_threshold)
        .interrupted(interrupted);
    if let Some(deadline) = args.starting_deadline {
        job = job.starting_deadline(deadline);
    }
    // A COMMAND stopped by --timeout or `leader cron cancel` gets its --grace between SIGTERM
    // and SIGKILL before it is dropped.
    let grace = args.election.grace.unwrap_or(Duration::from_secs(3));
    job = job.timeout_grace(grace + Duration::from_secs(2));
    if let Some(limit) = args.timeout {
        job = job.timeout(limit);
    }
    tracing::info!(schedule = %job_schedule(&args), "scheduled");
    elect(args.election, false, args.command, |term| {
        let job = work(job, term.clone()).map_err(|err| err.to_string())?;
        let each: TermWork =
            Box::new(move |leadership| Box::pin(run_term(job.clone(), term.clone(), leadership)));
        Ok(each)
    })
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
fn work(job: CronJobBuilder, term: Term) -> Result<CronJob, CronError> {
    job.build(move |firing: Firing, cancel: CancellationToken| {
        let term = term.clone();
        async move { fire(term, firing, cancel).await }
    })
}

/// One term of `leader cron`: the schedule runs until the term ends; a schedule the store
/// refuses ends `leader` with its exit code.
async fn run_term(job: CronJob, term: Term, leadership: Leadership) {
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
    if let Some(by) = &firing.triggered_by {
        term.program
            .env
            .push(("LEADER_FIRING_TRIGGERED_BY".to_owned(), by.clone()));
    }
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
            tracing::info!(?status, "COMMAND stopped: the term ended, a later firing replaced it, or it was timed out or cancelled");
            Err("stopped: the term ended, a later firing replaced it, or it was timed out or cancelled".into())
        }
    }
}
