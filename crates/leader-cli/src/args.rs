//! The command line: subcommands, flags and their environment variables.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// Run a program only while this replica holds leadership, or inspect a lock.
#[derive(Debug, Parser)]
#[command(name = "leader", version, about, long_about = None)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Wait to be elected, run COMMAND while leading, stop it when leadership ends.
    Run(RunArgs),
    /// Show the lock's holder, times and transitions, without taking part in the election.
    Status(StatusArgs),
    /// Ask the leader to hand over to a named replica (a planned handover), without taking
    /// part in the election.
    Handover(HandoverArgs),
}

#[derive(Debug, Args)]
pub(crate) struct LockArgs {
    /// The lock: file:///PATH, postgres://... or postgresql://... (?advisory=true for the
    /// advisory lock), redis://... or rediss://..., etcd://HOST:PORT[,HOST:PORT] or etcds://...,
    /// consul://HOST:PORT/PREFIX or consuls://..., s3://BUCKET/PREFIX/, gs://BUCKET/PREFIX/ or
    /// az://CONTAINER/PREFIX/, or kubernetes://NAMESPACE (?binary_version=V for coordinated
    /// leader election). Default: a lock directory private to this user in the runtime or temp
    /// directory.
    #[arg(long, env = "LEADER_LOCK", value_name = "URL")]
    pub(crate) lock: Option<String>,
    /// The election's name: replicas with the same lock and name elect one leader.
    #[arg(long, env = "LEADER_NAME")]
    pub(crate) name: String,
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) lock: LockArgs,
    /// This candidate's identity: one per process, never shared by two replicas. Default: the
    /// pod name (POD_NAME), else HOSTNAME-PID.
    #[arg(long, env = "LEADER_IDENTITY")]
    pub(crate) identity: Option<String>,
    /// How long followers wait after the leader's last renewal before taking over.
    #[arg(long, env = "LEADER_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    pub(crate) lease_duration: Duration,
    /// How long the leader keeps leading without a successful renewal.
    #[arg(long, env = "LEADER_RENEW_DEADLINE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub(crate) renew_deadline: Duration,
    /// Time between renewals and between attempts to acquire.
    #[arg(long, env = "LEADER_RETRY_PERIOD", default_value = "2s", value_parser = humantime::parse_duration)]
    pub(crate) retry_period: Duration,
    /// Time COMMAND gets between SIGTERM and SIGKILL when leadership ends [default: 3s, or less
    /// when the lease leaves less]. Capped so that COMMAND is dead before the lease can expire
    /// for anyone else: at 80% of lease duration minus renew deadline.
    #[arg(long, env = "LEADER_GRACE", value_parser = humantime::parse_duration)]
    pub(crate) grace: Option<Duration>,
    /// Exit when leadership is lost (exit code 75) instead of running for it again.
    #[arg(long, env = "LEADER_ONCE")]
    pub(crate) once: bool,
    /// Exit (code 8) when another process leads with this replica's identity, instead of
    /// waiting for its term to end.
    #[arg(long, env = "LEADER_EXIT_ON_IDENTITY_CONFLICT")]
    pub(crate) exit_on_identity_conflict: bool,
    /// The lowest fencing token a term takes: set it above the highest token of the store an
    /// election moves from, so that fencing downstream keeps working.
    #[arg(
        long,
        env = "LEADER_FENCING_TOKEN_FLOOR",
        default_value_t = 0,
        value_name = "TOKEN"
    )]
    pub(crate) fencing_token_floor: u64,
    /// Serve Prometheus metrics at /metrics, liveness at /healthz and readiness at /readyz on
    /// this address.
    #[arg(long, env = "LEADER_METRICS_ADDR", value_name = "ADDR")]
    pub(crate) metrics_addr: Option<SocketAddr>,
    /// On SIGTERM or SIGINT while leading, hand the lease over to this replica instead of a
    /// plain release (a planned handover: it takes over at once, the others stand back).
    #[arg(long, env = "LEADER_HANDOVER_TO", value_name = "IDENTITY")]
    pub(crate) handover_to: Option<String>,
    /// The program to run while leading, and its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub(crate) command: Vec<String>,
}

#[derive(Debug, Args)]
pub(crate) struct HandoverArgs {
    #[command(flatten)]
    pub(crate) lock: LockArgs,
    /// The identity of the replica that should lead next.
    #[arg(long, value_name = "IDENTITY")]
    pub(crate) to: String,
    /// Wait until that replica leads (exit 0), or until `--timeout` (exit 7).
    #[arg(long)]
    pub(crate) wait: bool,
    /// How long `--wait` waits.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub(crate) timeout: Duration,
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) lock: LockArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}
