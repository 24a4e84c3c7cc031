//! The fault harness: replicas of the `leader` command against a backend, faults injected into
//! the leader, and a checker over every leadership interval and every fenced write.

pub mod campaign;
pub mod checker;
pub mod firings;
pub mod outage;
pub mod report;
pub mod servers;
pub mod shards;

pub use leader_test_support::proxy;

use std::path::PathBuf;

/// The programs the harness runs: built in this crate, so a test or benchmark names them with
/// [`programs!`](crate::programs).
#[derive(Clone, Debug)]
pub struct Programs {
    /// A binary that runs `leader_cli::main`.
    pub leader: PathBuf,
    /// The `fenced-writer` binary: the replicas' COMMAND.
    pub writer: PathBuf,
    /// The `kube-api-server` binary: the Kubernetes backend's server.
    pub kube_api_server: PathBuf,
    /// The `consul-api-server` binary: the Consul backend's server.
    pub consul_api_server: PathBuf,
    /// The `kubert-claimant` binary: another project's Lease client, for mixed fleets.
    pub kubert_claimant: PathBuf,
}

/// The [`Programs`](crate::harness::Programs) of this crate, for a test or benchmark of it
/// (Cargo tells their paths to those only).
#[macro_export]
macro_rules! programs {
    () => {
        $crate::harness::Programs {
            leader: ::std::path::PathBuf::from(env!("CARGO_BIN_EXE_leader-e2e")),
            writer: ::std::path::PathBuf::from(env!("CARGO_BIN_EXE_fenced-writer")),
            kube_api_server: ::std::path::PathBuf::from(env!("CARGO_BIN_EXE_kube-api-e2e")),
            consul_api_server: ::std::path::PathBuf::from(env!("CARGO_BIN_EXE_consul-api-e2e")),
            kubert_claimant: ::std::path::PathBuf::from(env!("CARGO_BIN_EXE_kubert-claimant")),
        }
    };
}

/// A `#[test]` per backend of the harness, each calling `run` with its [`Backend`] variant
/// (`campaign::Backend`). Attributes (doc comments) written before a test's name are kept on it.
///
/// [`Backend`]: crate::harness::campaign::Backend
#[macro_export]
macro_rules! on_each_harness_backend {
    ($run:ident: $($(#[$attr:meta])* $test:ident => $backend:ident,)+) => {
        $(
            $(#[$attr])*
            #[test]
            fn $test() {
                $run($crate::harness::campaign::Backend::$backend);
            }
        )+
    };
}

/// At every hundredth of `total` faults, a line saying how far a long run has come.
pub(crate) fn say_progress(what: impl std::fmt::Display, done: usize, total: usize) {
    if done.is_multiple_of(100) {
        eprintln!("{what}: {done} of {total} faults");
    }
}

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
