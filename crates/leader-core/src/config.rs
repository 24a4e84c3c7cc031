//! The elector's timings and switches, and the rules they keep (S4).

use std::time::Duration;

use crate::error::ConfigError;

/// client-go's default lease duration.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// client-go's default renew deadline.
pub const DEFAULT_RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// client-go's default retry period.
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);
/// client-go's jitter factor: candidates wait up to `retry_period * (1 + jitter)`; the renew
/// deadline must exceed `retry_period` times this factor (S4).
pub const JITTER_FACTOR: f64 = 1.2;

/// The three timings of an election, checked against the rules they must keep (S4) without a
/// lock or an elector: `lease_duration > renew_deadline > retry_period * 1.2 > 0`.
///
/// ```
/// use std::time::Duration;
/// use leader_core::Timings;
///
/// let timings = Timings {
///     lease_duration: Duration::from_secs(15),
///     renew_deadline: Duration::from_secs(10),
///     retry_period: Duration::from_secs(2),
/// };
/// assert!(timings.validate().is_ok());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timings {
    /// How long followers wait after the last change they saw before taking over.
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// Time between attempts.
    pub retry_period: Duration,
}

impl Default for Timings {
    /// client-go's defaults: 15 s, 10 s, 2 s.
    fn default() -> Self {
        Self {
            lease_duration: DEFAULT_LEASE_DURATION,
            renew_deadline: DEFAULT_RENEW_DEADLINE,
            retry_period: DEFAULT_RETRY_PERIOD,
        }
    }
}

impl Timings {
    /// Checks the rules, naming the first one broken.
    ///
    /// # Errors
    /// [`ConfigError::ZeroRetryPeriod`], [`ConfigError::RenewDeadlineNotLongerThanRetry`] or
    /// [`ConfigError::LeaseNotLongerThanRenewDeadline`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.retry_period.is_zero() {
            return Err(ConfigError::ZeroRetryPeriod);
        }
        if self.renew_deadline <= self.retry_period.mul_f64(JITTER_FACTOR) {
            return Err(ConfigError::RenewDeadlineNotLongerThanRetry {
                renew_deadline: self.renew_deadline,
                retry_period: self.retry_period,
                factor: JITTER_FACTOR,
            });
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(ConfigError::LeaseNotLongerThanRenewDeadline {
                lease_duration: self.lease_duration,
                renew_deadline: self.renew_deadline,
            });
        }
        Ok(())
    }

    /// The time between a leader's step-down at its renew deadline and the earliest moment a
    /// follower can take over: `lease_duration - renew_deadline`. The leader's work must be
    /// stopped within it.
    pub fn stop_window(&self) -> Duration {
        self.lease_duration.saturating_sub(self.renew_deadline)
    }
}

/// What an elector does when the work a term started ends by itself (returns or panics)
/// while the term goes on. A leader never keeps a lease for work that is no longer running.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkExit {
    /// The term ends: the lease is released (after every other piece of the term's work has
    /// stopped) and the candidate stands back briefly, so that another replica can take over,
    /// before it runs for leadership again. The default.
    #[default]
    StepDown,
    /// The work that ended is started again in the same term, one retry period later (each
    /// restart is logged). For work that is meant to run for the whole term and may fail.
    Restart,
}

/// The elector's timings and switches, as validated by
/// [`LeaderElectorBuilder::build`](crate::LeaderElectorBuilder::build).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ElectorConfig {
    /// The election's name, for status, logs and metric labels (see
    /// [`LeaderElectorBuilder::name`](crate::LeaderElectorBuilder::name)).
    pub name: String,
    /// How long followers wait after the last change they saw before taking over.
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// Time between attempts.
    pub retry_period: Duration,
    /// Candidates wait `retry_period * (1 + random(0..jitter))` between attempts.
    pub jitter: f64,
    /// Timeout of every lock request.
    pub request_timeout: Duration,
    /// How long the elector waits for the leader's work to stop after cancelling it.
    pub stop_grace: Duration,
    /// Whether the work of `run_while_leading` is given the stop grace to return by itself at
    /// a term's end, instead of being dropped at once.
    pub graceful_stop: bool,
    /// Release the lease on shutdown.
    pub release_on_cancel: bool,
    /// What happens when the term's work ends by itself.
    pub work_exit: WorkExit,
    /// The lowest fencing token an acquisition takes: every acquisition's token is at least
    /// this, and greater than every earlier one (S5). 0: no floor.
    pub fencing_token_floor: u64,
    /// Where the times written into the record come from.
    pub wall_clock: crate::WallClock,
}

impl ElectorConfig {
    /// The timings of this configuration.
    pub fn timings(&self) -> Timings {
        Timings {
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
        }
    }

    /// The longest a candidate waits between two attempts while the store answers:
    /// `retry_period * (1 + jitter)`.
    pub(crate) fn longest_retry(&self) -> Duration {
        self.retry_period.mul_f64(1.0 + self.jitter)
    }
}
