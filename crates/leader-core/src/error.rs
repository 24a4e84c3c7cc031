//! Errors of locks and of the elector's configuration.

use std::error::Error as StdError;
use std::time::Duration;

/// A boxed error from a backend's driver.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// What went wrong in a [`ResourceLock`](crate::ResourceLock) call.
///
/// The variants tell the elector (and operators) apart the cases it treats differently: a lost
/// compare-and-swap is normal contention, an outage is retried, bad data and missing rights need a
/// person. Backends map their driver's errors onto these kinds.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The compare-and-swap failed: the object exists on `create`, or its version changed (or it
    /// vanished) on `update`. Someone else wrote first.
    #[error("{backend}: conflict: the lock record changed since it was read")]
    Conflict {
        /// The backend that reported it.
        backend: &'static str,
    },
    /// The stored value is not a valid record (garbage, wrong type, a key of another kind). It is
    /// reported and never overwritten.
    #[error("{backend}: invalid lock record: {reason}")]
    InvalidRecord {
        /// The backend that read it.
        backend: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The backend refused the request for lack of rights.
    #[error("{backend}: permission denied: {message}")]
    Forbidden {
        /// The backend that refused.
        backend: &'static str,
        /// What was refused, with the missing right where the backend names it.
        message: String,
    },
    /// The lock's storage is missing or misconfigured (a table that does not exist, a bad name).
    #[error("{backend}: misconfigured: {message}")]
    Misconfigured {
        /// The backend concerned.
        backend: &'static str,
        /// What to fix.
        message: String,
    },
    /// The backend could not be reached or failed to answer: connection refused, reset, server down.
    #[error("{backend}: unavailable: {source}")]
    Unavailable {
        /// The backend concerned.
        backend: &'static str,
        /// The driver's error, with credentials removed.
        #[source]
        source: BoxError,
    },
    /// The request did not complete within its timeout.
    #[error("{lock}: {operation} timed out after {after:?}")]
    Timeout {
        /// The lock's description ([`ResourceLock::describe`](crate::ResourceLock::describe)).
        lock: String,
        /// The lock operation that timed out (`get`, `create`, `update`, ...).
        operation: &'static str,
        /// The timeout that elapsed.
        after: Duration,
    },
    /// The store answered a write with the version it already had: it skipped the write as
    /// identical to what it stores (kube-apiserver and Consul do). That is no renewal: a
    /// follower's compare-and-swap on the unchanged version still succeeds (S14).
    #[error(
        "{backend}: the {operation} was answered with the version already stored ({version}): the store skipped it as identical, so it renewed nothing"
    )]
    Unmoved {
        /// The backend concerned.
        backend: &'static str,
        /// The lock operation (`update`, `renew`).
        operation: &'static str,
        /// The version that did not move.
        version: String,
    },
    /// Any other backend error.
    #[error("{backend}: {source}")]
    Other {
        /// The backend concerned.
        backend: &'static str,
        /// The driver's error, with credentials removed.
        #[source]
        source: BoxError,
    },
}

impl LockError {
    /// A [`LockError::Conflict`].
    pub fn conflict(backend: &'static str) -> Self {
        Self::Conflict { backend }
    }

    /// A [`LockError::InvalidRecord`].
    pub fn invalid_record(backend: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidRecord {
            backend,
            reason: reason.into(),
        }
    }

    /// A [`LockError::Unavailable`] wrapping a driver error.
    pub fn unavailable(backend: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Unavailable {
            backend,
            source: source.into(),
        }
    }

    /// A [`LockError::Other`] wrapping a driver error.
    pub fn other(backend: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Other {
            backend,
            source: source.into(),
        }
    }

    /// The same failure again, of the same kind and saying the same.
    pub(crate) fn duplicated(&self) -> Self {
        match self {
            Self::Conflict { backend } => Self::Conflict { backend },
            Self::InvalidRecord { backend, reason } => Self::InvalidRecord {
                backend,
                reason: reason.clone(),
            },
            Self::Forbidden { backend, message } => Self::Forbidden {
                backend,
                message: message.clone(),
            },
            Self::Misconfigured { backend, message } => Self::Misconfigured {
                backend,
                message: message.clone(),
            },
            Self::Unavailable { backend, source } => Self::Unavailable {
                backend,
                source: source.to_string().into(),
            },
            Self::Timeout {
                lock,
                operation,
                after,
            } => Self::Timeout {
                lock: lock.clone(),
                operation,
                after: *after,
            },
            Self::Unmoved {
                backend,
                operation,
                version,
            } => Self::Unmoved {
                backend,
                operation,
                version: version.clone(),
            },
            Self::Other { backend, source } => Self::Other {
                backend,
                source: source.to_string().into(),
            },
        }
    }

    /// True for a lost compare-and-swap.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Conflict { .. })
    }

    /// True for a failure that a request sent again a moment later may not meet: the store
    /// out of reach or throttling ([`LockError::Unavailable`]), or too slow to answer
    /// ([`LockError::Timeout`]).
    pub(crate) fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable { .. } | Self::Timeout { .. })
    }

    /// A short, stable label for metrics: `conflict`, `invalid_record`, `forbidden`,
    /// `misconfigured`, `unavailable`, `timeout`, `unmoved` or `other`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Conflict { .. } => "conflict",
            Self::InvalidRecord { .. } => "invalid_record",
            Self::Forbidden { .. } => "forbidden",
            Self::Misconfigured { .. } => "misconfigured",
            Self::Unavailable { .. } => "unavailable",
            Self::Timeout { .. } => "timeout",
            Self::Unmoved { .. } => "unmoved",
            Self::Other { .. } => "other",
        }
    }
}

/// A [`LeaderElector`](crate::LeaderElector) configuration that breaks a rule; returned by
/// [`LeaderElectorBuilder::build`](crate::LeaderElectorBuilder::build).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The lock has an empty identity, so the elector could not tell its own lease from a free one.
    #[error("the lock's identity is empty: give every candidate a unique, non-empty identity")]
    EmptyIdentity,
    /// The lease must outlast the renew deadline, or a follower could take over while the leader
    /// still believes it leads.
    #[error(
        "lease duration ({lease_duration:?}) must be greater than the renew deadline ({renew_deadline:?})"
    )]
    LeaseNotLongerThanRenewDeadline {
        /// The configured lease duration.
        lease_duration: Duration,
        /// The configured renew deadline.
        renew_deadline: Duration,
    },
    /// The renew deadline must leave room for at least one jittered retry.
    #[error(
        "renew deadline ({renew_deadline:?}) must be greater than retry period ({retry_period:?}) x {factor}"
    )]
    RenewDeadlineNotLongerThanRetry {
        /// The configured renew deadline.
        renew_deadline: Duration,
        /// The configured retry period.
        retry_period: Duration,
        /// The factor the retry period is multiplied by (1.2, client-go's jitter factor).
        factor: f64,
    },
    /// The retry period must be positive.
    #[error("retry period must be greater than zero")]
    ZeroRetryPeriod,
    /// A lease duration, renew deadline or retry period may be a year at most
    /// ([`MAX_LEASE_DURATION`](crate::MAX_LEASE_DURATION)): deadlines computed from longer
    /// timings would leave the clocks' range.
    #[error("{setting} ({value:?}) must be at most {max:?}")]
    TimingTooLong {
        /// Which timing: `lease duration`, `renew deadline` or `retry period`.
        setting: &'static str,
        /// Its configured value.
        value: Duration,
        /// The longest allowed.
        max: Duration,
    },
    /// Jitter must be a finite factor between 0 and 10.
    #[error("jitter ({0}) must be a finite number between 0 and 10")]
    InvalidJitter(f64),
    /// A shard set needs at least one shard, and at most the limit.
    #[error("shard count ({count}) must be between 1 and {max}")]
    InvalidShardCount {
        /// The configured count.
        count: u32,
        /// The largest count allowed.
        max: u32,
    },
    /// A shard set's static membership window must last at least the lease (a crashed
    /// member's shards wait that long anyway) and at most the limit.
    #[error(
        "static membership window ({window:?}) must be at least the lease duration \
         ({lease_duration:?}) and at most {max:?}"
    )]
    InvalidStaticMembershipWindow {
        /// The configured window.
        window: Duration,
        /// The configured lease duration.
        lease_duration: Duration,
        /// The longest window allowed.
        max: Duration,
    },
    /// Every request must time out before the renew deadline, so that a hung request cannot keep a
    /// leader from stepping down on time.
    #[error(
        "request timeout ({request_timeout:?}) must be greater than zero and at most the renew deadline ({renew_deadline:?})"
    )]
    InvalidRequestTimeout {
        /// The configured request timeout.
        request_timeout: Duration,
        /// The configured renew deadline.
        renew_deadline: Duration,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch that failed reports the same kind for every record: a refusal stays a refusal
    /// (not an outage to retry), an outage stays an outage.
    #[test]
    fn a_duplicate_keeps_the_kind_and_the_message() {
        let errors = [
            LockError::conflict("b"),
            LockError::invalid_record("b", "garbage"),
            LockError::Forbidden {
                backend: "b",
                message: "no rights".into(),
            },
            LockError::Misconfigured {
                backend: "b",
                message: "no table".into(),
            },
            LockError::unavailable("b", "refused"),
            LockError::Timeout {
                lock: "l".into(),
                operation: "get",
                after: Duration::from_secs(1),
            },
            LockError::other("b", "odd"),
        ];
        for err in &errors {
            let copies: Vec<Result<(), LockError>> = crate::backend::LockErrorExt::for_each(err, 3);
            assert_eq!(copies.len(), 3);
            for copy in copies {
                let copy = copy.expect_err("an error");
                assert_eq!(copy.kind(), err.kind(), "{err}");
                assert_eq!(copy.to_string(), err.to_string());
            }
        }
    }
}
