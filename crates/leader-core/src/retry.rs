//! S9: how long a candidate waits after a failed attempt, and how an outage is logged.
//!
//! Both are small state machines without I/O, so the rules are tested on their own; the runner
//! feeds them outcomes and acts on what they say.

use std::time::Duration;

use tokio::time::Instant;

use crate::error::LockError;

/// How often a lasting outage is summarised in the log.
pub(crate) const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// The wait between attempts: the jittered retry period while requests succeed, and after
/// consecutive failures an exponential back-off (with jitter) up to a cap.
#[derive(Clone, Debug)]
pub(crate) struct Backoff {
    retry_period: Duration,
    jitter: f64,
    cap: Duration,
    failures: u32,
}

impl Backoff {
    /// `cap` is raised to the retry period if it is shorter: a failure never shortens the wait.
    pub(crate) fn new(retry_period: Duration, jitter: f64, cap: Duration) -> Self {
        Self {
            retry_period,
            jitter,
            cap: cap.max(retry_period),
            failures: 0,
        }
    }

    /// Consecutive failures so far.
    pub(crate) fn failures(&self) -> u32 {
        self.failures
    }

    pub(crate) fn is_failing(&self) -> bool {
        self.failures > 0
    }

    pub(crate) fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
    }

    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// The retry period with client-go's jitter: `retry_period * (1 + random(0..jitter))`.
    pub(crate) fn jittered_retry(&self) -> Duration {
        self.retry_period
            .mul_f64(1.0 + fastrand::f64() * self.jitter)
    }

    /// How long to wait before the next attempt. Never less than the jittered retry period.
    /// After `n` consecutive failures: `min(cap, retry_period * 2^(n-1))`, less up to half of it
    /// at random (scaled by the jitter factor, so that a jitter of 0 gives exact waits).
    pub(crate) fn wait(&self) -> Duration {
        let retry = self.jittered_retry();
        if self.failures <= 1 {
            return retry;
        }
        let doublings = (self.failures - 1).min(31);
        let ceiling = self
            .retry_period
            .checked_mul(1 << doublings)
            .map_or(self.cap, |d| d.min(self.cap));
        let spread = fastrand::f64() * self.jitter.min(1.0) / 2.0;
        retry.max(ceiling.mul_f64(1.0 - spread))
    }

    /// The longest [`wait`](Self::wait) can be: how late a candidate may notice that the store
    /// is back.
    #[cfg(test)]
    pub(crate) fn longest_wait(&self) -> Duration {
        self.cap.max(self.retry_period.mul_f64(1.0 + self.jitter))
    }
}

/// What [`FailureLog`] says should be logged about an outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LogLine {
    /// Nothing: a failure like the ones already reported, too soon for a summary.
    Quiet,
    /// A failure after successes: the outage starts.
    Started,
    /// A failure of another kind than the last reported.
    Changed,
    /// The failures go on: `count` of them since the outage started, `since` ago.
    Summary { count: u64, since: Duration },
    /// A success after `count` failures over `lasted`.
    Recovered { count: u64, lasted: Duration },
}

#[derive(Clone, Debug)]
struct Outage {
    started: Instant,
    count: u64,
    kind: &'static str,
    operation: &'static str,
    summarised: Instant,
}

/// Turns a run of failures into a few log lines: one when an outage starts or changes kind, a
/// summary at most every [`SUMMARY_EVERY`], one when it ends. Metrics count every failure; the log
/// is for a person reading it during an hour-long outage.
#[derive(Clone, Debug, Default)]
pub(crate) struct FailureLog {
    outage: Option<Outage>,
}

impl FailureLog {
    /// Notes a failed request and says what to log.
    pub(crate) fn failed(&mut self, operation: &'static str, err: &LockError) -> LogLine {
        let now = Instant::now();
        let kind = err.kind();
        let Some(outage) = &mut self.outage else {
            self.outage = Some(Outage {
                started: now,
                count: 1,
                kind,
                operation,
                summarised: now,
            });
            return LogLine::Started;
        };
        outage.count += 1;
        if outage.kind != kind || outage.operation != operation {
            outage.kind = kind;
            outage.operation = operation;
            outage.summarised = now;
            return LogLine::Changed;
        }
        if now.duration_since(outage.summarised) >= SUMMARY_EVERY {
            outage.summarised = now;
            return LogLine::Summary {
                count: outage.count,
                since: now.duration_since(outage.started),
            };
        }
        LogLine::Quiet
    }

    /// Notes a request that the store answered, and says what to log.
    pub(crate) fn succeeded(&mut self) -> LogLine {
        match self.outage.take() {
            Some(outage) => LogLine::Recovered {
                count: outage.count,
                lasted: outage.started.elapsed(),
            },
            None => LogLine::Quiet,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRY: Duration = Duration::from_secs(2);
    const CAP: Duration = Duration::from_secs(15);

    fn outage() -> LockError {
        LockError::unavailable("test", "down")
    }

    #[test]
    fn waits_double_after_each_failure_up_to_the_cap_and_reset_on_success() {
        let mut backoff = Backoff::new(RETRY, 0.0, CAP);
        assert_eq!(backoff.wait(), RETRY);
        let mut waits = Vec::new();
        for _ in 0..6 {
            backoff.failed();
            waits.push(backoff.wait().as_secs());
        }
        assert_eq!(waits, [2, 4, 8, 15, 15, 15]);
        backoff.succeeded();
        assert_eq!(backoff.wait(), RETRY);
    }

    #[test]
    fn jittered_waits_stay_between_the_retry_period_and_the_longest_wait() {
        let mut backoff = Backoff::new(RETRY, 1.2, CAP);
        for _ in 0..200 {
            backoff.failed();
            let wait = backoff.wait();
            assert!(wait >= RETRY && wait <= backoff.longest_wait(), "{wait:?}");
            if backoff.failures() > 10 {
                assert!(wait >= CAP / 2, "{wait:?}");
            }
        }
    }

    #[test]
    fn a_cap_below_the_retry_period_never_shortens_the_wait() {
        let mut backoff = Backoff::new(RETRY, 0.0, Duration::from_millis(10));
        for _ in 0..40 {
            backoff.failed();
            assert_eq!(backoff.wait(), RETRY);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_logged_when_it_starts_changes_every_ten_seconds_and_when_it_ends() {
        let mut log = FailureLog::default();
        assert_eq!(log.succeeded(), LogLine::Quiet);
        assert_eq!(log.failed("get", &outage()), LogLine::Started);
        let mut lines = Vec::new();
        for _ in 0..100 {
            tokio::time::advance(Duration::from_millis(300)).await;
            lines.push(log.failed("get", &outage()));
        }
        let summaries = lines.iter().filter(|l| **l != LogLine::Quiet).count();
        assert_eq!(summaries, 2, "30 s of failures: {lines:?}");
        assert!(matches!(
            lines.iter().find(|l| **l != LogLine::Quiet),
            Some(LogLine::Summary { count: 35, .. })
        ));
        let timeout = LockError::Timeout {
            lock: "memory:test".to_owned(),
            operation: "get",
            after: Duration::from_secs(1),
        };
        assert_eq!(log.failed("get", &timeout), LogLine::Changed);
        assert_eq!(log.failed("get", &timeout), LogLine::Quiet);
        assert_eq!(
            log.succeeded(),
            LogLine::Recovered {
                count: 103,
                lasted: Duration::from_secs(30),
            }
        );
        assert_eq!(log.succeeded(), LogLine::Quiet);
    }
}
