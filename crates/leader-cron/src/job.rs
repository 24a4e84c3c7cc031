//! The job: a schedule, its policies and the work, run by the leader once per firing.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_core::CancellationToken;
use tokio::sync::broadcast;

use crate::policy::{Interrupted, Missed, Overlap};
use crate::schedule::{Schedule, ScheduleError};
use crate::state::Outcome;
use leader_core::Clock;

pub use leader_core::BoxError;

pub(crate) type JobFuture = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;
pub(crate) type JobFn = Arc<dyn Fn(Firing, CancellationToken) -> JobFuture + Send + Sync>;

/// Events kept for a subscriber that falls behind.
pub(crate) const EVENTS: usize = 256;

/// One firing of a schedule, as the job gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Firing {
    /// The schedule's name.
    pub name: String,
    /// The scheduled instant: with the name, the firing's identity.
    pub scheduled: DateTime<Utc>,
    /// 1, or more when the firing is run again after its leader died
    /// ([`Interrupted::Retry`]).
    pub attempt: u32,
    /// The fencing token of the term that runs it: pass it with every write the job makes.
    pub fencing_token: u64,
    /// How late it started, from its scheduled instant, by the leader's clock.
    pub lateness: Duration,
    /// Who asked for it, for a firing outside the schedule ([`trigger`](crate::trigger));
    /// `scheduled` is then the request's instant.
    pub triggered_by: Option<String>,
    /// When the term running it ends unless a renewal succeeds first
    /// ([`Leadership::deadline`](leader_core::Leadership::deadline)): for a watchdog on a thread
    /// of its own.
    pub deadline: leader_core::TermDeadline,
}

/// What happened to a job's firings, as [`CronJob::subscribe`] tells it (besides the logs
/// and metrics): for alerts, dashboards and tests that watch a schedule from the program.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CronEvent {
    /// A firing's start is recorded and its work started.
    Started(Firing),
    /// A firing ended: its work returned, failed, was replaced, or was given up after its
    /// leader died ([`Outcome::GaveUp`]). Recorded with the leader's next write.
    Ended {
        /// The firing's scheduled instant.
        scheduled: DateTime<Utc>,
        /// Its attempt.
        attempt: u32,
        /// How it ended.
        outcome: Outcome,
    },
    /// Firings were not run: late beyond the missed policy or the starting deadline, or due
    /// while another ran under [`Overlap::Forbid`].
    Missed {
        /// How many.
        count: u64,
        /// The latest of them, if it was looked at (a backlog beyond 100,000 instants is only
        /// counted).
        latest: Option<DateTime<Utc>>,
    },
}

/// Why a job does not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CronError {
    /// The store holds another schedule under this name, of the same configuration revision,
    /// and this replica neither follows it (it started after the stored schedule was changed,
    /// or it never was) nor adopts its own. Nothing is run and nothing is changed; the term
    /// ends so that a replica with the stored schedule may lead. To change a schedule on
    /// purpose, start the replicas of the new one with a higher
    /// [`schedule_revision`](crate::CronJobBuilder::schedule_revision) (`leader cron
    /// --schedule-revision`) or with [`adopt_schedule`](crate::CronJobBuilder::adopt_schedule)
    /// (`--adopt-schedule`).
    #[error(
        "schedule {name:?}: the store has {stored:?}, this replica has {ours:?} (same revision {revision}); to change it, start the new replicas with a higher --schedule-revision (schedule_revision) or --adopt-schedule (adopt_schedule)"
    )]
    ScheduleMismatch {
        /// The schedule's name.
        name: String,
        /// The stored schedule.
        stored: String,
        /// This replica's.
        ours: String,
        /// The configuration revision of both.
        revision: u64,
    },
    /// The stored state of the schedule cannot be read; it is left as it is.
    #[error("schedule {name:?}: the stored state cannot be read: {reason}")]
    BadState {
        /// The schedule's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A name that cannot be used.
    #[error("invalid schedule name {name:?}: use 1 to 200 letters, digits, '.', '_' or '-'")]
    BadName {
        /// The name as given.
        name: String,
    },
    /// A policy that cannot be used.
    #[error("invalid policy: {0}")]
    BadPolicy(String),
    /// The schedule.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The election cannot be built ([`CronJob::run_elected`]).
    #[error(transparent)]
    Election(#[from] leader_core::ConfigError),
    /// The election stopped before its first attempt: the store does not keep a lease this
    /// long ([`LeaderElector::run`](leader_core::LeaderElector::run)).
    #[error(transparent)]
    Elector(#[from] leader_core::ElectionError),
}

/// A scheduled job on a leader election: run it in each term with [`run`](Self::run) (from
/// `on_started_leading` or `run_while_leading`), and each firing of its schedule is started at
/// most once across replicas and terms (see the crate's documentation for what that rests on).
#[derive(Clone)]
pub struct CronJob {
    pub(crate) inner: Arc<Inner>,
}

/// A job's configuration, shared by its clones.
pub(crate) struct Inner {
    pub(crate) name: String,
    pub(crate) key: String,
    pub(crate) control_key: String,
    pub(crate) schedule: Schedule,
    pub(crate) missed: Missed,
    pub(crate) overlap: Overlap,
    pub(crate) interrupted: Interrupted,
    pub(crate) starting_deadline: Option<Duration>,
    pub(crate) misfire_threshold: Duration,
    pub(crate) max_running: usize,
    pub(crate) history: usize,
    pub(crate) adopt_schedule: bool,
    pub(crate) schedule_revision: u64,
    pub(crate) retries: u32,
    pub(crate) retry_backoff: Duration,
    pub(crate) timeout: Option<Duration>,
    pub(crate) timeout_grace: Duration,
    /// When the job was built, by its clock: a schedule changed after it is newer than this
    /// replica's configuration.
    pub(crate) built_at: DateTime<Utc>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) work: JobFn,
    pub(crate) events: broadcast::Sender<CronEvent>,
}

impl fmt::Debug for CronJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        f.debug_struct("CronJob")
            .field("name", &inner.name)
            .field("schedule", &inner.schedule)
            .field("missed", &inner.missed)
            .field("overlap", &inner.overlap)
            .field("interrupted", &inner.interrupted)
            .field("starting_deadline", &inner.starting_deadline)
            .field("misfire_threshold", &inner.misfire_threshold)
            .field("max_running", &inner.max_running)
            .field("history", &inner.history)
            .field("adopt_schedule", &inner.adopt_schedule)
            .field("schedule_revision", &inner.schedule_revision)
            .field("retries", &inner.retries)
            .field("retry_backoff", &inner.retry_backoff)
            .field("timeout", &inner.timeout)
            .field("timeout_grace", &inner.timeout_grace)
            .finish_non_exhaustive()
    }
}

impl CronJob {
    /// The events of this job's firings on this replica from now on (every clone of the job
    /// shares them). A receiver that falls more than 256 events behind loses the oldest, as
    /// [`broadcast`] does.
    pub fn subscribe(&self) -> broadcast::Receiver<CronEvent> {
        self.inner.events.subscribe()
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.inner.schedule
    }
}
