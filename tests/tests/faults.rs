//! Fault: the leader (its `leader` process and its COMMAND) is frozen with SIGSTOP for longer than
//! the lease, another replica takes over, then the frozen one is resumed with SIGCONT. The stale
//! COMMAND may get a write out before its `leader` stops it: a fenced sink in Postgres must refuse
//! it, and the resumed `leader` must stop its COMMAND at once.
//!
//! Runs on the file and Postgres locks; needs the Postgres of `DATABASE_URL` for the sink.

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout};

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");
const WRITER: &str = env!("CARGO_BIN_EXE_fenced-writer");
const LEASE: Duration = Duration::from_secs(2);

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/postgres".into())
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

async fn sink_client() -> Option<tokio_postgres::Client> {
    match tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(connection);
            Some(client)
        }
        Err(err) => {
            assert!(
                !in_ci(),
                "CI=true and no Postgres for the fenced sink: {err}"
            );
            eprintln!("skipping: no Postgres for the fenced sink ({err})");
            None
        }
    }
}

/// The supervisor process `leader` runs COMMAND under: its only child, and the leader of
/// COMMAND's process group.
fn command_group(leader: &Child) -> Pid {
    let pid = leader.id().expect("running");
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .expect("/proc children");
    let child: i32 = children
        .split_whitespace()
        .next()
        .expect("a running COMMAND")
        .parse()
        .expect("pid");
    Pid::from_raw(child)
}

/// Lines `start IDENTITY TOKEN NANOS` / `stop ...` from the writers.
fn log_lines(path: &std::path::Path) -> Vec<(String, String, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let p: Vec<&str> = l.split(' ').collect();
            (
                p[0].to_owned(),
                p[1].to_owned(),
                p[2].parse().expect("token"),
            )
        })
        .collect()
}

async fn wait_log(
    path: &std::path::Path,
    what: impl Fn(&[(String, String, u64)]) -> bool,
    within: Duration,
) {
    timeout(within, async {
        while !what(&log_lines(path)) {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not within {within:?}: {:?}", log_lines(path)));
}

async fn frozen_leader_is_fenced(lock: &str) {
    let Some(sink) = sink_client().await else {
        return;
    };
    let prefix = format!("fenced_{:08x}", std::process::id() ^ nanos_now());
    sink.batch_execute(&format!(
        "CREATE TABLE {prefix}_mark (token bigint NOT NULL); INSERT INTO {prefix}_mark VALUES (0);
         CREATE TABLE {prefix}_writes (seq bigserial PRIMARY KEY, token bigint NOT NULL, writer text NOT NULL, accepted bool NOT NULL);"
    ))
    .await
    .expect("sink tables");
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("writers.log");
    let name = format!("fault-{prefix}");
    let spawn = |identity: &str| {
        Command::new(LEADER)
            .args([
                "run",
                "--lock",
                lock,
                "--name",
                &name,
                "--identity",
                identity,
            ])
            .args([
                "--lease-duration",
                "2s",
                "--renew-deadline",
                "1500ms",
                "--retry-period",
                "250ms",
                "--",
                WRITER,
            ])
            .env("DATABASE_URL", database_url())
            .env("SINK", &prefix)
            .env("JOB_LOG", &log)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn leader")
    };
    let mut replicas = vec![spawn("one"), spawn("two")];
    wait_log(
        &log,
        |l| l.iter().any(|e| e.0 == "start"),
        Duration::from_secs(10),
    )
    .await;
    sleep(Duration::from_millis(500)).await;
    let (_, frozen_identity, stale_token) = log_lines(&log)[0].clone();
    let frozen = usize::from(frozen_identity == "two");
    let frozen_pid = Pid::from_raw(replicas[frozen].id().expect("running").cast_signed());
    let group = command_group(&replicas[frozen]);

    // Freeze the leader and its COMMAND, past the lease: the other replica takes over.
    killpg(group, Signal::SIGSTOP).expect("stop COMMAND");
    kill(frozen_pid, Signal::SIGSTOP).expect("stop leader");
    wait_log(
        &log,
        |l| l.iter().filter(|e| e.0 == "start").count() >= 2,
        LEASE * 4,
    )
    .await;
    sleep(Duration::from_millis(300)).await; // the new writer's writes raise the mark

    // Resume: the stale COMMAND first (it may write at once), then its `leader`, which must
    // find its term over and stop COMMAND.
    killpg(group, Signal::SIGCONT).expect("resume COMMAND");
    sleep(Duration::from_millis(200)).await;
    let resumed = std::time::Instant::now();
    kill(frozen_pid, Signal::SIGCONT).expect("resume leader");
    wait_log(
        &log,
        |l| {
            l.iter()
                .any(|e| e.0 == "stop" && e.1 == frozen_identity && e.2 == stale_token)
        },
        Duration::from_secs(3),
    )
    .await;
    eprintln!(
        "{lock}: the resumed leader stopped its stale COMMAND {:?} after SIGCONT",
        resumed.elapsed()
    );

    for replica in &mut replicas {
        let _ = kill(
            Pid::from_raw(replica.id().expect("running").cast_signed()),
            Signal::SIGTERM,
        );
        let _ = timeout(Duration::from_secs(10), replica.wait()).await;
    }
    let rows = sink
        .query(
            &format!("SELECT token, accepted FROM {prefix}_writes ORDER BY seq"),
            &[],
        )
        .await
        .expect("writes");
    sink.batch_execute(&format!(
        "DROP TABLE {prefix}_mark; DROP TABLE {prefix}_writes;"
    ))
    .await
    .expect("drop");
    let writes: Vec<(i64, bool)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let stale = i64::try_from(stale_token).expect("token");
    let refused = writes.iter().filter(|(t, ok)| *t == stale && !ok).count();
    let mut highest = 0;
    for (token, accepted) in &writes {
        if *accepted {
            assert!(
                *token >= highest,
                "an accepted write went back from token {highest} to {token}"
            );
            highest = *token;
        }
    }
    assert!(highest > stale, "the new leader wrote with a larger token");
    let new_first = writes
        .iter()
        .position(|(t, ok)| *ok && *t > stale)
        .expect("the new leader wrote");
    assert!(
        writes[new_first..]
            .iter()
            .all(|(t, ok)| !(*ok && *t == stale)),
        "a stale write was accepted after the new leader's"
    );
    eprintln!(
        "{lock}: {} writes, {refused} stale writes refused",
        writes.len()
    );
    assert!(
        refused > 0,
        "the stale COMMAND got no write out: the fence was not exercised"
    );
}

fn nanos_now() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_file_lock_leader_is_fenced_and_stops_when_resumed() {
    let dir = tempfile::tempdir().expect("tempdir");
    frozen_leader_is_fenced(&format!(
        "file://{}",
        dir.path().join("lock.json").display()
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_postgres_lock_leader_is_fenced_and_stops_when_resumed() {
    frozen_leader_is_fenced(&database_url()).await;
}
