//! The fault harness: replicas of the `leader` command against a backend, faults injected into
//! the leader, and a checker over every leadership interval and every fenced write.

pub mod campaign;
pub mod checker;
pub mod outage;
pub mod proxy;
pub mod servers;

/// Runs a harness run (a campaign, an outage) on a runtime of its own with two workers. When it
/// cannot be set up (a server binary missing, say) it is skipped with a line saying why, except
/// under CI, where that is a failure.
///
/// # Panics
/// Under `CI=true`, when the run cannot be set up.
pub fn run_or_skip<T, E: std::fmt::Display>(
    what: &str,
    run: impl std::future::Future<Output = Result<T, E>>,
) -> Option<T> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match runtime.block_on(run) {
        Ok(report) => Some(report),
        Err(err) if !leader_test_support::in_ci() => {
            eprintln!("skipping {what}: {err}");
            None
        }
        Err(err) => panic!("CI=true and {what} cannot run: {err}"),
    }
}
