//! Exponential back-off, for lock implementers and features built on the elector: the waits
//! the elector itself keeps between failed attempts (S9), with the base, the cap, the jitter and
//! whether the first retry waits as parameters.
//!
//! A [`Backoff`] counts consecutive failures and says how long to wait before the next attempt:
//! the base after the first failure, doubling with each one that follows, up to the cap, varied
//! at random as its [`Jitter`] says. It does no I/O and never sleeps itself, so it works with
//! any timer, tokio's paused clock included; a count kept elsewhere (an attempt number in a
//! record) gets its wait from [`Backoff::wait_after`].
//!
//! ```
//! use std::time::Duration;
//! use leader_core::backend::{Backoff, Jitter};
//!
//! let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(4));
//! let waits: Vec<u64> = (0..4).map(|_| backoff.failed().as_secs()).collect();
//! assert_eq!(waits, [1, 2, 4, 4]);
//! backoff.succeeded();
//! assert_eq!(backoff.failed(), Duration::from_secs(1));
//!
//! // A fifth longer at most, so that replicas that failed together do not retry together.
//! let jittered = Backoff::new(Duration::from_secs(1), Duration::from_secs(4))
//!     .jitter(Jitter::Longer(0.2));
//! let wait = jittered.wait_after(3);
//! assert!(wait >= Duration::from_secs(4) && wait <= Duration::from_millis(4800));
//! ```

use std::time::Duration;

/// How a [`Backoff`] varies its waits at random, so that replicas that failed together do not
/// retry together. A factor that is negative or NaN counts as 0.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum Jitter {
    /// Exact waits.
    None,
    /// Each wait lengthened by up to this fraction of itself: `wait * (1 + random(0..f))`.
    Longer(f64),
    /// The elector's: the base lengthened as by [`Longer`](Self::Longer) (client-go's jitter on
    /// the retry period), and a longer back-off shortened by up to `min(f, 1) / 2` of itself,
    /// never below that lengthened base. Waits spread without ever passing the cap (or the
    /// lengthened base), which bounds how late a retry comes once a store is back.
    Spread(f64),
}

/// Exponential back-off: how long to wait after consecutive failures.
///
/// After `n` failures the wait is `min(cap, base * 2^(n - 1))`, jittered; with no failure it is
/// the base, jittered (the pace of attempts that succeed). With
/// [`first_retry_at_once`](Self::first_retry_at_once) the first retry does not wait and the
/// doubling starts one failure later. The cap is raised to the base if shorter: a failure never
/// shortens the wait. Counts and waits saturate instead of overflowing.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    jitter: Jitter,
    first_retry_at_once: bool,
    failures: u32,
}

impl Backoff {
    /// Waits of `base` after a first failure, doubling up to `cap`, exact until
    /// [`jitter`](Self::jitter) says otherwise.
    #[must_use]
    pub const fn new(base: Duration, cap: Duration) -> Self {
        let cap = if cap.as_nanos() < base.as_nanos() {
            base
        } else {
            cap
        };
        Self {
            base,
            cap,
            jitter: Jitter::None,
            first_retry_at_once: false,
            failures: 0,
        }
    }

    /// Varies the waits at random (default [`Jitter::None`]).
    #[must_use]
    pub const fn jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The first retry after a failure does not wait; the next waits the base, then doubling.
    #[must_use]
    pub const fn first_retry_at_once(mut self) -> Self {
        self.first_retry_at_once = true;
        self
    }

    /// Notes a failure and returns the wait before the next attempt (as [`wait`](Self::wait)).
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.wait()
    }

    /// Notes a success: the next failure is a first one again.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// Consecutive failures so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Whether the last attempt failed.
    pub fn is_failing(&self) -> bool {
        self.failures > 0
    }

    /// How long to wait before the next attempt, after the failures noted so far.
    pub fn wait(&self) -> Duration {
        self.wait_after(self.failures)
    }

    /// How long to wait before the next attempt after `failures` consecutive failures, for a
    /// count kept elsewhere; with none, the base (jittered).
    pub fn wait_after(&self, failures: u32) -> Duration {
        let doublings = match failures {
            0 => 0,
            1 if self.first_retry_at_once => return Duration::ZERO,
            n => n - 1 - u32::from(self.first_retry_at_once),
        };
        let ceiling = doubled(self.base, doublings, self.cap);
        match self.jitter {
            Jitter::None => ceiling,
            Jitter::Longer(factor) => scaled(ceiling, 1.0 + fastrand::f64() * sane(factor)),
            Jitter::Spread(factor) => {
                let floor = scaled(self.base, 1.0 + fastrand::f64() * sane(factor));
                let spread = fastrand::f64() * sane(factor).min(1.0) / 2.0;
                floor.max(scaled(ceiling, 1.0 - spread))
            }
        }
    }

    /// The longest any wait can be: how late a retry may come after the failures end.
    pub fn longest_wait(&self) -> Duration {
        match self.jitter {
            Jitter::None => self.cap,
            Jitter::Longer(factor) => scaled(self.cap, 1.0 + sane(factor)),
            Jitter::Spread(factor) => self.cap.max(scaled(self.base, 1.0 + sane(factor))),
        }
    }
}

/// `base * 2^doublings`, or `cap` if that is as long or longer.
fn doubled(base: Duration, doublings: u32, cap: Duration) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let nanos = base.as_nanos();
    if nanos == 0 {
        return Duration::ZERO;
    }
    // A shift past the leading zeros would drop bits: the product is longer than any Duration.
    if nanos.leading_zeros() <= doublings {
        return cap;
    }
    let grown = nanos << doublings;
    if grown >= cap.as_nanos() {
        return cap;
    }
    // Shorter than `cap`, so it fits.
    Duration::new(
        u64::try_from(grown / NANOS_PER_SEC).unwrap_or(u64::MAX),
        u32::try_from(grown % NANOS_PER_SEC).unwrap_or(0),
    )
}

/// `wait * factor`, saturating at [`Duration::MAX`].
fn scaled(wait: Duration, factor: f64) -> Duration {
    Duration::try_from_secs_f64(factor * wait.as_secs_f64()).unwrap_or(Duration::MAX)
}

/// A jitter factor that keeps waits finite and never negative.
fn sane(factor: f64) -> f64 {
    if factor.is_nan() {
        0.0
    } else {
        factor.clamp(0.0, f64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRY: Duration = Duration::from_secs(2);
    const CAP: Duration = Duration::from_secs(15);

    fn secs(backoff: &mut Backoff, failures: usize) -> Vec<u64> {
        (0..failures).map(|_| backoff.failed().as_secs()).collect()
    }

    #[test]
    fn waits_double_after_each_failure_up_to_the_cap_and_reset_on_success() {
        let mut backoff = Backoff::new(RETRY, CAP);
        assert_eq!(backoff.wait(), RETRY);
        assert!(!backoff.is_failing());
        assert_eq!(secs(&mut backoff, 6), [2, 4, 8, 15, 15, 15]);
        assert_eq!(backoff.failures(), 6);
        assert!(backoff.is_failing());
        backoff.succeeded();
        assert_eq!(backoff.failures(), 0);
        assert_eq!(backoff.wait(), RETRY);
        assert_eq!(secs(&mut backoff, 2), [2, 4]);
    }

    #[test]
    fn a_count_kept_elsewhere_gets_the_same_waits() {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        for failures in 1..40 {
            let wait = backoff.failed();
            assert_eq!(backoff.wait_after(failures), wait);
        }
        assert_eq!(backoff.wait_after(0), Duration::from_millis(50));
    }

    #[test]
    fn the_first_retry_at_once_shifts_the_doubling_by_one() {
        let mut backoff =
            Backoff::new(Duration::from_millis(50), Duration::from_secs(1)).first_retry_at_once();
        let waits: Vec<u128> = (0..8).map(|_| backoff.failed().as_millis()).collect();
        assert_eq!(waits, [0, 50, 100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn a_cap_below_the_base_never_shortens_the_wait() {
        let mut backoff = Backoff::new(RETRY, Duration::from_millis(10));
        for _ in 0..40 {
            assert_eq!(backoff.failed(), RETRY);
        }
        assert_eq!(backoff.longest_wait(), RETRY);
    }

    #[test]
    fn a_zero_base_never_waits() {
        let mut backoff = Backoff::new(Duration::ZERO, CAP).jitter(Jitter::Longer(0.2));
        for _ in 0..200 {
            assert_eq!(backoff.failed(), Duration::ZERO);
        }
    }

    #[test]
    fn many_failures_neither_overflow_nor_pass_the_cap() {
        for cap in [CAP, Duration::MAX] {
            for jitter in [Jitter::None, Jitter::Longer(0.2), Jitter::Spread(1.2)] {
                let backoff = Backoff::new(Duration::from_nanos(1), cap).jitter(jitter);
                for failures in [31, 32, 63, 64, 65, 127, 128, 129, 1000, u32::MAX] {
                    let wait = backoff.wait_after(failures);
                    assert!(wait <= backoff.longest_wait(), "{jitter:?} {failures}");
                }
                assert!(backoff.wait_after(u32::MAX) >= cap.mul_f64(0.5));
            }
        }
        // A tiny base keeps doubling exactly until the cap, however many doublings that takes.
        let tiny = Backoff::new(Duration::from_nanos(1), Duration::from_secs(3600));
        assert_eq!(tiny.wait_after(33), Duration::from_nanos(1 << 32));
        assert_eq!(tiny.wait_after(42), Duration::from_nanos(1 << 41));
        assert_eq!(tiny.wait_after(43), Duration::from_secs(3600));
        let mut counted = Backoff::new(RETRY, CAP);
        counted.failures = u32::MAX;
        assert_eq!(counted.failed(), CAP);
        assert_eq!(counted.failures(), u32::MAX);
    }

    #[test]
    fn longer_jitter_adds_up_to_its_fraction() {
        let mut backoff = Backoff::new(RETRY, RETRY * 8).jitter(Jitter::Longer(0.2));
        for failures in 1..200u32 {
            let wait = backoff.failed();
            let exact = RETRY * 2u32.pow(failures.min(4) - 1);
            assert!(
                wait >= exact && wait <= exact.mul_f64(1.2),
                "{failures}: {wait:?}"
            );
        }
        assert_eq!(backoff.longest_wait(), (RETRY * 8).mul_f64(1.2));
    }

    #[test]
    fn spread_waits_stay_between_the_retry_period_and_the_longest_wait() {
        let mut backoff = Backoff::new(RETRY, CAP).jitter(Jitter::Spread(1.2));
        assert_eq!(backoff.longest_wait(), CAP);
        let first = backoff.wait();
        assert!(first >= RETRY && first <= RETRY.mul_f64(2.2), "{first:?}");
        for _ in 0..200 {
            let wait = backoff.failed();
            assert!(wait >= RETRY && wait <= backoff.longest_wait(), "{wait:?}");
            if backoff.failures() > 10 {
                assert!(wait >= CAP / 2, "{wait:?}");
            }
        }
    }

    #[test]
    fn jitter_spreads_the_waits() {
        let backoff = Backoff::new(RETRY, CAP).jitter(Jitter::Longer(0.2));
        let waits: std::collections::HashSet<Duration> =
            (0..50).map(|_| backoff.wait_after(2)).collect();
        assert!(waits.len() > 1, "{waits:?}");
    }

    #[test]
    fn a_factor_that_is_negative_or_nan_counts_as_none() {
        for factor in [-1.0, f64::NAN] {
            for jitter in [Jitter::Longer(factor), Jitter::Spread(factor)] {
                let backoff = Backoff::new(RETRY, CAP).jitter(jitter);
                assert_eq!(backoff.wait_after(3), RETRY * 4, "{jitter:?}");
                assert_eq!(backoff.longest_wait(), CAP, "{jitter:?}");
            }
        }
        let huge = Backoff::new(RETRY, CAP).jitter(Jitter::Longer(f64::INFINITY));
        assert!(huge.wait_after(1) >= RETRY);
        assert_eq!(huge.longest_wait(), Duration::MAX);
    }
}
