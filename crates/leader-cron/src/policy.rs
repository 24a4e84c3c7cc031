//! The per-schedule policies: missed firings, overlapping firings, interrupted firings.

use std::time::Duration;

/// How late a firing may start and still count as on time (not missed) unless the job says
/// otherwise ([`CronJobBuilder::misfire_threshold`](crate::CronJobBuilder::misfire_threshold)):
/// the time a leader needs to wake and record it.
pub const ON_TIME: Duration = Duration::from_secs(1);

/// The most firings running at once under [`Overlap::Allow`] unless the job says otherwise
/// ([`CronJobBuilder::max_running`](crate::CronJobBuilder::max_running)).
pub const MAX_RUNNING: usize = 16;

/// What to do with firings whose time passed unmet, as Kubernetes CronJob's missed schedules
/// and Quartz's misfire instructions: firings more than the misfire threshold ([`ON_TIME`]
/// unless the job says otherwise) late when the leader gets to them, because nobody led (all
/// replicas down, a failover) or because they waited for a running firing ([`Overlap`]).
/// Firings older than the job's starting deadline, when it has one, are missed whatever the
/// policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Missed {
    /// Run the latest unmet firing, late; count the others as missed (CronJob's behaviour,
    /// Quartz's "fire once now"). When one is on time as well, it is the latest: the late
    /// ones are all missed.
    #[default]
    Latest,
    /// Run each missed firing, oldest first, at most `max` of them (the most recent ones); count
    /// the others as missed.
    All {
        /// The most missed firings run.
        max: u32,
    },
    /// Run none of them; count them as missed and go on with the next one on time.
    Skip,
}

/// What to do when a firing is due while an earlier one still runs, as CronJob's
/// `concurrencyPolicy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Overlap {
    /// One at a time: the new firing waits for the running one to end, and [`Missed`] decides
    /// about it then, as it does about any firing that is late by then (as CronJob's Forbid
    /// keeps its unmet schedule times): with [`Missed::Latest`] the latest waiting one runs,
    /// with [`Missed::All`] each runs in turn, with [`Missed::Skip`] they are skipped and
    /// counted as missed.
    #[default]
    Forbid,
    /// Run both, up to the job's maximum at once
    /// ([`MAX_RUNNING`] unless it says otherwise); beyond it a firing waits as under `Forbid`.
    Allow,
    /// Cancel the running one (its outcome is [`Outcome::Replaced`](crate::Outcome::Replaced))
    /// and run the new one once the cancelled work has returned, so that two never run at once
    /// (a `leader cron` COMMAND gets SIGTERM and its grace first). Firings due meanwhile are
    /// superseded by the latest: a first attempt is counted as missed, a retry of an
    /// interrupted firing ends as replaced. Work that ignores its cancellation holds up the
    /// next firing.
    Replace,
}

/// What to do with a firing that was started and whose leader died (or lost its lease) before
/// its outcome was recorded. The next leader finds it in the store and applies this at once;
/// a retry then takes its turn by that leader's [`Overlap`](crate::Overlap), as any firing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Interrupted {
    /// Run it again, as attempt 2, 3, ... up to `max_attempts` in all; then give it up. The job
    /// may therefore run more than once for one firing (at least once, when attempts remain):
    /// give it a fencing token check or make it idempotent.
    Retry {
        /// Attempts in all, the first included (at least 2 to retry at all).
        max_attempts: u32,
    },
    /// Give it up, recorded as [`Outcome::GaveUp`](crate::Outcome::GaveUp): the firing ran at
    /// most once, maybe not to its end.
    GiveUp,
}

impl Default for Interrupted {
    /// Three attempts in all.
    fn default() -> Self {
        Self::Retry { max_attempts: 3 }
    }
}
