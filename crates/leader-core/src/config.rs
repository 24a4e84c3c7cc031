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
/// The longest lease, renew deadline or retry period a configuration takes: a year. Every
/// deadline computed from them then stays within the clocks' range, and the lease within what
/// every store can write (Kubernetes keeps whole seconds in 32 bits).
pub const MAX_LEASE_DURATION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

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
    /// [`ConfigError::ZeroRetryPeriod`], [`ConfigError::RenewDeadlineNotLongerThanRetry`],
    /// [`ConfigError::LeaseNotLongerThanRenewDeadline`] or [`ConfigError::TimingTooLong`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (setting, value) in [
            ("lease duration", self.lease_duration),
            ("renew deadline", self.renew_deadline),
            ("retry period", self.retry_period),
        ] {
            if value > MAX_LEASE_DURATION {
                return Err(ConfigError::TimingTooLong {
                    setting,
                    value,
                    max: MAX_LEASE_DURATION,
                });
            }
        }
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

/// The settings of a lease, shared by an election ([`LeaderElector`](crate::LeaderElector)) and
/// each shard of a set ([`Shards`](crate::Shards)): one validation, one set of defaults.
///
/// | setting | default |
/// |---|---|
/// | `lease_duration`, `renew_deadline`, `retry_period` | 15 s, 10 s, 2 s (client-go's) |
/// | `request_timeout` | half the renew deadline (client-go's leader election clients' timeout): a failed renewal leaves time for another |
/// | `stop_grace` | lease duration less renew deadline ([`Timings::stop_window`]): the time left before a follower can take over |
/// | `release_on_cancel` | true |
/// | `fencing_token_floor` | 0 (none) |
/// | `wall_clock` | the system's |
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct LeaseConfig {
    /// How long followers wait after the last change they saw before taking over.
    pub lease_duration: Duration,
    /// How long a holder keeps its lease without a successful renewal.
    pub renew_deadline: Duration,
    /// Time between attempts (and, for a shard set, between rounds).
    pub retry_period: Duration,
    /// Timeout of every lock request (a batch counts as one).
    pub request_timeout: Duration,
    /// How long the work is waited for once a term ends, before the lease is released (or, for
    /// work still running then, left to expire).
    pub stop_grace: Duration,
    /// Release the lease on shutdown, so that another takes it at once.
    pub release_on_cancel: bool,
    /// The lowest fencing token an acquisition takes: every acquisition's token is at least
    /// this, and greater than every earlier one (S5). 0: no floor.
    pub fencing_token_floor: u64,
    /// Where the times written into records come from.
    pub wall_clock: crate::WallClock,
}

impl LeaseConfig {
    /// The timings of this configuration.
    pub fn timings(&self) -> Timings {
        Timings {
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
        }
    }
}

/// A [`LeaseConfig`] as a builder holds it: settings left unset take their defaults, which
/// depend on the timings, when it is checked.
#[derive(Clone, Debug)]
pub(crate) struct LeaseSettings {
    pub(crate) timings: Timings,
    pub(crate) request_timeout: Option<Duration>,
    pub(crate) stop_grace: Option<Duration>,
    pub(crate) release_on_cancel: bool,
    pub(crate) fencing_token_floor: u64,
    pub(crate) wall_clock: crate::WallClock,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        Self {
            timings: Timings::default(),
            request_timeout: None,
            stop_grace: None,
            release_on_cancel: true,
            fencing_token_floor: 0,
            wall_clock: crate::WallClock::system(),
        }
    }
}

impl LeaseSettings {
    /// The rules (S4), then the defaults that depend on the timings.
    pub(crate) fn check(&self) -> Result<LeaseConfig, ConfigError> {
        let timings = self.timings;
        timings.validate()?;
        let request_timeout = self.request_timeout.unwrap_or(timings.renew_deadline / 2);
        if request_timeout.is_zero() || request_timeout > timings.renew_deadline {
            return Err(ConfigError::InvalidRequestTimeout {
                request_timeout,
                renew_deadline: timings.renew_deadline,
            });
        }
        Ok(LeaseConfig {
            lease_duration: timings.lease_duration,
            renew_deadline: timings.renew_deadline,
            retry_period: timings.retry_period,
            request_timeout,
            stop_grace: self.stop_grace.unwrap_or(timings.stop_window()),
            release_on_cancel: self.release_on_cancel,
            fencing_token_floor: self.fencing_token_floor,
            wall_clock: self.wall_clock.clone(),
        })
    }
}

/// The elector's settings, as validated by
/// [`LeaderElectorBuilder::build`](crate::LeaderElectorBuilder::build).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ElectorConfig {
    /// The election's name, for status, logs and metric labels (see
    /// [`LeaderElectorBuilder::name`](crate::LeaderElectorBuilder::name)).
    pub name: String,
    /// The lease's settings.
    pub lease: LeaseConfig,
    /// Candidates wait `retry_period * (1 + random(0..jitter))` between attempts.
    pub jitter: f64,
    /// Whether the work of `run_while_leading` is given the stop grace to return by itself at
    /// a term's end, instead of being dropped at once.
    pub graceful_stop: bool,
    /// What happens when the term's work ends by itself.
    pub work_exit: WorkExit,
}

impl ElectorConfig {
    /// The longest a candidate waits between two attempts while the store answers:
    /// `retry_period * (1 + jitter)`.
    pub(crate) fn longest_retry(&self) -> Duration {
        self.lease.retry_period.mul_f64(1.0 + self.jitter)
    }
}
