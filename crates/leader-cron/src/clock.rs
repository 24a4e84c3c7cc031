//! The wall clock a job reads scheduled instants against: the system's, or tokio's in tests.

use std::fmt;

use chrono::{DateTime, Utc};

/// The wall clock the job reads scheduled instants against.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Now.
    fn now(&self) -> DateTime<Utc>;
}

/// The system's clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A wall clock that follows tokio's clock from `origin`: for tests on tokio's paused clock,
/// where sleeping a day takes no time.
#[derive(Clone, Debug)]
pub struct TokioClock {
    origin: DateTime<Utc>,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// A clock that reads `origin` now and advances with tokio's clock.
    pub fn starting_at(origin: DateTime<Utc>) -> Self {
        Self {
            origin,
            start: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> DateTime<Utc> {
        let elapsed = chrono::Duration::from_std(self.start.elapsed()).unwrap_or_default();
        self.origin + elapsed
    }
}
