//! The steps every backend's renewal benchmark takes around its own server counters and raw
//! references: a real elector leading on the lock, the lease taken again by the benchmark,
//! renewals in a row, and latency samples of any operation.

use std::time::Duration;

use leader_core::{LockError, Observed, ResourceLock};

use crate::bench;
pub use crate::bench::time_each;

/// An elector's timings for a benchmark.
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    /// How long a lease lasts.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it steps down.
    pub renew_deadline: Duration,
    /// How often the elector tries.
    pub retry_period: Duration,
}

/// A 600 ms lease tried every 20 ms: many renewals in the 3 s an elector leads.
pub const SHORT: Timings = Timings {
    lease_duration: Duration::from_millis(600),
    renew_deadline: Duration::from_millis(400),
    retry_period: Duration::from_millis(20),
};

/// What a real elector did in the 3 s it led.
#[derive(Debug, Clone, Copy)]
pub struct ElectorRequests {
    /// Its successful renewals.
    pub renewals: usize,
    /// The lock requests it made per renewal.
    pub per_renewal: f64,
}

impl ElectorRequests {
    /// Prints the line that reports them.
    pub fn print(&self) {
        println!(
            "requests per renewal (elector, {} renewals in 3 s): {:.2}",
            self.renewals, self.per_renewal
        );
    }
}

/// Runs a real elector with `timings` on `lock` (through a counting wrapper), lets it lead for
/// 3 s, and says what it did; it releases the lease when it stops.
pub async fn elected(
    lock: impl ResourceLock + 'static,
    timings: Timings,
) -> Result<ElectorRequests, Box<dyn std::error::Error>> {
    let (renewals, per_renewal) = bench::elector_requests_per_renewal(
        lock,
        timings.lease_duration,
        timings.renew_deadline,
        timings.retry_period,
        Duration::from_secs(3),
    )
    .await?;
    Ok(ElectorRequests {
        renewals,
        per_renewal,
    })
}

/// [`elected`] with [`SHORT`] timings on the lock `open` gives, then the lease taken again by
/// "bench" on another lock `open` gives, so that what follows are renewals by the holder: what
/// the elector did, the benchmark's lock and what it holds.
pub async fn elected_then_held<L: ResourceLock + 'static>(
    open: impl Fn() -> L,
) -> Result<(ElectorRequests, L, Observed), Box<dyn std::error::Error>> {
    let elector = elected(open(), SHORT).await?;
    let lock = open();
    let observed = bench::acquire(&lock, "bench").await?;
    assert!(observed.record.is_held_by("bench"));
    Ok((elector, lock, observed))
}

/// Writes `observed` again through `lock` with `update`, as its holder, `count` times in a row;
/// how long each took.
///
/// # Errors
/// A write failed.
pub async fn updates(
    lock: &dyn ResourceLock,
    observed: &mut Observed,
    count: usize,
) -> Result<Vec<Duration>, LockError> {
    let mut took = Vec::with_capacity(count);
    bench::time_each(count, &mut took, async || {
        *observed = lock
            .update(&observed.version, &bench::renewed(&observed.record))
            .await?;
        Ok::<_, LockError>(())
    })
    .await?;
    Ok(took)
}

/// A record of `holder` with a 10 s lease, which no benchmark round outlasts.
pub fn lasting(holder: &str) -> leader_core::LeaderElectionRecord {
    let mut record = leader_core::conformance::record(holder, 0);
    record.lease_duration = Duration::from_secs(10);
    record
}
