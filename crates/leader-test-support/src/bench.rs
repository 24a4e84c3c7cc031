//! What the backends' benchmarks share around their own server counters and raw references: a
//! real elector leading on the lock and what it asked of it, the lease taken again by the
//! benchmark, writes in a row, latency samples of any operation and their tables.

use std::fmt;
use std::time::{Duration, Instant};

use chrono::Utc;

use leader_core::background::Candidate;
use leader_core::faults::FaultyLock;
use leader_core::{
    Acquisition, LeaderElectionRecord, LeaderElector, LockError, Observed, ResourceLock,
};

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

/// How long [`elected`] lets its elector lead.
const LEADING: Duration = Duration::from_secs(3);

/// What a real elector did in the 3 s it led.
#[derive(Debug, Clone, Copy)]
pub struct ElectorRequests {
    /// Its successful renewals.
    pub renewals: usize,
    /// The lock requests it made per renewal.
    pub per_renewal: f64,
}

impl fmt::Display for ElectorRequests {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "requests per renewal (elector, {} renewals in {:?}): {:.2}",
            self.renewals, LEADING, self.per_renewal
        )
    }
}

impl ElectorRequests {
    /// Prints the line that reports them.
    pub fn print(&self) {
        println!("{self}");
    }
}

/// Runs a real elector with `timings` on `lock` (through a counting wrapper), lets it lead for
/// 3 s, and says what it did; it releases the lease when it stops.
///
/// # Errors
/// The elector's configuration or its run failed.
pub async fn elected(
    lock: impl ResourceLock + 'static,
    timings: Timings,
) -> Result<ElectorRequests, Box<dyn std::error::Error>> {
    let counted = FaultyLock::new(lock);
    let calls = counted.faults();
    let mut candidate = Candidate::run(
        LeaderElector::builder(counted)
            .lease_duration(timings.lease_duration)
            .renew_deadline(timings.renew_deadline)
            .retry_period(timings.retry_period)
            .build()?,
    );
    candidate.state.wait_for(|s| s.is_leading()).await?;
    let before = calls.calls().len();
    tokio::time::sleep(LEADING).await;
    let in_window: Vec<_> = calls.calls()[before..].to_vec();
    candidate.shutdown.cancel();
    candidate.task.await??;
    let renewals = in_window
        .iter()
        .filter(|c| c.operation == "renew" && c.ok == Some(true))
        .count();
    Ok(ElectorRequests {
        renewals,
        per_renewal: in_window.len() as f64 / renewals.max(1) as f64,
    })
}

/// [`elected`] with `timings` on `elector`, then the lease taken again by "bench" on `lock`
/// (of the same election), so that what follows are renewals by the holder: what the elector
/// did and what `lock` holds.
///
/// # Errors
/// The elector failed, or the lease could not be taken again.
pub async fn elected_then_held(
    elector: impl ResourceLock + 'static,
    timings: Timings,
    lock: &dyn ResourceLock,
) -> Result<(ElectorRequests, Observed), Box<dyn std::error::Error>> {
    let elector = elected(elector, timings).await?;
    let observed = acquire(lock, "bench").await?;
    assert!(observed.record.is_held_by("bench"));
    Ok((elector, observed))
}

/// Takes the lease as `identity` (after an elector released it), so that what follows are
/// renewals by the holder.
pub async fn acquire(
    lock: &dyn ResourceLock,
    identity: &str,
) -> Result<Observed, Box<dyn std::error::Error>> {
    let desired = renewed(&leader_core::conformance::record(identity, 0));
    match lock.try_acquire(&desired).await? {
        Some(Acquisition::Acquired(observed)) => Ok(observed),
        other => Err(format!("could not take the lease again: {other:?}").into()),
    }
}

/// How a holder writes its record again in [`rewrites`].
#[derive(Clone, Copy, Debug)]
pub enum Rewrite {
    /// [`ResourceLock::renew`], as a term renews.
    Renew,
    /// [`ResourceLock::update`], a full write.
    Update,
}

/// Writes `observed` again through `lock`, as its holder, `how`, `count` times in a row; how
/// long each took.
///
/// # Errors
/// A write failed.
pub async fn rewrites(
    lock: &dyn ResourceLock,
    observed: &mut Observed,
    count: usize,
    how: Rewrite,
) -> Result<Vec<Duration>, LockError> {
    let mut took = Vec::with_capacity(count);
    time_each(count, &mut took, async || {
        let record = renewed(&observed.record);
        *observed = match how {
            Rewrite::Renew => lock.renew(&observed.version, &record).await?,
            Rewrite::Update => lock.update(&observed.version, &record).await?,
        };
        Ok::<_, LockError>(())
    })
    .await?;
    Ok(took)
}

/// Runs `operation` `count` times in a row, adding how long each took to `samples`.
///
/// # Errors
/// The first error of `operation`.
pub async fn time_each<T, E>(
    count: usize,
    samples: &mut Vec<Duration>,
    mut operation: impl AsyncFnMut() -> Result<T, E>,
) -> Result<(), E> {
    for _ in 0..count {
        let at = Instant::now();
        operation().await?;
        samples.push(at.elapsed());
    }
    Ok(())
}

/// A number from the environment variable `name`, else `default`; a value that is no such
/// number stops the bench (a typo must not measure the default under another name).
///
/// # Panics
/// The variable is set to something that does not parse.
pub fn knob<T: std::str::FromStr>(name: &str, default: T) -> T {
    knob_if_set(name).unwrap_or(default)
}

/// A number from the environment variable `name`, `None` when it is unset or empty; a value
/// that is no such number stops the run, as with [`knob`].
///
/// # Panics
/// The variable is set to something that does not parse.
pub fn knob_if_set<T: std::str::FromStr>(name: &str) -> Option<T> {
    match std::env::var(name) {
        Ok(value) if !value.is_empty() => Some(
            value
                .parse()
                .unwrap_or_else(|_| panic!("{name}={value:?} is not a number this run takes")),
        ),
        _ => None,
    }
}

/// `record` with its renew time set to now, as a renewal writes it.
pub fn renewed(record: &LeaderElectionRecord) -> LeaderElectionRecord {
    let mut record = record.clone();
    record.renew_time = Utc::now();
    record
}

/// A record of `holder` with a 10 s lease, which no benchmark round outlasts.
pub fn lasting(holder: &str) -> LeaderElectionRecord {
    let mut record = leader_core::conformance::record(holder, 0);
    record.lease_duration = Duration::from_secs(10);
    record
}

/// The `percent`th percentile of sorted samples (zero for none).
pub fn percentile(sorted: &[Duration], percent: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[(sorted.len() * percent / 100).min(sorted.len() - 1)]
}

/// Prints a Markdown table of latencies: mean, p50, p99 and both ratios to the row at
/// `reference`, whose label names the column.
pub fn print_latencies(heading: &str, reference: usize, rows: &mut [(&str, Vec<Duration>)]) {
    for (_, samples) in rows.iter_mut() {
        samples.sort();
    }
    let mean = |s: &[Duration]| {
        s.iter().sum::<Duration>() / u32::try_from(s.len()).unwrap_or(u32::MAX).max(1)
    };
    let at = percentile;
    let us = |d: Duration| format!("{:.0} µs", d.as_secs_f64() * 1e6);
    let (name, base) = (rows[reference].0, &rows[reference].1);
    let (base_mean, base_p50) = (mean(base), at(base, 50));
    println!("| {heading} | mean | p50 | p99 | mean vs {name} | p50 vs {name} |");
    println!("|---|---|---|---|---|---|");
    for (label, samples) in rows.iter() {
        let (m, p50) = (mean(samples), at(samples, 50));
        println!(
            "| {label} | {} | {} | {} | {:.2}x | {:.2}x |",
            us(m),
            us(p50),
            us(at(samples, 99)),
            m.as_secs_f64() / base_mean.as_secs_f64(),
            p50.as_secs_f64() / base_p50.as_secs_f64()
        );
    }
}

/// gRPC messages an etcd member has received so far, from the `/metrics` page on its client
/// `endpoint` (`http://host:port`): the server's own count of requests.
pub fn etcd_messages_received(endpoint: &str) -> std::io::Result<u64> {
    use std::io::{Read, Write};
    let authority = endpoint.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = std::net::TcpStream::connect(authority)?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {authority}\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    Ok(body
        .lines()
        .filter(|line| line.starts_with("grpc_server_msg_received_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

/// The first endpoint in `ETCD_ENDPOINTS` (default `http://127.0.0.1:2379`).
pub fn etcd_endpoint() -> String {
    std::env::var("ETCD_ENDPOINTS")
        .unwrap_or_else(|_| "http://127.0.0.1:2379".into())
        .split(',')
        .next()
        .unwrap_or_default()
        .to_owned()
}
