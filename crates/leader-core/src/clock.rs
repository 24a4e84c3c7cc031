//! Wall-clock time, one abstraction for the whole toolkit: [`Clock`] is a source of it (the
//! system's, tokio's in tests, an application's own), and [`WallClock`] the handle that the
//! elector, shard sets and schedules read, which a test can also step.

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
    /// Where the time comes from: the system's clock when `None`.
    source: Option<Arc<dyn Clock>>,
    offset: Option<Arc<AtomicI64>>,
}

/// A source of wall-clock time: the system's ([`SystemClock`]), tokio's in tests
/// ([`TokioClock`]), or an application's own. [`WallClock::from_clock`] makes one the clock of
/// an elector or a shard set; a schedule takes one directly.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Now.
    fn now(&self) -> DateTime<Utc>;
}

/// The system's clock (`Utc::now()`).
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
        let elapsed = TimeDelta::from_std(self.start.elapsed()).unwrap_or_default();
        self.origin + elapsed
    }
}

impl Clock for WallClock {
    fn now(&self) -> DateTime<Utc> {
        WallClock::now(self)
    }
}

impl WallClock {
    /// The system clock (`Utc::now()`).
    pub fn system() -> Self {
        Self::default()
    }

    /// The time of `clock` ([`TokioClock`] in tests, an application's own source).
    pub fn from_clock(clock: impl Clock) -> Self {
        Self {
            source: Some(Arc::new(clock)),
            offset: None,
        }
    }

    /// The system clock shifted by an offset that [`ClockStep`] moves: a wall clock that a
    /// test steps back or forward while a term runs.
    pub fn stepped() -> (Self, ClockStep) {
        let offset = Arc::new(AtomicI64::new(0));
        (
            Self {
                source: None,
                offset: Some(offset.clone()),
            },
            ClockStep { offset },
        )
    }

    /// The current wall-clock time.
    pub fn now(&self) -> DateTime<Utc> {
        let now = self
            .source
            .as_ref()
            .map_or_else(Utc::now, |source| source.now());
        match &self.offset {
            Some(offset) => now + TimeDelta::microseconds(offset.load(Ordering::Relaxed)),
            None => now,
        }
    }
}

impl fmt::Debug for WallClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.source, &self.offset) {
            (Some(source), _) => write!(f, "WallClock::from_clock({source:?})"),
            (None, None) => f.write_str("WallClock::system"),
            (None, Some(offset)) => write!(
                f,
                "WallClock::stepped({} µs)",
                offset.load(Ordering::Relaxed)
            ),
        }
    }
}

impl PartialEq for WallClock {
    fn eq(&self, other: &Self) -> bool {
        let same_source = match (&self.source, &other.source) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        let same_offset = match (&self.offset, &other.offset) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        same_source && same_offset
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A wall clock made from a source reads that source: here tokio's paused clock, on which
    /// an hour passes at once, as a schedule's tests and an elector's records both see it.
    #[tokio::test(start_paused = true)]
    async fn a_wall_clock_from_a_source_reads_it() {
        let origin = DateTime::parse_from_rfc3339("2026-01-10T03:00:00Z")
            .expect("an instant")
            .with_timezone(&Utc);
        let clock = WallClock::from_clock(TokioClock::starting_at(origin));
        assert_eq!(clock.now(), origin);
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert_eq!(Clock::now(&clock), origin + TimeDelta::hours(1));
        assert_eq!(clock, clock.clone(), "a clone reads the same source");
        assert_ne!(clock, WallClock::system());
        assert!(format!("{clock:?}").contains("TokioClock"), "{clock:?}");
    }
}
