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
    /// Run COMMAND once per firing of a schedule, on whichever replica leads: each firing
    /// started at most once across replicas, recorded in the lock's record; or suspend,
    /// resume, trigger or cancel a running schedule's firings.
    #[cfg(feature = "cron")]
    #[command(after_help = CRON_REQUESTS)]
    Cron(CronArgs),
    /// Show the lock's holder, times and transitions, or a shard set's members and each shard's
    /// owner, without taking part.
    Status(StatusArgs),
    /// Ask the leader to hand over to a named replica (a planned handover), without taking
    /// part in the election.
    Handover(HandoverArgs),
    /// Operate on a running shard set (`leader run --shards`) without taking part in it.
    #[command(subcommand)]
    Shards(ShardsCommand),
}

/// `leader shards ...`.
#[derive(Debug, Subcommand)]
pub(crate) enum ShardsCommand {
    /// Change the set's shard count while its replicas run: each follows within a retry
    /// period, takes the shards added and stops and releases those removed (the highest
    /// numbers). Replicas started afterwards need `--shards K`.
    Resize(ResizeArgs),
    /// Drain a member before maintenance: it hands every shard to the others (each COMMAND
    /// stopped first) and takes none until undrained, while it keeps running.
    Drain(DrainArgs),
    /// Let a drained member take its share of the shards again.
    Undrain(DrainArgs),
}

#[derive(Debug, Args)]
pub(crate) struct DrainArgs {
    #[command(flatten)]
    pub(crate) lock: LockArgs,
    /// The member's identity (`leader status` lists them).
    #[arg(value_name = "IDENTITY")]
    pub(crate) identity: String,
    /// Wait until the member owns no shard (drain) or its share (undrain): exit 0, or exit 7
    /// after `--timeout`.
    #[arg(long)]
    pub(crate) wait: bool,
    /// How long `--wait` waits.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub(crate) timeout: Duration,
}

#[derive(Debug, Args)]
pub(crate) struct ResizeArgs {
    #[command(flatten)]
    pub(crate) lock: LockArgs,
    /// The new shard count.
    #[arg(value_name = "K", value_parser = clap::value_parser!(u32).range(1..=i64::from(leader_core::MAX_SHARDS)))]
    pub(crate) count: u32,
}

#[derive(Debug, Args)]
pub(crate) struct LockArgs {
    /// The lock: file:///PATH, postgres://... or postgresql://... (?advisory=true for the
    /// advisory lock), mysql://... or mariadb://..., nats://HOST:PORT/BUCKET,
    /// zk://HOST:PORT[,HOST:PORT]/CHROOT or zookeeper://..., redis://... or rediss://...,
    /// etcd://HOST:PORT[,HOST:PORT] or etcds://...,
    /// consul://HOST:PORT/PREFIX or consuls://..., s3://BUCKET/PREFIX/, gs://BUCKET/PREFIX/ or
    /// az://CONTAINER/PREFIX/ (or azure://...), dynamodb://TABLE, or kubernetes://NAMESPACE
    /// (?binary_version=V
    /// for coordinated leader election). Default: a lock directory private to this user in the runtime or temp
    /// directory.
    // The URL may hold a password: help names the variable, never its value.
    #[arg(long, env = "LEADER_LOCK", value_name = "URL", hide_env_values = true)]
    pub(crate) lock: Option<String>,
    /// The election's name: replicas with the same lock and name elect one leader.
    #[arg(long, env = "LEADER_NAME")]
    pub(crate) name: String,
}

/// The label key of `--label-pod` without a value (`leader_kube::POD_LABEL`).
pub(crate) const DEFAULT_POD_LABEL: &str = "leader-rs.io/leader";

/// What `leader run` and `leader cron` share: the election and the replica's surfaces.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("any_serve").args(["serve", "metrics_addr"]).multiple(false))]
pub(crate) struct ElectionArgs {
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
    /// Serve on this address: who leads at /leader (JSON; 200 on the leader, 503 elsewhere),
    /// readiness at /readyz, liveness at /healthz and Prometheus metrics at /metrics.
    #[arg(long, env = "LEADER_SERVE", value_name = "ADDR")]
    pub(crate) serve: Option<SocketAddr>,
    /// The former name of --serve.
    #[arg(
        long,
        env = "LEADER_METRICS_ADDR",
        value_name = "ADDR",
        hide = true,
        conflicts_with = "serve"
    )]
    pub(crate) metrics_addr: Option<SocketAddr>,
    /// /readyz answers 200 only while this replica leads, for a Service that must send only to
    /// the leader. Standby replicas are then never ready, which stalls rolling updates of a
    /// Deployment with more than one replica: see the README, and prefer --label-pod.
    #[arg(long, env = "LEADER_READY_ONLY_WHILE_LEADING", requires = "any_serve")]
    pub(crate) ready_only_while_leading: bool,
    /// Kubernetes: label this replica's Pod (POD_NAME in POD_NAMESPACE, from the downward API)
    /// KEY=NAME while it leads [default KEY: leader-rs.io/leader], for a Service that selects
    /// the label; needs list, watch and patch on pods (kubectl create role leader-pod-label
    /// --verb=list,watch,patch --resource=pods, bound to the Pod's service account).
    #[arg(
        long,
        env = "LEADER_LABEL_POD",
        value_name = "KEY",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = DEFAULT_POD_LABEL
    )]
    pub(crate) label_pod: Option<String>,
    /// On SIGTERM, SIGINT or SIGHUP while leading, hand the lease over to this replica instead of a
    /// plain release (a planned handover: it takes over at once, the others stand back).
    #[arg(long, env = "LEADER_HANDOVER_TO", value_name = "IDENTITY")]
    pub(crate) handover_to: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) election: ElectionArgs,
    /// Exit when leadership is lost (exit code 75) instead of running for it again.
    #[arg(long, env = "LEADER_ONCE", conflicts_with = "shards")]
    pub(crate) once: bool,
    /// Split the work into K shards over every replica run with this name: COMMAND runs once
    /// per shard this replica owns, with LEADER_SHARD, LEADER_SHARD_COUNT and the shard's
    /// LEADER_FENCING_TOKEN in its environment. Every replica of a set needs the same K.
    #[arg(long, env = "LEADER_SHARDS", value_name = "K", value_parser = clap::value_parser!(u32).range(1..=i64::from(leader_core::MAX_SHARDS)))]
    pub(crate) shards: Option<u32>,
    /// With --shards, where this replica's identity is the same after a restart (a
    /// StatefulSet's Pod name as POD_NAME, or --identity): on SIGTERM its shards are released
    /// reserved for it, and after a crash the others keep them for it once its lease ran out,
    /// so that a replica restarted within --static-membership-window takes them back and none
    /// moves. A replica that does not come back leaves them idle as long.
    #[arg(long, env = "LEADER_STATIC_MEMBERSHIP", requires = "shards")]
    pub(crate) static_membership: bool,
    /// With --static-membership, how long a replica's shards wait for it to come back after a
    /// SIGTERM (or a crash, once its lease ran out) before the others take them [default: the
    /// lease duration]: a restart that
    /// takes longer than the lease (a Pod rescheduled, an image pulled) moves no shard within
    /// it. A replica that does not come back leaves its shards idle as long.
    #[arg(
        long,
        env = "LEADER_STATIC_MEMBERSHIP_WINDOW",
        value_name = "DURATION",
        value_parser = humantime::parse_duration,
        requires = "static_membership"
    )]
    pub(crate) static_membership_window: Option<Duration>,
    /// With --shards, this replica's weight: its share of the shards is in proportion to it
    /// (2 owns about twice as many as 1; 0 takes none).
    #[arg(
        long,
        env = "LEADER_WEIGHT",
        value_name = "W",
        default_value_t = 1,
        requires = "shards"
    )]
    pub(crate) weight: u32,
    /// The program to run while leading, and its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub(crate) command: Vec<String>,
}

/// What `leader cron --help` says of the requests, which [`CronRequestCli`] parses.
#[cfg(feature = "cron")]
const CRON_REQUESTS: &str = "Requests for a running schedule, through the lock's record (whichever replica leads obeys):
  leader cron suspend --lock URL --name NAME [--by WHO]   start none of its firings until resumed
  leader cron resume --lock URL --name NAME               run it again from its next firing
  leader cron trigger --lock URL --name NAME [--by WHO]   run COMMAND once now, outside the schedule
  leader cron cancel --lock URL --name NAME [--by WHO] [--firing SCHEDULED]
                                                          stop the running COMMAND (SIGTERM, then SIGKILL
                                                          after --grace) and drop a pending retry;
                                                          recorded as cancelled, not retried";

/// The words after `leader cron` that make it a request for a running schedule.
#[cfg(feature = "cron")]
pub(crate) const CRON_REQUEST_WORDS: [&str; 4] = ["suspend", "resume", "trigger", "cancel"];

/// `leader cron suspend|resume|trigger|cancel`: parsed apart from `leader cron`, whose trailing
/// COMMAND cannot share a command line with subcommands.
#[cfg(feature = "cron")]
#[derive(Debug, Parser)]
#[command(name = "leader cron")]
pub(crate) struct CronRequestCli {
    #[command(subcommand)]
    pub(crate) request: CronRequest,
}

/// What operators ask of a running schedule, through the lock's record: whichever replica
/// leads obeys.
#[cfg(feature = "cron")]
#[derive(Debug, Subcommand)]
pub(crate) enum CronRequest {
    /// Start none of the schedule's firings until `resume` (they count as missed); a firing
    /// running goes on.
    Suspend(CronRequestArgs),
    /// Run the schedule again from its next firing.
    Resume(CronRequestArgs),
    /// Run COMMAND once now, outside the schedule, fenced and recorded like any firing.
    Trigger(CronRequestArgs),
    /// Cancel firings: a running COMMAND is stopped as --timeout stops it (SIGTERM, then
    /// SIGKILL after --grace), a firing waiting for a retry is dropped; each is recorded as
    /// cancelled (not failed) and not retried. Every firing the record shows running or
    /// waiting for a retry, or the one --firing names; none there exits 6.
    Cancel(CronCancelArgs),
}

/// The firings a cancel is for.
#[cfg(feature = "cron")]
#[derive(Debug, Args)]
pub(crate) struct CronCancelArgs {
    #[command(flatten)]
    pub(crate) request: CronRequestArgs,
    /// Only the firing scheduled at this instant (RFC 3339, as `leader status` and
    /// LEADER_FIRING_SCHEDULED show it).
    #[arg(long, value_name = "SCHEDULED", value_parser = rfc3339)]
    pub(crate) firing: Option<chrono::DateTime<chrono::Utc>>,
}

/// An instant in RFC 3339.
#[cfg(feature = "cron")]
fn rfc3339(text: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|at| at.with_timezone(&chrono::Utc))
        .map_err(|err| format!("not an RFC 3339 instant ({err}): 2026-01-10T03:00:00Z, say"))
}

/// The schedule a request is for.
#[cfg(feature = "cron")]
#[derive(Debug, Args)]
pub(crate) struct CronRequestArgs {
    /// The lock and the schedule's name (the election's name of `leader cron`).
    #[command(flatten)]
    pub(crate) lock: LockArgs,
    /// Who asks, recorded with the request. Default: USER@HOSTNAME.
    #[arg(long, value_name = "NAME")]
    pub(crate) by: Option<String>,
}

/// `leader cron`: the schedule, its policies and the program run per firing.
#[cfg(feature = "cron")]
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("when").args(["schedule", "every"]).required(true).multiple(false))]
pub(crate) struct CronArgs {
    #[command(flatten)]
    pub(crate) election: ElectionArgs,
    /// A cron expression, 5 fields (minute hour day-of-month month day-of-week) or 6 (seconds
    /// first), read in --time-zone.
    #[arg(long, env = "LEADER_SCHEDULE", value_name = "EXPRESSION")]
    pub(crate) schedule: Option<String>,
    /// The IANA time zone of --schedule (Europe/Berlin, America/New_York, UTC).
    #[arg(
        long,
        env = "LEADER_TIME_ZONE",
        default_value = "UTC",
        value_name = "ZONE"
    )]
    pub(crate) time_zone: String,
    /// A fixed interval instead of --schedule (30s, 5m, 1h: at least 1s), at the multiples of it
    /// since the Unix epoch.
    #[arg(long, env = "LEADER_EVERY", value_parser = humantime::parse_duration, value_name = "PERIOD")]
    pub(crate) every: Option<Duration>,
    /// Firings nobody started in time (no leader): run the latest late, run all (at most
    /// --missed-max), or skip them.
    #[arg(long, env = "LEADER_MISSED", default_value = "latest", value_parser = ["latest", "all", "skip"])]
    pub(crate) missed: String,
    /// With --missed all: the most missed firings run.
    #[arg(long, env = "LEADER_MISSED_MAX", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) missed_max: u32,
    /// Firings later than this are missed whatever --missed says.
    #[arg(long, env = "LEADER_STARTING_DEADLINE", value_parser = positive_duration, value_name = "DURATION")]
    pub(crate) starting_deadline: Option<Duration>,
    /// How late a firing may start and still be on time; a later one is a missed firing, which
    /// --missed decides about.
    #[arg(long, env = "LEADER_MISFIRE_THRESHOLD", default_value = "1s", value_parser = positive_duration, value_name = "DURATION")]
    pub(crate) misfire_threshold: Duration,
    /// A firing due while the previous one still runs: wait for it to end, then --missed
    /// decides (forbid), run both (allow), or stop the running one and start when it exited
    /// (replace).
    #[arg(long, env = "LEADER_OVERLAP", default_value = "forbid", value_parser = ["forbid", "allow", "replace"])]
    pub(crate) overlap: String,
    /// Run a firing whose COMMAND failed (exited non-zero, or ran past --timeout) again, up to
    /// this many more attempts (0 to 100), after --retry-backoff, doubling up to 6 minutes.
    #[arg(long, env = "LEADER_RETRIES", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub(crate) retries: u32,
    /// The first wait before a failed firing runs again.
    #[arg(long, env = "LEADER_RETRY_BACKOFF", default_value = "10s", value_parser = positive_duration, value_name = "DURATION")]
    pub(crate) retry_backoff: Duration,
    /// Stop a firing's COMMAND that runs longer than this (SIGTERM, then SIGKILL after
    /// --grace), recorded as timed out.
    #[arg(long, env = "LEADER_TIMEOUT", value_parser = positive_duration, value_name = "DURATION")]
    pub(crate) timeout: Option<Duration>,
    /// Change the stored schedule to this one when this replica leads and finds another there
    /// of the same --schedule-revision, changed before this replica started (or never): the
    /// new schedule's first firing is its first instant after the change. Without it such a
    /// replica exits with code 10.
    #[arg(long, env = "LEADER_ADOPT_SCHEDULE")]
    pub(crate) adopt_schedule: bool,
    /// The revision of this configuration's schedule (a number that grows with each change,
    /// 0 by default): a replica with a higher revision than the stored schedule's changes it;
    /// one with a lower revision runs the stored schedule and never writes its own back.
    #[arg(
        long,
        env = "LEADER_SCHEDULE_REVISION",
        default_value_t = 0,
        value_name = "N"
    )]
    pub(crate) schedule_revision: u64,
    /// How many ended firings the record keeps, shown by `leader status` (0 to 100).
    #[arg(long, env = "LEADER_HISTORY", default_value_t = 10, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub(crate) history: u8,
    /// With --overlap allow: the most firings running at once (1 to 1000); one more waits.
    #[arg(long, env = "LEADER_MAX_RUNNING", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub(crate) max_running: u16,
    /// A firing whose leader died before it ended: attempts in all, the first included (1:
    /// give it up, so that it runs at most once).
    #[arg(long, env = "LEADER_ATTEMPTS", default_value_t = 3)]
    pub(crate) attempts: u32,
    /// The program to run per firing, and its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub(crate) command: Vec<String>,
}

impl ElectionArgs {
    /// The address of `--serve`, or of its former name `--metrics-addr`.
    pub(crate) fn serve_addr(&self) -> Option<SocketAddr> {
        self.serve.or(self.metrics_addr)
    }
}

#[derive(Debug, Args)]
pub(crate) struct HandoverArgs {
    #[command(flatten)]
    pub(crate) lock: LockArgs,
    /// The identity of the replica that should lead next.
    #[arg(long, value_name = "IDENTITY", required_unless_present = "withdraw")]
    pub(crate) to: Option<String>,
    /// Withdraw a pending request instead (one the holder will never act on: a client other
    /// than this toolkit, or a replica that is gone).
    #[arg(long, conflicts_with_all = ["to", "wait"])]
    pub(crate) withdraw: bool,
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
    /// Show the shard set NAME (`leader run --shards`): its members, each shard's owner,
    /// fencing token and since when, the shards unowned. Without it, a set is shown when the
    /// lock holds no election NAME.
    #[arg(long)]
    pub(crate) shards: bool,
}

/// A duration longer than zero (`30s`, `5m`): where zero would mean a policy that never lets
/// anything happen, refused as the flag's bad value (exit 2) before anything is opened.
#[cfg(feature = "cron")]
fn positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(duration) if duration.is_zero() => Err("must be longer than zero".to_owned()),
        Ok(duration) => Ok(duration),
        Err(err) => Err(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::{CommandFactory, Parser};

    use super::{Cli, Command};

    /// `--lock`'s help names every scheme the command takes, built in or not (a scheme left
    /// out of the build is refused naming its feature).
    #[test]
    fn the_lock_help_lists_every_scheme() {
        let command = Cli::command();
        // `leader cron` exists only with the cron feature.
        let cron = cfg!(feature = "cron").then_some("cron");
        for subcommand in ["run", "status", "handover"].into_iter().chain(cron) {
            let help = command
                .find_subcommand(subcommand)
                .and_then(|c| c.get_arguments().find(|a| a.get_id() == "lock"))
                .and_then(|a| a.get_help())
                .map(ToString::to_string)
                .expect("--lock has help");
            for scheme in leader::BACKENDS.iter().flat_map(|b| b.schemes) {
                assert!(
                    help.contains(&format!("{scheme}://")),
                    "leader {subcommand} --lock does not mention {scheme}://: {help}"
                );
            }
        }
    }

    /// `--static-membership-window` takes a duration, is unset by default (the lease), and
    /// goes only with `--static-membership`.
    #[test]
    fn the_static_membership_window_goes_with_static_membership() {
        let window = |extra: &[&str]| -> Result<Option<Duration>, clap::Error> {
            let args = ["leader", "run", "--name", "jobs", "--shards", "4"];
            let cli = Cli::try_parse_from(args.iter().chain(extra).chain(&["--", "true"]))?;
            match cli.command {
                Command::Run(run) => Ok(run.static_membership_window),
                _ => unreachable!("a run"),
            }
        };
        let on = ["--static-membership", "--static-membership-window", "2m"];
        assert_eq!(window(&on).ok(), Some(Some(Duration::from_secs(120))));
        assert_eq!(window(&["--static-membership"]).ok(), Some(None));
        let err = window(&["--static-membership-window", "2m"]).expect_err("alone");
        assert!(err.to_string().contains("--static-membership"), "{err}");
        let err = window(&["--static-membership", "--static-membership-window", "soon"])
            .expect_err("not a duration");
        assert!(
            err.to_string().contains("--static-membership-window"),
            "{err}"
        );
    }

    /// A cron policy flag of a value that would never let anything happen is refused at
    /// parsing, naming the flag (exit 2), before any lock is opened.
    #[cfg(feature = "cron")]
    #[test]
    fn cron_policies_of_zero_are_refused_naming_the_flag() {
        for (flag, value) in [
            ("--missed-max", "0"),
            ("--timeout", "0s"),
            ("--retry-backoff", "0s"),
            ("--misfire-threshold", "0s"),
            ("--starting-deadline", "0s"),
        ] {
            let args = [
                "leader", "cron", "--name", "jobs", "--every", "1m", flag, value,
            ];
            let err = Cli::try_parse_from(args.iter().chain(&["--", "true"]))
                .map(|_| ())
                .expect_err(flag);
            assert!(err.to_string().contains(flag), "{flag}: {err}");
            assert_eq!(err.exit_code(), 2, "{flag}");
        }
        let args = [
            "leader",
            "cron",
            "--name",
            "jobs",
            "--every",
            "1m",
            "--timeout",
            "5m",
        ];
        assert!(Cli::try_parse_from(args.iter().chain(&["--", "true"])).is_ok());
    }
}
