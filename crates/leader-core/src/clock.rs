//! The wall clock whose times go into records.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use chrono::{DateTime, TimeDelta, Utc};

/// Where the elector and shard sets read the wall-clock times they write into records
/// (`acquire_time`, `renew_time`): the system clock, or one a test steps.
///
/// Wall-clock time never decides who leads (S1: leases are judged on the monotonic clock, or
/// on the store's clock in one statement); it only goes into what records show. An NTP step, a
/// VM restored from a snapshot or a resumed laptop moves it by an hour either way while a
/// term runs; every renewal still moves the fence (S14, see
/// [`LeaderElectionRecord::renewal_time`](crate::LeaderElectionRecord::renewal_time)).
#[derive(Clone, Default)]
pub struct WallClock {
    offset: Option<Arc<AtomicI64>>,
}

impl WallClock {
    /// The system clock (`Utc::now()`).
    pub fn system() -> Self {
        Self::default()
    }

    /// The system clock shifted by an offset that [`ClockStep`] moves: a wall clock that a
    /// test steps back or forward while a term runs.
    pub fn stepped() -> (Self, ClockStep) {
        let offset = Arc::new(AtomicI64::new(0));
        (
            Self {
                offset: Some(offset.clone()),
            },
            ClockStep { offset },
        )
    }

    /// The current wall-clock time.
    pub fn now(&self) -> DateTime<Utc> {
        let now = Utc::now();
        match &self.offset {
            Some(offset) => now + TimeDelta::microseconds(offset.load(Ordering::Relaxed)),
            None => now,
        }
    }
}

impl fmt::Debug for WallClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.offset {
            None => f.write_str("WallClock::system"),
            Some(offset) => write!(
                f,
                "WallClock::stepped({} µs)",
                offset.load(Ordering::Relaxed)
            ),
        }
    }
}

impl PartialEq for WallClock {
    fn eq(&self, other: &Self) -> bool {
        match (&self.offset, &other.offset) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// Steps the [`WallClock`] made with [`WallClock::stepped`].
#[derive(Clone, Debug)]
pub struct ClockStep {
    offset: Arc<AtomicI64>,
}

impl ClockStep {
    /// Moves the clock by `by` (negative: back), on top of earlier steps.
    pub fn step(&self, by: TimeDelta) {
        let micros = by.num_microseconds().unwrap_or(i64::MAX);
        self.offset.fetch_add(micros, Ordering::Relaxed);
    }

    /// Puts the clock back on the system's time.
    pub fn reset(&self) {
        self.offset.store(0, Ordering::Relaxed);
    }
}
