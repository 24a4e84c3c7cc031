//! A nightly job on one of several replicas: each firing of the schedule runs once, on
//! whichever replica leads, under a fencing token. Run two or three at once:
//!
//! ```sh
//! LEADER_LOCK=postgres://app@db/app cargo run -p leader --features postgres,cron --example nightly_job
//! ```
//!
//! `SCHEDULE` (default `0 3 * * *`, in Europe/Berlin) takes any cron expression, such as
//! `*/5 * * * * *` (six fields: seconds first) to watch it fire. SIGTERM or Ctrl-C stops it and
//! releases the lease at once.

use leader::CancellationToken;
use leader::cron::{BoxError, CronJob, Firing, Schedule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Log what the election does, refused writes and outages included (RUST_LOG, default info).
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let cron = std::env::var("SCHEDULE").unwrap_or_else(|_| "0 3 * * *".into());
    let schedule = Schedule::cron(&cron, "Europe/Berlin")?;
    let job = CronJob::builder("nightly-report", schedule).build(report)?;
    let url = std::env::var("LEADER_LOCK")?; // postgres://app@db/app, redis://..., etcd://...
    let lock = leader::open(&url, "nightly-report", &leader::default_identity()).await?;
    job.run_elected(lock, leader::shutdown_on_signals()).await?;
    Ok(())
}

/// The job: `cancel` fires when the term ends (stop there); an error is the firing's outcome.
async fn report(firing: Firing, _cancel: CancellationToken) -> Result<(), BoxError> {
    // The report itself goes here, passing the fencing token with its writes.
    let token = firing.fencing_token;
    println!("report for {} (fencing token {token})", firing.scheduled);
    Ok(())
}
