//! Building a job: its schedule, policies, limits and work.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use leader_core::CancellationToken;
use tokio::sync::broadcast;

use crate::control::control_key;
use crate::job::{BoxError, CronError, CronJob, EVENTS, Firing, Inner};
use crate::policy::{Interrupted, MAX_RUNNING, Missed, ON_TIME, Overlap};
use crate::schedule::Schedule;
use crate::state::{HISTORY, extension_key};
use leader_core::{Clock, SystemClock};

/// Builds a [`CronJob`]; start with [`CronJob::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
#[derive(Debug)]
pub struct CronJobBuilder {
    name: String,
    schedule: Schedule,
    missed: Missed,
    overlap: Overlap,
    interrupted: Interrupted,
    starting_deadline: Option<Duration>,
    misfire_threshold: Duration,
    max_running: usize,
    history: usize,
    adopt_schedule: bool,
    schedule_revision: u64,
    retries: u32,
    retry_backoff: Duration,
    timeout: Option<Duration>,
    timeout_grace: Duration,
    clock: Arc<dyn Clock>,
}

impl CronJobBuilder {
    /// Missed firings (default [`Missed::Latest`]).
    pub fn missed(mut self, missed: Missed) -> Self {
        self.missed = missed;
        self
    }

    /// A firing due while another runs (default [`Overlap::Forbid`]).
    pub fn overlap(mut self, overlap: Overlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// A firing whose leader died before it ended (default: retried, three attempts in all).
    pub fn interrupted(mut self, interrupted: Interrupted) -> Self {
        self.interrupted = interrupted;
        self
    }

    /// Firings later than this are missed whatever [`Missed`] says (CronJob's
    /// `startingDeadlineSeconds`). Default: none; longer than zero.
    pub fn starting_deadline(mut self, deadline: Duration) -> Self {
        self.starting_deadline = Some(deadline);
        self
    }

    /// How late a firing may start and still be on time (Quartz's `misfireThreshold`;
    /// default [`ON_TIME`], 1 s): a firing later than this when the leader gets to it is a
    /// missed one, which [`Missed`] decides about. Raise it where a leader may be slow to wake
    /// (a loaded machine, a long garbage collection) and firings should still run on time.
    /// Longer than zero: no leader starts a firing at its very instant.
    pub fn misfire_threshold(mut self, threshold: Duration) -> Self {
        self.misfire_threshold = threshold;
        self
    }

    /// Changes the stored schedule to this job's when this replica leads and finds another
    /// there whose configuration is not newer than this one's (default: off). A schedule change
    /// is a decision with a revision ([`schedule_revision`](Self::schedule_revision)), and the
    /// newer configuration wins, whichever replica leads:
    /// - a replica whose revision is higher than the stored schedule's changes it, with or
    ///   without this flag;
    /// - one whose revision is lower follows the stored schedule (runs it, never writes its own
    ///   back), and says so in one line;
    /// - with equal revisions (none given: 0), a replica started before the stored schedule
    ///   was changed follows it; one started after it changes it with this flag, and is
    ///   refused without it ([`CronError::ScheduleMismatch`], naming this option).
    ///
    /// Without revisions, a replica of the old schedule restarted after the change (a crash, a
    /// rollback) with this flag on changes it back: give each configuration a revision where
    /// that matters. A change is recorded ([`CronState::changed`](crate::CronState::changed):
    /// from what, when, by whom, the revision), and the new schedule's first firing is its
    /// first instant after the change (as db-scheduler and Quartz reschedule): none of its
    /// instants before the change runs; the old schedule's instants not handled by then are
    /// counted as missed.
    pub fn adopt_schedule(mut self, adopt: bool) -> Self {
        self.adopt_schedule = adopt;
        self
    }

    /// The revision of this replica's schedule configuration (default 0: none given), a
    /// number that grows with each change of the schedule (a counter, a date as
    /// `20260110`): the stored schedule keeps the revision it came with, a replica with a
    /// higher revision changes it, one with a lower revision follows it and never writes its
    /// own back (see [`adopt_schedule`](Self::adopt_schedule)).
    pub fn schedule_revision(mut self, revision: u64) -> Self {
        self.schedule_revision = revision;
        self
    }

    /// Runs a firing that failed (its work returned an error or panicked, or ran past the
    /// [`timeout`](Self::timeout)) again, up to `retries` more attempts (Kubernetes Job's
    /// `backoffLimit`; default 0, at most 100), after a back-off that starts at
    /// [`retry_backoff`](Self::retry_backoff) and doubles, up to six minutes. Each attempt's
    /// outcome is recorded; a retry waits for its time in the record, so a new leader runs it
    /// too, and takes its turn under the overlap policy ([`Overlap::Replace`] supersedes it).
    pub fn retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }

    /// The first back-off before a failed firing runs again (default 10 s, as Kubernetes
    /// Jobs); it doubles with each attempt, up to six minutes (or this, when longer).
    pub fn retry_backoff(mut self, backoff: Duration) -> Self {
        self.retry_backoff = backoff;
        self
    }

    /// Stops a firing's work that runs longer than `limit` (Kubernetes Job's
    /// `activeDeadlineSeconds`): its cancellation fires (a `leader cron` COMMAND gets SIGTERM,
    /// then SIGKILL after its grace), and once it returned (or after the
    /// [`timeout_grace`](Self::timeout_grace), dropped) its outcome is
    /// [`Outcome::TimedOut`](crate::Outcome::TimedOut), a failure that [`retries`](Self::retries) may run again.
    /// Default: none.
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
        self
    }

    /// How long work stopped by the [`timeout`](Self::timeout) may take to return once
    /// cancelled (default 10 s): work still running then is dropped at its next `.await` and
    /// its slot is freed, so that work that ignores its cancellation cannot hold the schedule
    /// up ([`Overlap::Forbid`] would wait behind it for ever). Work that blocks its thread
    /// without awaiting cannot be dropped: it goes on beside the next firing. A `leader cron`
    /// COMMAND gets its `--grace` first.
    pub fn timeout_grace(mut self, grace: Duration) -> Self {
        self.timeout_grace = grace;
        self
    }

    /// Under [`Overlap::Allow`], the most firings running at once (default [`MAX_RUNNING`],
    /// 16): one more waits until one of them ends. It bounds the state each firing adds to the
    /// record (a Kubernetes Lease keeps the whole record in one annotation).
    pub fn max_running(mut self, max: usize) -> Self {
        self.max_running = max;
        self
    }

    /// How many ended firings the record keeps (default [`HISTORY`], 10; 0 to 100): their
    /// start, end, attempt, outcome, fencing token and leader, shown by `leader status` and
    /// read with [`ScheduleStatus`](crate::ScheduleStatus).
    pub fn history(mut self, keep: usize) -> Self {
        self.history = keep;
        self
    }

    /// The wall clock (default: the system's; [`TokioClock`](crate::TokioClock) in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The job with `work`, run once per firing with the firing and a cancellation that fires
    /// when the term ends (or a later firing replaces this one). Its `Ok` or `Err` is recorded
    /// as the firing's outcome.
    ///
    /// # Errors
    /// An invalid name or policy.
    pub fn build<F, Fut>(self, work: F) -> Result<CronJob, CronError>
    where
        F: Fn(Firing, CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
    {
        let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if self.name.is_empty() || self.name.len() > 200 || !self.name.chars().all(valid) {
            return Err(CronError::BadName { name: self.name });
        }
        if let Missed::All { max: 0 } = self.missed {
            return Err(CronError::BadPolicy(
                "Missed::All needs a maximum of 1 or more".to_owned(),
            ));
        }
        if self.retries > 100 {
            return Err(CronError::BadPolicy(format!(
                "at most 100 retries, not {}",
                self.retries
            )));
        }
        if self.timeout.is_some_and(|t| t.is_zero()) || self.retry_backoff.is_zero() {
            return Err(CronError::BadPolicy(
                "a timeout and a retry back-off must be longer than zero".to_owned(),
            ));
        }
        if self.misfire_threshold.is_zero() || self.starting_deadline.is_some_and(|d| d.is_zero()) {
            return Err(CronError::BadPolicy(
                "a misfire threshold and a starting deadline must be longer than zero (no leader starts a firing at its very instant)".to_owned(),
            ));
        }
        if self.history > 100 {
            return Err(CronError::BadPolicy(format!(
                "a history of at most 100 firings, not {}",
                self.history
            )));
        }
        if self.max_running == 0 || self.max_running > 1000 {
            return Err(CronError::BadPolicy(format!(
                "max_running must be 1 to 1000, not {}",
                self.max_running
            )));
        }
        if let Interrupted::Retry { max_attempts } = self.interrupted
            && max_attempts < 2
        {
            return Err(CronError::BadPolicy(
                "Interrupted::Retry needs 2 attempts or more (or use GiveUp)".to_owned(),
            ));
        }
        Ok(CronJob {
            inner: Arc::new(Inner {
                key: extension_key(&self.name),
                control_key: control_key(&self.name),
                name: self.name,
                schedule: self.schedule,
                missed: self.missed,
                overlap: self.overlap,
                interrupted: self.interrupted,
                starting_deadline: self.starting_deadline,
                misfire_threshold: self.misfire_threshold,
                max_running: self.max_running,
                history: self.history,
                adopt_schedule: self.adopt_schedule,
                schedule_revision: self.schedule_revision,
                retries: self.retries,
                retry_backoff: self.retry_backoff,
                timeout: self.timeout,
                timeout_grace: self.timeout_grace,
                built_at: self.clock.now(),
                clock: self.clock,
                work: Arc::new(move |firing, cancel| Box::pin(work(firing, cancel))),
                events: broadcast::channel(EVENTS).0,
            }),
        })
    }
}

impl CronJob {
    /// A job named `name` (its record extension is `cron/NAME`) on `schedule`.
    pub fn builder(name: impl Into<String>, schedule: Schedule) -> CronJobBuilder {
        CronJobBuilder {
            name: name.into(),
            schedule,
            missed: Missed::default(),
            overlap: Overlap::default(),
            interrupted: Interrupted::default(),
            starting_deadline: None,
            misfire_threshold: ON_TIME,
            max_running: MAX_RUNNING,
            history: HISTORY,
            adopt_schedule: false,
            schedule_revision: 0,
            retries: 0,
            retry_backoff: Duration::from_secs(10),
            timeout: None,
            timeout_grace: Duration::from_secs(10),
            clock: Arc::new(SystemClock),
        }
    }
}
