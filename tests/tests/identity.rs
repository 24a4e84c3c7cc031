//! End to end, S13 and the file lock's directory: two `leader run` processes given one identity
//! never both run COMMAND, on every backend; the second says so in a line naming the identity,
//! and with `--exit-on-identity-conflict` exits with code 8. The default file lock refuses a
//! directory another user made, with one line and exit code 3, tested as two users.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use leader_test_support::skip_or_fail;
use leader_tests::{on_each_backend, term_events};
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout};

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");
const JOB: &str = env!("CARGO_BIN_EXE_job");
/// The timings the shared identity was first seen flapping with.
const TIMINGS: [&str; 6] = [
    "--lease-duration",
    "2s",
    "--renew-deadline",
    "1500ms",
    "--retry-period",
    "300ms",
];

fn leader(
    lock: &str,
    name: &str,
    log: &Path,
    stderr: &Path,
    extra: &[&str],
    env: &[(String, String)],
) -> Child {
    Command::new(LEADER)
        .args(["run", "--lock", lock, "--name", name, "--identity", "same"])
        .args(TIMINGS)
        .args(extra)
        .args(["--", JOB])
        .envs(leader_test_support::s3_env_at(
            &leader_test_support::s3_endpoint(),
        ))
        .envs(leader_test_support::dynamodb_env())
        .envs(env.iter().cloned())
        .env("JOB_LOG", log)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(stderr).expect("stderr file"))
        .kill_on_drop(true)
        .spawn()
        .expect("spawn leader")
}

/// Two processes of one identity: the first leads, and keeps its one job running; the second
/// never starts one, says so naming the identity, and with the flag exits 8.
async fn one_identity_one_leader(lock: &str) {
    one_identity_one_leader_in(lock, &[]).await;
}

/// [`one_identity_one_leader`] with `env` in the processes' environment.
async fn one_identity_one_leader_in(lock: &str, env: &[(String, String)]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let name = format!("twins-{:08x}", fastrand::u32(..));
    let mut first = leader(lock, &name, &log, &dir.path().join("first.err"), &[], env);
    timeout(Duration::from_secs(20), async {
        while term_events(&log).is_empty() {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the first process leads");
    let second_err = dir.path().join("second.err");
    let mut second = leader(
        lock,
        &name,
        &log,
        &second_err,
        &["--exit-on-identity-conflict"],
        env,
    );
    // A lease kept in the store is found alive after twice its duration, plus retries.
    let status = timeout(Duration::from_secs(30), second.wait())
        .await
        .expect("the second process exits")
        .expect("status");
    let stderr = std::fs::read_to_string(&second_err).unwrap_or_default();
    assert_eq!(status.code(), Some(8), "{stderr}");
    assert!(
        stderr.contains("\"same\"") && stderr.contains("another process leads"),
        "the conflict is said, naming the identity: {stderr}"
    );
    // Without the flag, a third process waits, saying so, and never runs the job meanwhile.
    let third_err = dir.path().join("third.err");
    let mut third = leader(lock, &name, &log, &third_err, &[], env);
    sleep(Duration::from_secs(6)).await;
    let events = term_events(&log);
    assert_eq!(
        events.len(),
        1,
        "one job started and still running, no other: {events:?}"
    );
    assert!(events[0].start);
    let stderr = std::fs::read_to_string(&third_err).unwrap_or_default();
    assert!(
        stderr.contains("this candidate's identity"),
        "the waiting process says why: {stderr}"
    );
    let _ = first.kill().await;
    let _ = third.kill().await;
}

on_each_backend!(one_identity_one_leader:
    one_identity_one_leader_on_the_file_lock => Some(leader_tests::FileLock::in_temp_dir()),
    one_identity_one_leader_on_postgres => leader_test_support::postgres_lock_or_skip(),
    one_identity_one_leader_on_redis => leader_test_support::redis_lock_or_skip(),
    one_identity_one_leader_on_etcd => leader_test_support::etcd_lock_or_skip(),
    one_identity_one_leader_on_object_storage => leader_test_support::s3_bucket_or_skip()
        .map(|bucket| format!("s3://{bucket}/twins-{:08x}/", fastrand::u32(..))),
    one_identity_one_leader_on_dynamodb => leader_test_support::dynamodb_lock_or_skip("twins"),
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_identity_one_leader_on_consul() {
    let server = leader_test_support::consul_api::ConsulApiServer::start().await;
    one_identity_one_leader(&format!("consul://{}/twins/", server.address())).await;
}

/// Kubernetes, on the test API server as a stock cluster runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_identity_one_leader_on_kubernetes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server =
        leader_tests::KubeApiProcess::start(env!("CARGO_BIN_EXE_kube-api-e2e"), dir.path(), &[])
            .await;
    one_identity_one_leader_in("kubernetes://default", &[server.env()]).await;
}

/// The default lock directory, as two users: `nobody` runs `leader run` first, and its
/// directory is private to it; root's `leader run` for the same name refuses it with one line
/// and exit code 3. A directory `nobody` made open to all, with a garbage record in it, is
/// refused the same way instead of read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_lock_directory_of_another_user_is_refused() {
    if !nix::unistd::geteuid().is_root() {
        skip_or_fail!("only root can run a process as another user");
    }
    const NOBODY: u32 = 65534;
    let dir = tempfile::tempdir().expect("tempdir");
    // A shared temporary directory, as /tmp is.
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).expect("mkdir");
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    let log = tmp.join("jobs.log");
    let run = |name: &str| {
        let mut command = Command::new(LEADER);
        command
            .args(["run", "--name", name])
            .args(TIMINGS)
            .args(["--", JOB])
            .env_remove("XDG_RUNTIME_DIR")
            .env("TMPDIR", &tmp)
            .env("JOB_LOG", &log)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    };
    let mut theirs = run("shared-name")
        .uid(NOBODY)
        .gid(NOBODY)
        .spawn()
        .expect("spawn");
    timeout(Duration::from_secs(20), async {
        while term_events(&log).is_empty() {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("nobody's leader runs its job");
    let their_dir = tmp.join("leader-shared-name");
    let mode = std::fs::metadata(&their_dir)
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(
        mode, 0o700,
        "the default lock directory is private to its user"
    );

    let refused = |output: std::process::Output, why: &str| {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(3), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        assert!(stderr.contains(why), "{stderr}");
    };
    let ours = timeout(Duration::from_secs(20), run("shared-name").output())
        .await
        .expect("exits")
        .expect("runs");
    refused(ours, "owned by user 65534");
    let _ = theirs.kill().await;

    // A directory made open to all by another user, with garbage in it.
    let planted = tmp.join("leader-planted");
    std::fs::create_dir(&planted).expect("mkdir");
    std::fs::write(planted.join("v00000000000000000001.json"), "garbage").expect("write");
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    std::os::unix::fs::chown(&planted, Some(NOBODY), Some(NOBODY)).expect("chown");
    let ours = timeout(Duration::from_secs(20), run("planted").output())
        .await
        .expect("exits")
        .expect("runs");
    refused(ours, "another user could block this election");
}
