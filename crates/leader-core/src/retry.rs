//! S9: how an outage is logged (how long a candidate waits after a failed attempt is
//! [`Backoff`](crate::backoff::Backoff)'s).
//!
//! A small state machine without I/O, so the rule is tested on its own; the runner feeds it
//! outcomes and acts on what it says.

use std::time::Duration;

use tokio::time::Instant;

use crate::error::LockError;

/// How often a lasting outage is summarised in the log.
pub(crate) const SUMMARY_EVERY: Duration = Duration::from_secs(10);

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

    fn outage() -> LockError {
        LockError::unavailable("test", "down")
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
