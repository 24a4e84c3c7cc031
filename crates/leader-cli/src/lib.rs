//! The `leader` command; see its README. The library holds the command for the workspace's
//! end-to-end tests, which build it as a binary of their own: it is not an API.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod ago;
mod args;
mod child;
#[cfg(feature = "cron")]
mod cron;
mod election;
mod exit;
mod inspect;
mod label;
mod open;
mod roster;
mod run;
mod serve;
mod set_status;
mod shards;

use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command, ShardsCommand};

/// Runs `leader` with the process's arguments and returns its exit code. Not an API: the
/// workspace's end-to-end tests build the command from it.
#[doc(hidden)]
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(child::SUPERVISE) {
        // `leader __supervise PID GRACE_MILLIS FEED_FD -- COMMAND...`, as
        // `child::Program::spawn` writes it.
        let parent = args
            .get(2)
            .and_then(|pid| pid.parse::<i32>().ok())
            .map(nix::unistd::Pid::from_raw);
        let grace = args.get(3).and_then(|millis| millis.parse::<u64>().ok());
        // FEED_FD: the descriptor of the socket shared with `leader`'s watchdog, or `-` for none.
        let feed = args.get(4).and_then(|fd| match fd.as_str() {
            "-" => Some(None),
            fd => fd.parse::<i32>().ok().map(Some),
        });
        let command = match (grace, feed, args.get(5).map(String::as_str)) {
            (Some(_), Some(_), Some("--")) => args.get(6..).unwrap_or_default().to_vec(),
            _ => Vec::new(),
        };
        let grace = std::time::Duration::from_millis(grace.unwrap_or_default());
        let feed = feed.flatten().and_then(child::inherited);
        return match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => {
                ExitCode::from(runtime.block_on(child::supervise(parent, grace, feed, &command)))
            }
            Err(_) => ExitCode::from(exit::FAILURE),
        };
    }
    // The command is the application: it picks rustls' crypto provider for the HTTP clients
    // that use the process's own (object storage's).
    let _ = rustls::crypto::ring::default_provider().install_default();
    #[cfg(feature = "cron")]
    if args.get(1).map(String::as_str) == Some("cron")
        && args
            .get(2)
            .is_some_and(|word| args::CRON_REQUEST_WORDS.contains(&word.as_str()))
    {
        let request = match args::CronRequestCli::try_parse_from(
            std::iter::once("leader cron".to_owned()).chain(args[2..].iter().cloned()),
        ) {
            Ok(cli) => cli.request,
            Err(err) => return usage(&err),
        };
        end_on_closed_pipe();
        return run_async(cron::request(request));
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return usage(&err),
    };
    if !supervises(&cli.command) {
        end_on_closed_pipe();
    }
    run_async(async {
        match cli.command {
            Command::Run(args) => run::run(args).await,
            #[cfg(feature = "cron")]
            Command::Cron(args) => cron::cron(args).await,
            Command::Status(args) => inspect::status(args).await,
            Command::Handover(args) => inspect::handover(args).await,
            Command::Shards(ShardsCommand::Resize(args)) => roster::resize(args).await,
            Command::Shards(ShardsCommand::Drain(args)) => roster::drain(args, true).await,
            Command::Shards(ShardsCommand::Undrain(args)) => roster::drain(args, false).await,
        }
    })
}

/// Whether `command` supervises COMMANDs (`run`, `cron`) rather than printing a report.
fn supervises(command: &Command) -> bool {
    match command {
        Command::Run(_) => true,
        #[cfg(feature = "cron")]
        Command::Cron(_) => true,
        _ => false,
    }
}

/// For the commands that print a report and end (`status`, `handover`, `shards`, a schedule's
/// requests): a reader that goes away (`leader status | head -1`) ends the command quietly, as
/// it ends `ls`, where a write to the closed pipe would panic. Not for `run` and `cron`, whose
/// COMMANDs must not lose their supervisor to a closed pipe.
#[allow(unsafe_code)]
fn end_on_closed_pipe() {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let default = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
    // SAFETY: restoring the default disposition installs no handler, so no handler can run
    // with broken assumptions; no thread has started yet.
    let _ = unsafe { sigaction(Signal::SIGPIPE, &default) };
}

/// Prints clap's answer (help, version or a usage error) and gives its exit code.
fn usage(err: &clap::Error) -> ExitCode {
    let _ = err.print();
    ExitCode::from(if err.use_stderr() {
        exit::USAGE
    } else {
        exit::OK
    })
}

/// Runs a subcommand on the command's runtime, with its logging, and gives its exit code.
fn run_async(subcommand: impl std::future::Future<Output = u8>) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(log_filter(std::env::var("RUST_LOG").ok().as_deref()))
        .with_writer(std::io::stderr)
        .with_target(false)
        // A closed standard error (a pipe whose reader died) must not end `leader` while its
        // COMMAND runs: the subscriber's own report of a failed write would panic.
        .log_internal_errors(false)
        .init();
    // One thread: COMMAND's parent-death signal is tied to the thread that spawned it.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("leader: cannot start the runtime: {err}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    ExitCode::from(runtime.block_on(subcommand))
}

/// Client libraries' own lines per failed attempt, off unless `RUST_LOG` names the library:
/// the elector already reports failures, and summarises an outage instead of a line per attempt
/// (S9). The Kubernetes client logs every failed request as an ERROR (target
/// `kube_client::client::builder`); the NATS client each connection event at INFO (target
/// `async_nats`: "event: client error: nats: IO error" per failed reconnection) and some
/// failed reconnections as an ERROR (target `async_nats::connector`: "expected INFO, got
/// nothing"); the NATS lock reports the server's refusals itself, typed. The ZooKeeper client
/// logs every session it opens at INFO and every failed attempt to reach a server as a WARN
/// (target `zookeeper_client`: "fails to establish session to ...").
const QUIET: [(&str, &str); 4] = [
    ("kube_client", "kube_client::client::builder=off"),
    ("async_nats", "async_nats=warn"),
    ("async_nats", "async_nats::connector=off"),
    ("zookeeper_client", "zookeeper_client=error"),
];

/// The log filter: `RUST_LOG`, or `info`, with [`QUIET`]'s targets off unless named.
fn log_filter(rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    let mut filter = rust_log
        .and_then(|value| tracing_subscriber::EnvFilter::try_new(value).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info"));
    for (library, off) in QUIET {
        if !rust_log.is_some_and(|value| value.contains(library))
            && let Ok(quiet) = off.parse()
        {
            filter = filter.add_directive(quiet);
        }
    }
    filter
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn client_libraries_own_errors_per_attempt_are_off_unless_asked_for() {
        for rust_log in [
            None,
            Some("info"),
            Some("debug,leader_core=trace"),
            Some("not a filter ["),
        ] {
            let filter = log_filter(rust_log).to_string();
            for off in [
                "kube_client::client::builder=off",
                "async_nats=warn",
                "async_nats::connector=off",
                "zookeeper_client=error",
            ] {
                assert!(filter.contains(off), "{rust_log:?}: {filter}");
            }
        }
        let asked = log_filter(Some("info,kube_client=debug")).to_string();
        assert!(
            !asked.contains("kube_client::client::builder=off"),
            "{asked}"
        );
        assert!(asked.contains("async_nats::connector=off"), "{asked}");
        let asked = log_filter(Some("info,async_nats=debug")).to_string();
        assert!(!asked.contains("async_nats::connector=off"), "{asked}");
    }
}
