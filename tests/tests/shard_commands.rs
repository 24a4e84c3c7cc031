//! End to end: `leader run --shards` on the file lock when a shard's COMMAND cannot start (the
//! `leader` binary replaced under a running replica, as in an upgrade) or keeps crashing. The
//! shard is given up, said so in a line naming it, and taken again by that replica only after a
//! back-off that grows; another replica may take it meanwhile.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use leader_tests::term_events as events;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout};

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");
const JOB: &str = env!("CARGO_BIN_EXE_job");
const LEASE: Duration = Duration::from_millis(2000);
const RENEW: Duration = Duration::from_millis(1500);
const RETRY: Duration = Duration::from_millis(200);

/// A replica of set `name` run from `binary`, with `--shards 1` and the `job` binary as
/// COMMAND (logging to `DIR/job.log.0`), its stderr written to `DIR/IDENTITY.stderr`.
/// `env` is more environment for COMMAND.
fn replica(
    binary: &Path,
    lock: &str,
    name: &str,
    identity: &str,
    dir: &Path,
    env: &[(&str, &str)],
) -> Child {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let stderr = std::fs::File::create(stderr_of(dir, identity)).expect("stderr file");
    Command::new(binary)
        .arg("run")
        .args(["--lock", lock])
        .args(["--name", name])
        .args(["--identity", identity])
        .args(["--lease-duration", &ms(LEASE)])
        .args(["--renew-deadline", &ms(RENEW)])
        .args(["--retry-period", &ms(RETRY)])
        .args(["--shards", "1", "--", JOB])
        .env("JOB_LOG", dir.join("job.log"))
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn leader")
}

fn stderr_of(dir: &Path, identity: &str) -> PathBuf {
    dir.join(format!("{identity}.stderr"))
}

/// The lines of `identity`'s stderr that contain `text`.
fn lines_with(dir: &Path, identity: &str, text: &str) -> Vec<String> {
    std::fs::read_to_string(stderr_of(dir, identity))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(text))
        .map(str::to_owned)
        .collect()
}

async fn wait_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    timeout(within, async {
        while !done() {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .is_ok()
}

async fn stop(mut child: Child) {
    if let Some(id) = child.id() {
        let _ = kill(Pid::from_raw(id.cast_signed()), Signal::SIGTERM);
    }
    let _ = timeout(Duration::from_secs(10), child.wait()).await;
}

/// A replica whose own binary was replaced after it started cannot start any COMMAND (its
/// supervisor is that binary): it says so naming the shard and the error, gives the shard up,
/// and takes it again only after a back-off that grows; a healthy replica takes the shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_command_cannot_start_is_given_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = format!("file://{}", dir.path().join("lock").display());
    let name = format!("unstartable-{:08x}", fastrand::u32(..));
    let old = dir.path().join("leader-old");
    std::fs::copy(LEADER, &old).expect("copy the leader binary");
    let started = Instant::now();
    let broken = replica(&old, &lock, &name, "a", dir.path(), &[]);
    // Replaced, as an upgrade does: the running process's own binary is gone.
    std::fs::remove_file(&old).expect("remove the copy");
    assert!(
        wait_until(Duration::from_secs(10), || !lines_with(
            dir.path(),
            "a",
            "cannot start"
        )
        .is_empty())
        .await,
        "no COMMAND failed to start: {:?}",
        std::fs::read_to_string(stderr_of(dir.path(), "a"))
    );
    let line = lines_with(dir.path(), "a", "cannot start").remove(0);
    assert!(
        line.contains("shard 0") && line.contains("giving the shard up"),
        "{line}"
    );

    let healthy = replica(Path::new(LEADER), &lock, &name, "b", dir.path(), &[]);
    let log = dir.path().join("job.log.0");
    // The broken replica's waits grow until one outlasts the lease the healthy one waits for
    // a free shard beyond its share.
    let taken = wait_until(Duration::from_secs(30), || {
        events(&log).iter().any(|e| e.start && e.identity == "b")
    })
    .await;
    let attempts = lines_with(dir.path(), "a", "cannot start").len();
    let elapsed = started.elapsed();
    stop(broken).await;
    stop(healthy).await;
    assert!(
        taken,
        "the healthy replica never ran the shard: {:?}",
        std::fs::read_to_string(stderr_of(dir.path(), "a"))
    );
    // Without a back-off the broken replica would take the shard about every other round.
    let rounds = elapsed.as_secs_f64() / RETRY.as_secs_f64();
    assert!(
        attempts >= 2 && (attempts as f64) < rounds / 4.0,
        "{attempts} attempts to start COMMAND in {elapsed:?}"
    );
}

/// A COMMAND that exits at once every time is started again after a back-off that grows, and
/// the log says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_keeps_crashing_is_restarted_after_a_back_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = format!("file://{}", dir.path().join("lock").display());
    let name = format!("crashing-{:08x}", fastrand::u32(..));
    // The job exits with code 3 as soon as it starts.
    let crashing = replica(
        Path::new(LEADER),
        &lock,
        &name,
        "a",
        dir.path(),
        &[("JOB_EXIT", "3")],
    );
    let window = Duration::from_secs(6);
    sleep(window).await;
    stop(crashing).await;
    let exits = lines_with(dir.path(), "a", "COMMAND exited by itself");
    let backoffs = lines_with(dir.path(), "a", "back-off");
    // Without a back-off: about one start every other round (15 in the window).
    assert!(
        (2..=8).contains(&exits.len()),
        "{} starts of a crashing COMMAND in {window:?}: {:?}",
        exits.len(),
        std::fs::read_to_string(stderr_of(dir.path(), "a"))
    );
    assert!(!backoffs.is_empty(), "no back-off in the log");
}
