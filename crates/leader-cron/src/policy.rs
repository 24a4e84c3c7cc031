//! The per-schedule policies: missed firings, overlapping firings, interrupted firings.

use std::time::Duration;

/// How late a firing may start and still count as on time (not missed): the time a leader needs
/// to wake and record it.
pub const ON_TIME: Duration = Duration::from_secs(1);

/// What to do with firings whose time passed while nobody led (all replicas down, a failover),
/// as Kubernetes CronJob's missed schedules and Quartz's misfire instructions: firings more than
/// [`ON_TIME`] late when the leader gets to them. Firings older than the job's starting
/// deadline, when it has one, are missed whatever the policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Missed {
    /// Run the latest missed firing, late; count the others as missed (CronJob's behaviour,
    /// Quartz's "fire once now").
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
    /// Skip the new firing (counted as missed); the running one goes on.
    #[default]
    Forbid,
    /// Run both.
    Allow,
    /// Cancel the running one (its outcome is [`Outcome::Replaced`](crate::Outcome::Replaced))
    /// and run the new one.
    Replace,
}

/// What to do with a firing that was started and whose leader died (or lost its lease) before
/// its outcome was recorded. The next leader finds it in the store and applies this at once.
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
