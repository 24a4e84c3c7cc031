#![doc = include_str!("../README.md")]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod child;
mod serve;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use leader_core::{
    CancellationToken, FileLock, LeaderElector, LockError, ResourceLock, StepDownReason,
};

use crate::child::Program;
use leader::LockUrl;

/// The exit codes of `leader`, besides COMMAND's own.
pub mod exit {
    /// Success: shut down by SIGTERM or SIGINT, COMMAND stopped and the lease released.
    pub const OK: u8 = 0;
    /// An unexpected failure.
    pub const FAILURE: u8 = 1;
    /// Invalid flags or values (clap's code).
    pub const USAGE: u8 = 2;
    /// `--lock` is not usable as given: unknown scheme, malformed URL, backend not in this build,
    /// storage that does not exist (a missing database, table or directory), credentials the
    /// server does not take.
    pub const BAD_LOCK: u8 = 3;
    /// The backend could not be reached at start: connection refused, or no answer within the
    /// request timeout.
    pub const UNREACHABLE: u8 = 4;
    /// The backend refused: wrong credentials, missing permissions, an unreadable record.
    pub const REFUSED: u8 = 5;
    /// `handover`: nobody has run for this election yet, so there is nothing to hand over.
    pub const NO_ELECTION: u8 = 6;
    /// `handover --wait`: the named identity did not lead within `--timeout`.
    pub const NOT_HANDED_OVER: u8 = 7;
    /// `--once`: leadership was lost before COMMAND finished.
    pub const LOST: u8 = 75;
    /// COMMAND could not be executed.
    pub const NOT_EXECUTABLE: u8 = 126;
    /// COMMAND was not found.
    pub const NOT_FOUND: u8 = 127;
}

/// COMMAND's default time between SIGTERM and SIGKILL.
const DEFAULT_GRACE: Duration = Duration::from_secs(3);

/// Run a program only while this replica holds leadership, or inspect a lock.
#[derive(Debug, Parser)]
#[command(name = "leader", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Wait to be elected, run COMMAND while leading, stop it when leadership ends.
    Run(RunArgs),
    /// Show the lock's holder, times and transitions, without taking part in the election.
    Status(StatusArgs),
    /// Ask the leader to hand over to a named replica (a planned handover), without taking
    /// part in the election.
    Handover(HandoverArgs),
}

#[derive(Debug, Args)]
struct LockArgs {
    /// The lock: file:///PATH, postgres://... (?advisory=true for the advisory lock),
    /// redis://... or rediss://..., etcd://HOST:PORT[,HOST:PORT] or etcds://..., or
    /// kubernetes://NAMESPACE (?binary_version=V for coordinated leader election). Default: a
    /// lock file in the runtime or temp directory.
    #[arg(long, env = "LEADER_LOCK", value_name = "URL")]
    lock: Option<String>,
    /// The election's name: replicas with the same lock and name elect one leader.
    #[arg(long, env = "LEADER_NAME")]
    name: String,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    lock: LockArgs,
    /// This candidate's identity, unique among the replicas. Default: HOSTNAME-PID.
    #[arg(long, env = "LEADER_IDENTITY")]
    identity: Option<String>,
    /// How long followers wait after the leader's last renewal before taking over.
    #[arg(long, env = "LEADER_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    lease_duration: Duration,
    /// How long the leader keeps leading without a successful renewal.
    #[arg(long, env = "LEADER_RENEW_DEADLINE", default_value = "10s", value_parser = humantime::parse_duration)]
    renew_deadline: Duration,
    /// Time between renewals and between attempts to acquire.
    #[arg(long, env = "LEADER_RETRY_PERIOD", default_value = "2s", value_parser = humantime::parse_duration)]
    retry_period: Duration,
    /// Time COMMAND gets between SIGTERM and SIGKILL when leadership ends [default: 3s, or less
    /// when the lease leaves less]. Capped so that COMMAND is dead before the lease can expire
    /// for anyone else: at 80% of lease duration minus renew deadline.
    #[arg(long, env = "LEADER_GRACE", value_parser = humantime::parse_duration)]
    grace: Option<Duration>,
    /// Exit when leadership is lost (exit code 75) instead of running for it again.
    #[arg(long, env = "LEADER_ONCE")]
    once: bool,
    /// Serve Prometheus metrics at /metrics and a health check at /healthz on this address.
    #[arg(long, env = "LEADER_METRICS_ADDR", value_name = "ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// On SIGTERM or SIGINT while leading, hand the lease over to this replica instead of a
    /// plain release (a planned handover: it takes over at once, the others stand back).
    #[arg(long, env = "LEADER_HANDOVER_TO", value_name = "IDENTITY")]
    handover_to: Option<String>,
    /// The program to run while leading, and its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

#[derive(Debug, Args)]
struct HandoverArgs {
    #[command(flatten)]
    lock: LockArgs,
    /// The identity of the replica that should lead next.
    #[arg(long, value_name = "IDENTITY")]
    to: String,
    /// Wait until that replica leads (exit 0), or until `--timeout` (exit 7).
    #[arg(long)]
    wait: bool,
    /// How long `--wait` waits.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    lock: LockArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `leader` with the process's arguments and returns its exit code.
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(child::SUPERVISE) {
        let command = args.get(3..).unwrap_or_default().to_vec();
        return match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => ExitCode::from(runtime.block_on(child::supervise(&command))),
            Err(_) => ExitCode::from(exit::FAILURE),
        };
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return ExitCode::from(if err.use_stderr() {
                exit::USAGE
            } else {
                exit::OK
            });
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(log_filter(std::env::var("RUST_LOG").ok().as_deref()))
        .with_writer(std::io::stderr)
        .with_target(false)
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
    let code = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run(args).await,
            Command::Status(args) => status(args).await,
            Command::Handover(args) => handover(args).await,
        }
    });
    ExitCode::from(code)
}

/// One clear line on stderr, and the code to exit with.
fn fail(code: u8, message: impl std::fmt::Display) -> u8 {
    eprintln!("leader: {message}");
    code
}

fn default_identity() -> String {
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "host".to_owned());
    format!("{host}-{}", std::process::id())
}

/// Opens the lock and reads it once, so that a wrong URL, a server that is down or refuses us is
/// one clear line and an exit code at start; later outages are retried. Connecting and reading
/// together answer within `timeout`, whatever the server does.
async fn open_lock(
    args: &LockArgs,
    identity: &str,
    timeout: Duration,
) -> Result<(Box<dyn ResourceLock>, Option<FileLock>), u8> {
    let url = match args.lock.as_deref() {
        Some(url) => LockUrl::parse(url).map_err(|err| fail(exit::BAD_LOCK, err))?,
        None => LockUrl::File(leader::default_file(&args.name)),
    };
    let opened = async {
        let (lock, file): (Box<dyn ResourceLock>, _) = match &url {
            // The same lock, kept as a `FileLock` too: its term lock is handed to COMMAND.
            LockUrl::File(path) => {
                let file = FileLock::new(path, identity);
                (Box::new(file.clone()), Some(file))
            }
            other => (other.open(&args.name, identity).await?, None),
        };
        lock.get().await?;
        Ok::<_, LockError>((lock, file))
    };
    match tokio::time::timeout(timeout, opened).await {
        Ok(Ok(opened)) => Ok(opened),
        Ok(Err(err)) => Err(fail(code_for(&err), err)),
        Err(_) => Err(fail(
            exit::UNREACHABLE,
            format!("{}: no answer within {timeout:?}", url.describe()),
        )),
    }
}

fn code_for(err: &LockError) -> u8 {
    match err {
        LockError::Unavailable { .. } | LockError::Timeout { .. } => exit::UNREACHABLE,
        LockError::Misconfigured { .. } => exit::BAD_LOCK,
        _ => exit::REFUSED,
    }
}

/// What the supervisor decided the exit code is, once it knows.
#[derive(Clone, Default)]
struct Outcome(Arc<Mutex<Option<u8>>>);

impl Outcome {
    fn set_once(&self, code: u8) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(code);
    }

    fn get(&self) -> Option<u8> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

async fn run(args: RunArgs) -> u8 {
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    // Check the timings before connecting to anything.
    if let Err(err) = LeaderElector::builder(leader_core::MemoryLock::new("check", "check"))
        .lease_duration(args.lease_duration)
        .renew_deadline(args.renew_deadline)
        .retry_period(args.retry_period)
        .build()
    {
        return fail(exit::USAGE, err);
    }
    let available = args.lease_duration.saturating_sub(args.renew_deadline);
    // COMMAND must be dead and reaped before anyone else can take over: keep a fifth of the
    // time between our step-down and the lease's end for SIGKILL and reaping.
    let max_grace = available.mul_f64(0.8);
    let grace = match args.grace {
        Some(grace) if grace > max_grace => {
            tracing::warn!(
                requested = ?grace,
                capped = ?max_grace,
                "--grace capped: COMMAND must be stopped before the lease can expire for another replica"
            );
            max_grace
        }
        Some(grace) => grace,
        None => DEFAULT_GRACE.min(max_grace),
    };
    let (lock, file_lock) = match open_lock(&args.lock, &identity, args.renew_deadline / 2).await {
        Ok(opened) => opened,
        Err(code) => return code,
    };
    let describe = lock.describe();
    let program = Program {
        command: args.command.clone(),
        name: args.lock.name.clone(),
        identity: identity.clone(),
    };
    let shutdown = CancellationToken::new();
    let outcome = Outcome::default();
    // Set once a signal asked this replica to stop: a planned end, not a lost term.
    let stopping = CancellationToken::new();

    let supervise = {
        let (program, shutdown, outcome) = (program.clone(), shutdown.clone(), outcome.clone());
        move |leadership: leader_core::Leadership| {
            let (program, shutdown, outcome) = (program.clone(), shutdown.clone(), outcome.clone());
            let file_lock = file_lock.clone();
            async move {
                let token = leadership.fencing_token();
                let term_lock = file_lock.as_ref().and_then(FileLock::term_lock);
                let mut child = match program.spawn(token, term_lock) {
                    Ok(child) => child,
                    Err(err) => {
                        let code = child::spawn_error_code(&err);
                        eprintln!("leader: cannot start {:?}: {err}", program.command[0]);
                        outcome.set_once(code);
                        shutdown.cancel();
                        return;
                    }
                };
                tracing::info!(fencing_token = token, pid = child.id(), "COMMAND started");
                tokio::select! {
                    status = child.wait() => {
                        let code = status.map_or(exit::FAILURE, child::exit_code);
                        tracing::info!(code, "COMMAND exited by itself: releasing the lease");
                        outcome.set_once(code);
                        shutdown.cancel();
                    }
                    () = leadership.lost() => {
                        let status = child::terminate(&mut child, grace).await;
                        tracing::info!(?status, "COMMAND stopped");
                        if shutdown.is_cancelled()
                            && let Ok(status) = status
                            && status.code().is_some()
                        {
                            // Shut down by a signal: report COMMAND's own code if it exited.
                            outcome.set_once(child::exit_code(status));
                        }
                    }
                }
            }
        }
    };
    let once = args.once;
    let stopped = {
        let (shutdown, outcome, stopping) = (shutdown.clone(), outcome.clone(), stopping.clone());
        move |step_down: leader_core::StepDown| {
            if once && step_down.reason != StepDownReason::Shutdown && !stopping.is_cancelled() {
                outcome.set_once(exit::LOST);
                shutdown.cancel();
            }
        }
    };
    let elector = LeaderElector::builder(lock)
        .name(args.lock.name.clone())
        .lease_duration(args.lease_duration)
        .renew_deadline(args.renew_deadline)
        .retry_period(args.retry_period)
        .stop_grace(available)
        .on_new_leader(|leader| tracing::info!(leader, "leader"))
        .on_started_leading(supervise)
        .on_stopped_leading(stopped)
        .build();
    let elector = match elector {
        Ok(elector) => elector,
        Err(err) => return fail(exit::USAGE, err),
    };
    if let Some(addr) = args.metrics_addr {
        match serve::start(addr, elector.health_check(Duration::from_secs(5))).await {
            Ok(()) => {}
            Err(err) => return fail(exit::USAGE, format!("--metrics-addr {addr}: {err}")),
        }
    }
    tokio::spawn(on_signal(
        shutdown.clone(),
        stopping,
        elector.subscribe(),
        args.handover_to.clone(),
    ));
    tracing::info!(identity, lock = %describe, "running for leadership");
    elector.run(shutdown).await;
    outcome.get().unwrap_or(exit::OK)
}

/// On SIGTERM or SIGINT: with `handover_to`, a leader hands its lease over (COMMAND stopped,
/// the lease released to that replica) before shutting down; otherwise a plain shutdown, which
/// stops COMMAND and releases the lease.
async fn on_signal(
    shutdown: CancellationToken,
    stopping: CancellationToken,
    mut state: tokio::sync::watch::Receiver<leader_core::LeaderState>,
    handover_to: Option<String>,
) {
    wait_for_signal().await;
    stopping.cancel();
    let leading = state.borrow().leadership().cloned();
    if let (Some(to), Some(leadership)) = (handover_to, leading)
        && leadership.hand_over(to.clone()).is_ok()
    {
        tracing::info!(to, "signal received: handing the lease over");
        drop(leadership);
        // Stepped down: COMMAND is stopped and the lease released to `to`.
        let _ = state.wait_for(|s| !s.is_leading()).await;
    } else {
        tracing::info!("signal received: stopping COMMAND and releasing the lease");
    }
    shutdown.cancel();
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

async fn status(args: StatusArgs) -> u8 {
    let lock = match open_lock(&args.lock, "leader-status", Duration::from_secs(5)).await {
        Ok((lock, _)) => lock,
        Err(code) => return code,
    };
    let observed = match lock.get().await {
        Ok(observed) => observed,
        Err(err) => return fail(code_for(&err), err),
    };
    let now = chrono::Utc::now();
    let Some(observed) = observed else {
        if args.json {
            println!(
                "{}",
                serde_json::json!({"lock": lock.describe(), "name": args.lock.name, "exists": false})
            );
        } else {
            println!(
                "{}: no record yet (nobody has run for leadership)",
                lock.describe()
            );
        }
        return exit::OK;
    };
    let record = &observed.record;
    // The store's own clock, where it keeps one: the holder may renew there without rewriting
    // the record's renew time (etcd, Redis).
    let time_left = lock.time_left().await.ok().flatten();
    let lease = chrono::Duration::from_std(record.lease_duration).unwrap_or(chrono::Duration::MAX);
    // Wall clocks, for people: the electors themselves never decide on them.
    let expired = match time_left {
        Some(left) => left.is_zero(),
        None => record.is_free() || record.renew_time + lease < now,
    };
    if args.json {
        let value = serde_json::json!({
            "lock": lock.describe(),
            "name": args.lock.name,
            "exists": true,
            "holder": (!record.is_free()).then_some(&record.holder_identity),
            "leaseDurationMillis": record.lease_duration.as_millis(),
            "acquireTime": record.acquire_time,
            "renewTime": record.renew_time,
            "leaderTransitions": record.leader_transitions,
            "expired": expired,
            "expiresInMillis": time_left.map(|left| left.as_millis()),
            "handoverTo": record.handover_to(),
        });
        println!("{value}");
    } else {
        let holder = if record.is_free() {
            "(released)"
        } else {
            &record.holder_identity
        };
        println!("lock         {}", lock.describe());
        println!("name         {}", args.lock.name);
        println!("holder       {holder}");
        println!(
            "lease        {}",
            humantime::format_duration(record.lease_duration)
        );
        println!(
            "acquired     {} ({} ago)",
            record.acquire_time.to_rfc3339(),
            ago(now - record.acquire_time)
        );
        println!(
            "renewed      {} ({} ago)",
            record.renew_time.to_rfc3339(),
            ago(now - record.renew_time)
        );
        println!("transitions  {}", record.leader_transitions);
        println!("expired      {}", if expired { "yes" } else { "no" });
        if let Some(left) = time_left {
            println!(
                "expires in   {} (by the store's clock)",
                humantime::format_duration(left)
            );
        }
        if let Some(to) = record.handover_to() {
            println!("handover to  {to} (pending)");
        }
    }
    exit::OK
}

async fn handover(args: HandoverArgs) -> u8 {
    let lock = match open_lock(&args.lock, "leader-handover", Duration::from_secs(5)).await {
        Ok((lock, _)) => lock,
        Err(code) => return code,
    };
    let written = match leader_core::request_handover(&*lock, &args.to).await {
        Ok(written) => written,
        Err(leader_core::HandoverError::NoElection { lock }) => {
            return fail(
                exit::NO_ELECTION,
                format!("{lock}: nobody has run for this election yet; nothing to hand over"),
            );
        }
        Err(leader_core::HandoverError::Lock(err)) => return fail(code_for(&err), err),
        Err(err) => return fail(exit::FAILURE, err),
    };
    if written.record.is_held_by(&args.to) {
        println!("{} already leads", args.to);
        return exit::OK;
    }
    println!("asked {} to hand over to {}", lock.describe(), args.to);
    if !args.wait {
        return exit::OK;
    }
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut last = written.record;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match lock.get().await {
            Ok(Some(current)) if current.record.is_held_by(&args.to) => {
                println!(
                    "{} leads (fencing token {})",
                    args.to, current.record.leader_transitions
                );
                return exit::OK;
            }
            Ok(Some(current)) => last = current.record,
            Ok(None) | Err(_) => {}
        }
    }
    let now = if last.is_free() {
        "nobody leads".to_owned()
    } else {
        format!("{} leads", last.holder_identity)
    };
    fail(
        exit::NOT_HANDED_OVER,
        format!(
            "{} did not lead within {} ({now})",
            args.to,
            humantime::format_duration(args.timeout)
        ),
    )
}

fn ago(elapsed: chrono::Duration) -> String {
    let elapsed = elapsed.to_std().unwrap_or_default();
    humantime::format_duration(Duration::from_millis(
        u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
    ))
    .to_string()
}

/// The log filter: `RUST_LOG`, or `info`. The Kubernetes client logs every failed request as an
/// ERROR of its own (target `kube_client::client::builder`); the elector already reports
/// failures, and summarises an outage instead of a line per attempt (S9), so that target is off
/// unless `RUST_LOG` names `kube_client`.
fn log_filter(rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    let mut filter = rust_log
        .and_then(|value| tracing_subscriber::EnvFilter::try_new(value).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info"));
    if !rust_log.is_some_and(|value| value.contains("kube_client"))
        && let Ok(quiet) = "kube_client::client::builder=off".parse()
    {
        filter = filter.add_directive(quiet);
    }
    filter
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn the_kubernetes_clients_own_error_per_request_is_off_unless_asked_for() {
        for rust_log in [
            None,
            Some("info"),
            Some("debug,leader_core=trace"),
            Some("not a filter ["),
        ] {
            let filter = log_filter(rust_log).to_string();
            assert!(
                filter.contains("kube_client::client::builder=off"),
                "{rust_log:?}: {filter}"
            );
        }
        let asked = log_filter(Some("info,kube_client=debug")).to_string();
        assert!(!asked.contains("=off"), "{asked}");
    }
}
