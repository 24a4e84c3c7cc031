//! End to end: several real `leader run` processes per lock (file, Postgres, MySQL, Redis, etcd, Consul
//! on the test Consul server, S3 and DynamoDB on moto's server), each running the `job` binary
//! as COMMAND. Exactly one job runs at a time; a SIGTERM hands over within a retry period (on
//! object storage and DynamoDB, whose followers poll, by their next poll); a SIGKILL of
//! `leader` kills its job and hands over within a lease and three retry periods (the bound
//! asserted for every lock, Consul's included); fencing tokens grow; exit codes are as
//! documented.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use leader_tests::harness::campaign::process_gone;
use leader_tests::{
    TermEvent as Event, now_ns as now, nth_start, on_each_backend, term_events as events,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout};

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");
const JOB: &str = env!("CARGO_BIN_EXE_job");
const LEASE: Duration = Duration::from_secs(4);
const RENEW: Duration = Duration::from_secs(3);
const RETRY: Duration = Duration::from_secs(1);

fn leader(lock: &str, name: &str, identity: &str, log: &Path) -> Child {
    leader_with(lock, name, identity, log, &[])
}

fn leader_with(lock: &str, name: &str, identity: &str, log: &Path, extra: &[&str]) -> Child {
    leader_command(lock, name, identity, log, extra)
        .spawn()
        .expect("spawn leader")
}

fn leader_command(lock: &str, name: &str, identity: &str, log: &Path, extra: &[&str]) -> Command {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let mut command = leader_tests::candidate_command(LEADER, "run", lock, name, identity);
    command
        .args([
            "--lease-duration",
            &ms(LEASE),
            "--renew-deadline",
            &ms(RENEW),
            "--retry-period",
            &ms(RETRY),
        ])
        .args(extra)
        .args(["--", JOB])
        // For the object storage and DynamoDB locks: moto's server, wherever the test S3
        // and DynamoDB servers are.
        .envs(object_store_env())
        .envs(leader_test_support::dynamodb_env())
        .env("JOB_LOG", log)
        .env(
            "RUST_LOG",
            std::env::var("E2E_LOG").unwrap_or_else(|_| "warn".into()),
        );
    command
}

/// The environment of a `leader` process for the test S3 server.
fn object_store_env() -> Vec<(String, String)> {
    leader_test_support::s3_env_at(&leader_test_support::s3_endpoint())
}

/// An `s3://` lock URL on the test S3 server's bucket with a prefix of its own, or `None` (a
/// skip; a failure under CI) without one.
fn s3_lock(what: &str) -> Option<String> {
    let bucket = leader_test_support::s3_bucket_or_skip()?;
    Some(format!("s3://{bucket}/{what}-{:08x}/", fastrand::u32(..)))
}

/// The jobs of a log that went without a `stop` line (SIGKILLed by their `leader` after the grace
/// or by its watchdog), marked when seen gone, as the fault harness marks them: watched from
/// before the first `leader` starts, until dropped.
struct Gone {
    marks: Arc<std::sync::Mutex<leader_tests::harness::checker::Marks>>,
    watcher: tokio::task::JoinHandle<()>,
}

impl Gone {
    fn watch(log: &Path) -> Self {
        let marks = Arc::default();
        let watcher =
            leader_tests::harness::campaign::watch_commands(log.to_path_buf(), Arc::clone(&marks));
        Self { marks, watcher }
    }
}

impl Drop for Gone {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// Exactly one job at a time, by the fault harness's checker: each start comes after the
/// previous job stopped (or, for a job whose `leader` was killed, after that kill; for a job
/// that went without a `stop` line, after `gone` saw it gone), and fencing tokens grow. The
/// last job may still run.
fn assert_one_at_a_time(log: &Path, killed: &[(String, i128)], gone: &Gone) {
    use leader_tests::harness::checker::{self, Marks};
    let events = events(log);
    // A kill ends the term its identity last started before it.
    let killed: Marks = killed
        .iter()
        .filter_map(|(identity, at)| {
            let term = events
                .iter()
                .rev()
                .find(|e| e.start && e.identity == *identity && e.at < *at)?;
            Some(((identity.clone(), term.token), *at))
        })
        .collect();
    let seen_gone = gone
        .marks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let mut terms = checker::terms_seen(&events, &killed, &Marks::new(), &seen_gone);
    if let Some(last) = terms.last_mut() {
        last.end.get_or_insert_with(now);
    }
    let (overlaps, violations) = checker::check(&terms);
    assert!(
        overlaps == 0 && violations.is_empty(),
        "{violations:?}: {events:?}"
    );
}

fn pid(child: &Child) -> Pid {
    Pid::from_raw(child.id().expect("running").cast_signed())
}

async fn handovers(lock: &str) {
    handovers_within(lock, LEASE + RETRY * 3).await;
}

/// [`handovers`], for a lock whose holder, once killed, is let go by the server within
/// `failover_bound` of the kill rather than within the lease.
///
/// The handover after a SIGTERM is asserted to be a handover: the next job starts before a
/// follower could have waited the lease out (the holder renews every retry period until it
/// releases, so waiting it out takes at least the lease less a retry period), with room for
/// a loaded machine. How fast a handover is (a retry period, or a notification's time) is
/// measured in BENCHMARKS.md, not asserted here.
async fn handovers_within(lock: &str, failover_bound: Duration) {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let gone = Gone::watch(&log);
    let name = format!("e2e-{:08x}", std::process::id() ^ (now() as u32));
    let identities = ["one", "two", "three"];
    let mut leaders: Vec<Child> = identities
        .iter()
        .map(|id| leader(lock, &name, id, &log))
        .collect();

    let first = nth_start(&log, 1, Duration::from_secs(15)).await;
    sleep(LEASE).await; // nobody else starts meanwhile

    // SIGTERM: COMMAND stops, the lease is released, another job starts within a retry period.
    let index = identities
        .iter()
        .position(|id| *id == first.identity)
        .expect("identity");
    let sent = now();
    kill(pid(&leaders[index]), Signal::SIGTERM).expect("SIGTERM");
    let second = nth_start(&log, 2, Duration::from_secs(10)).await;
    let status = timeout(Duration::from_secs(10), leaders[index].wait())
        .await
        .expect("exits")
        .expect("status");
    assert_eq!(status.code(), Some(0), "leader after SIGTERM");
    let handover = Duration::from_nanos((second.at - sent) as u64);
    eprintln!("{lock}: handover after SIGTERM took {handover:?}");
    assert!(
        handover < LEASE - RETRY,
        "handover after SIGTERM took {handover:?}: was the lease waited out?"
    );

    // SIGKILL of `leader`: its job dies with it; another starts within lease + retry.
    sleep(RETRY).await;
    let index = identities
        .iter()
        .position(|id| *id == second.identity)
        .expect("identity");
    let killed_at = now();
    kill(pid(&leaders[index]), Signal::SIGKILL).expect("SIGKILL");
    let third = nth_start(&log, 3, failover_bound + Duration::from_secs(2)).await;
    let failover = Duration::from_nanos((third.at - killed_at) as u64);
    eprintln!("{lock}: failover after SIGKILL took {failover:?}");
    assert!(
        failover < failover_bound,
        "failover after SIGKILL took {failover:?}"
    );
    assert_ne!(third.identity, second.identity);

    for child in &mut leaders {
        if let Ok(None) = child.try_wait() {
            let _ = kill(pid(child), Signal::SIGTERM);
            let _ = timeout(Duration::from_secs(10), child.wait()).await;
        }
    }
    assert_one_at_a_time(&log, &[(second.identity.clone(), killed_at)], &gone);
    assert!(first.token < second.token && second.token < third.token);
}

on_each_backend!(handovers:
    file_lock_one_job_at_a_time_and_handovers => Some(leader_tests::FileLock::in_temp_dir()),
    postgres_lock_one_job_at_a_time_and_handovers => leader_test_support::postgres_lock_or_skip(),
    redis_lock_one_job_at_a_time_and_handovers => leader_test_support::redis_lock_or_skip(),
    etcd_lock_one_job_at_a_time_and_handovers => leader_test_support::etcd_lock_or_skip(),
    // A release reaches the followers through their KV watch; a kill is waited out on their
    // own clocks, a lease from the last renewal they saw.
    nats_lock_one_job_at_a_time_and_handovers => leader_test_support::nats_lock_or_skip(),
    // A release deletes the record znode, which the followers' persistent watch reports; a
    // killed holder's session outlives it (30 s), so its lease is waited out on the
    // followers' clocks and taken over by deleting its record znode.
    zookeeper_lock_one_job_at_a_time_and_handovers => leader_test_support::zookeeper_lock_or_skip(),
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_get_lock_one_job_at_a_time_and_handovers() {
    let Some(url) = leader_test_support::mysql_lock_or_skip() else {
        return;
    };
    // Followers wait in GET_LOCK: a release reaches them at once. A killed leader's session
    // ends with it, and its lease runs out by the server's clock.
    let separator = if url.contains('?') { '&' } else { '?' };
    handovers(&format!("{url}{separator}lock=named")).await;
}

/// Consul, on the test Consul server: the holder writes its renewal key at every renewal, so a
/// killed holder is replaced within a lease and a jittered retry period, under the bound every
/// lock is given here (it was two session TTLs of at least 10 s each, 20 s here, before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consul_lock_one_job_at_a_time_and_handovers() {
    let server = leader_test_support::consul_api::ConsulApiServer::start().await;
    let lock = format!("consul://{}/e2e/", server.address());
    handovers(&lock).await;
    // The killed holder's session was destroyed by the one that took over; the others' went
    // with their release on exit.
    assert_eq!(server.sessions(), 0, "{:?}", server.requests());
}

/// [`handovers`] on a lock whose followers poll: a killed holder is replaced within a lease
/// and three retry periods.
async fn polled_handovers(lock: &str) {
    handovers_within(lock, LEASE + RETRY * 3).await;
}

on_each_backend!(polled_handovers:
    /// Followers poll (the server has no notifications): a release is seen at the next retry,
    /// a jittered retry period away.
    mysql_lock_one_job_at_a_time_and_handovers => leader_test_support::mysql_lock_or_skip(),
    /// Object storage, on moto's S3 server: followers poll, so a release is seen at the next
    /// poll (a retry period with client-go's jitter of 1.2: 1.0 to 2.2 retry periods apart),
    /// and a killed holder's lease is taken a lease after a follower's first read of its last
    /// renewal.
    object_store_lock_one_job_at_a_time_and_handovers => s3_lock("e2e"),
    /// DynamoDB, on moto's server: followers poll (a condition cannot wait), so a release is
    /// seen at the next poll, and a killed holder's lease is taken a lease after a follower's
    /// first read of its last renewal, on the follower's own clock.
    dynamodb_lock_one_job_at_a_time_and_handovers => leader_test_support::dynamodb_lock_or_skip("e2e"),
);

/// Coordinated leader election with real processes: the test API server runs the coordinator,
/// `leader run` replicas take part with `kubernetes://default?binary_version=V`, beside a plain
/// one. The oldest version leads (were the plain replica first, it is asked to step down); during a
/// rolling upgrade the old version keeps leading until it stops, then the new one leads. One
/// job at a time throughout, fencing tokens growing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_coordinated_rolling_upgrade() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let gone = Gone::watch(&log);
    let (_server, kubeconfig) =
        kube_api_server(dir.path(), &["--coordinated-leader-election"]).await;
    let start = |lock: &str, identity: &str| {
        leader_command(lock, "rolling", identity, &log, &[])
            .env("KUBECONFIG", &kubeconfig)
            .spawn()
            .expect("spawn leader")
    };
    // Waits until `identity`'s job is the last one started.
    let runs = |identity: &'static str| {
        let log = log.clone();
        async move {
            timeout(Duration::from_secs(30), async {
                loop {
                    let last = events(&log).into_iter().rev().find(|e| e.start);
                    if last.is_some_and(|e| e.identity == identity) {
                        return;
                    }
                    sleep(Duration::from_millis(20)).await;
                }
            })
            .await
            .unwrap_or_else(|_| panic!("{identity} does not lead: {:?}", events(&log)));
        }
    };
    let old_version = "kubernetes://default?binary_version=1.1.0";
    let new_version = "kubernetes://default?binary_version=1.2.0";
    let mut old = start(old_version, "old");
    let mut plain = start("kubernetes://default", "plain");
    runs("old").await;

    let mut new = start(new_version, "new");
    // Two of the coordinator's rounds: the old version keeps leading.
    sleep(Duration::from_secs(10)).await;
    let last = events(&log).into_iter().rev().find(|e| e.start);
    assert_eq!(last.map(|e| e.identity), Some("old".to_owned()));

    kill(pid(&old), Signal::SIGTERM).expect("SIGTERM");
    let status = timeout(Duration::from_secs(10), old.wait())
        .await
        .expect("exits")
        .expect("status");
    assert_eq!(status.code(), Some(0));
    runs("new").await;

    for child in [&mut new, &mut plain] {
        let _ = kill(pid(child), Signal::SIGTERM);
        let _ = timeout(Duration::from_secs(10), child.wait()).await;
    }
    assert_one_at_a_time(&log, &[], &gone);
    eprintln!("jobs: {:?}", events(&log));
}

/// The test Kubernetes API server as a process (`kube-api-server` with `args`), writing its
/// kubeconfig into `dir`; the process and the kubeconfig's path.
async fn kube_api_server(dir: &Path, args: &[&str]) -> (Child, std::path::PathBuf) {
    const API_SERVER: &str = env!("CARGO_BIN_EXE_kube-api-e2e");
    let server = leader_tests::KubeApiProcess::start(API_SERVER, dir, args).await;
    (server.child, server.kubeconfig)
}

/// `leader handover` with these arguments; its exit code.
async fn handover(lock: &str, name: &str, args: &[&str]) -> Option<i32> {
    handover_in(lock, name, args, &[]).await
}

/// [`handover`] with `env` in the command's environment.
async fn handover_in(lock: &str, name: &str, args: &[&str], env: &[(&str, &str)]) -> Option<i32> {
    let output = Command::new(LEADER)
        .args(["handover", "--lock", lock, "--name", name])
        .args(args)
        .envs(object_store_env())
        .envs(leader_test_support::dynamodb_env())
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("leader handover");
    output.status.code()
}

/// Planned handovers: three replicas, each started with `--handover-to` the next one; `leader
/// handover --to F --wait` to each follower in turn, then a SIGTERM to the leader, which hands
/// over to the replica it names. Each time the named replica's job is the next to start, soon,
/// and never beside another.
async fn planned_handovers(lock: &str) -> Vec<Duration> {
    planned_handovers_in(lock, &[]).await
}

/// [`planned_handovers`] with `env` in the environment of every `leader` process.
async fn planned_handovers_in(lock: &str, env: &[(&str, &str)]) -> Vec<Duration> {
    let handover = |lock, name, args| handover_in(lock, name, args, env);
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let gone = Gone::watch(&log);
    let name = format!("planned-{:08x}", std::process::id() ^ (now() as u32));
    let identities = ["one", "two", "three"];
    assert_eq!(
        handover(lock, &name, &["--to", "two"]).await,
        Some(6),
        "nothing to hand over before anyone ran"
    );
    let mut leaders: Vec<Child> = identities
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let next = identities[(i + 1) % identities.len()];
            leader_command(lock, &name, id, &log, &["--handover-to", next])
                .envs(env.iter().copied())
                .spawn()
                .expect("spawn leader")
        })
        .collect();
    let mut current = nth_start(&log, 1, Duration::from_secs(15)).await;
    let mut starts = 1;
    let mut took = Vec::new();
    for _ in 0..2 {
        sleep(RETRY).await;
        let at = identities
            .iter()
            .position(|id| *id == current.identity)
            .expect("identity");
        for step in 1..identities.len() {
            let target = identities[(at + step) % identities.len()];
            let asked = now();
            assert_eq!(
                handover_in(
                    lock,
                    &name,
                    &["--to", target, "--wait", "--timeout", "20s"],
                    env
                )
                .await,
                Some(0),
                "leader handover --to {target} --wait"
            );
            starts += 1;
            let next = nth_start(&log, starts, Duration::from_secs(5)).await;
            assert_eq!(next.identity, target, "{:?}", events(&log));
            took.push(Duration::from_nanos((next.at - asked) as u64));
            current = next;
            sleep(RETRY).await;
        }
    }
    // SIGTERM to a leader started with --handover-to: the replica it names leads next.
    let at = identities
        .iter()
        .position(|id| *id == current.identity)
        .expect("identity");
    let named = identities[(at + 1) % identities.len()];
    let sent = now();
    kill(pid(&leaders[at]), Signal::SIGTERM).expect("SIGTERM");
    let status = timeout(Duration::from_secs(10), leaders[at].wait())
        .await
        .expect("exits")
        .expect("status");
    assert_eq!(
        status.code(),
        Some(0),
        "leader after SIGTERM with --handover-to"
    );
    starts += 1;
    let next = nth_start(&log, starts, Duration::from_secs(5)).await;
    assert_eq!(next.identity, named, "{:?}", events(&log));
    took.push(Duration::from_nanos((next.at - sent) as u64));
    for child in &mut leaders {
        if let Ok(None) = child.try_wait() {
            let _ = kill(pid(child), Signal::SIGTERM);
            let _ = timeout(Duration::from_secs(10), child.wait()).await;
        }
    }
    assert_one_at_a_time(&log, &[], &gone);
    eprintln!("{lock}: from the handover request to the named replica's job: {took:?}");
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_lock_planned_handovers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    planned_handovers(&lock).await;
    // A named replica that never comes: `--wait` gives up with exit 7 at its timeout.
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let lock = leader_tests::file_lock_in(dir.path());
    let mut one = leader(&lock, "ghost", "one", &log);
    nth_start(&log, 1, Duration::from_secs(15)).await;
    assert_eq!(
        handover(
            &lock,
            "ghost",
            &["--to", "gone", "--wait", "--timeout", "2s"]
        )
        .await,
        Some(7)
    );
    let _ = kill(pid(&one), Signal::SIGTERM);
    let _ = timeout(Duration::from_secs(10), one.wait()).await;
}

/// Kubernetes, on the test API server as a stock cluster runs (the CoordinatedLeaderElection
/// gate off, so the API server drops `spec.preferredHolder`): `leader handover --wait` ends
/// with the named replica leading.
/// `leader handover --withdraw`: a request naming a replica that never comes keeps the lease
/// free for it (everyone else stands back a lease); withdrawn, the leader that released it
/// takes it again at once. Nothing to withdraw is no error; no election is exit 6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_request_can_be_withdrawn() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let log = dir.path().join("jobs.log");
    assert_eq!(handover(&lock, "withdrawn", &["--withdraw"]).await, Some(6));
    let mut replica = leader(&lock, "withdrawn", "only", &log);
    nth_start(&log, 1, Duration::from_secs(15)).await;
    assert_eq!(
        handover(&lock, "withdrawn", &["--to", "ghost"]).await,
        Some(0)
    );
    // The job stops: the lease is released, reserved for the replica named.
    timeout(Duration::from_secs(10), async {
        while events(&log).len() < 2 {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the job stops for the handover");
    let withdrawn = now();
    assert_eq!(handover(&lock, "withdrawn", &["--withdraw"]).await, Some(0));
    let again = nth_start(&log, 2, LEASE).await;
    let took = Duration::from_nanos(u64::try_from(again.at - withdrawn).unwrap_or(0));
    assert!(
        took < RETRY * 3,
        "took the lease again {took:?} after the withdrawal"
    );
    assert_eq!(handover(&lock, "withdrawn", &["--withdraw"]).await, Some(0));
    let _ = kill(pid(&replica), Signal::SIGTERM);
    let _ = timeout(Duration::from_secs(10), replica.wait()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_lock_planned_handovers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_server, kubeconfig) = kube_api_server(dir.path(), &[]).await;
    let kubeconfig = kubeconfig.display().to_string();
    planned_handovers_in("kubernetes://default", &[("KUBECONFIG", &kubeconfig)]).await;
    // A Lease name the API server would refuse is refused at start (exit 3), naming the rule,
    // instead of an invalid record retried forever.
    let refused = Command::new(LEADER)
        .args([
            "run",
            "--lock",
            "kubernetes://default",
            "--name",
            "nightly_cleanup",
        ])
        .args(["--", "true"])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .await
        .expect("leader run");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("DNS-1123 subdomain") && stderr.contains("nightly-cleanup"),
        "{stderr}"
    );
}

on_each_backend!(planned_handovers:
    postgres_lock_planned_handovers => leader_test_support::postgres_lock_or_skip(),
    redis_lock_planned_handovers => leader_test_support::redis_lock_or_skip(),
    zookeeper_lock_planned_handovers => leader_test_support::zookeeper_lock_or_skip(),
    etcd_lock_planned_handovers => leader_test_support::etcd_lock_or_skip(),
    object_store_lock_planned_handovers => s3_lock("planned"),
    dynamodb_lock_planned_handovers => leader_test_support::dynamodb_lock_or_skip("planned"),
);

/// An S3 endpoint that answers every request `200` with an ETag, and so writes whatever its
/// preconditions say: the `leader` command refuses it at start, with exit code 3, before it
/// writes a record.
#[tokio::test]
async fn an_object_store_that_ignores_preconditions_is_refused_with_exit_3() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut buffer = [0u8; 8192];
            let n = stream.read(&mut buffer).unwrap_or(0);
            let head = String::from_utf8_lossy(&buffer[..n]).into_owned();
            seen.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(head.lines().next().unwrap_or_default().to_owned());
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\nETag: \"x\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            );
        }
    });
    let lock = "s3://lax-bucket/jobs/";
    let mut command = Command::new(LEADER);
    command
        .args(["run", "--lock", lock, "--name", "lax", "--", "true"])
        .envs(leader_test_support::s3_env_at(&format!("http://{addr}")))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let output = timeout(Duration::from_secs(20), command.output())
        .await
        .expect("exits")
        .expect("output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("precondition"), "{stderr}");
    let requests = requests
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    assert!(
        requests
            .iter()
            .all(|r| r.starts_with("PUT /lax-bucket/jobs/.leader-conditional-write-check")),
        "only the check was written: {requests:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consul_lock_planned_handovers() {
    let server = leader_test_support::consul_api::ConsulApiServer::start().await;
    planned_handovers(&format!("consul://{}/planned/", server.address())).await;
}

/// A reader that goes away (`leader status | head -0`) ends a report quietly, by SIGPIPE as it
/// ends `ls`: no panic on the failed write, and no exit code of a crash (101).
#[tokio::test]
async fn a_report_to_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let lock = leader_tests::FileLock::in_temp_dir();
    for json in [false, true] {
        let (read, write) = nix::unistd::pipe().expect("pipe");
        drop(read);
        let mut command = Command::new(LEADER);
        command.args(["status", "--lock", &lock, "--name", "jobs"]);
        if json {
            command.arg("--json");
        }
        // Spawned, not `output()`, which would capture stdout instead of the closed pipe.
        let child = command
            .stdout(Stdio::from(write))
            .stderr(Stdio::piped())
            .spawn()
            .expect("runs");
        let output = timeout(Duration::from_secs(30), child.wait_with_output())
            .await
            .expect("exits")
            .expect("waits");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "json={json}: {stderr}");
        assert_eq!(
            output.status.signal(),
            Some(Signal::SIGPIPE as i32),
            "json={json}: {:?} {stderr}",
            output.status
        );
    }
}

async fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> ExitStatus {
    let mut command = Command::new(LEADER);
    command
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = timeout(Duration::from_secs(30), command.output())
        .await
        .expect("exits")
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("leader {args:?}: {stderr}");
    output.status
}

/// What `leader status --json` says of election `name` on `lock`, and whether it exited 0.
async fn status_json(lock: &str, name: &str) -> (String, bool) {
    let output = Command::new(LEADER)
        .args(["status", "--lock", lock, "--name", name, "--json"])
        .output()
        .await
        .expect("status");
    let json = String::from_utf8_lossy(&output.stdout).into_owned();
    (json, output.status.success())
}

#[tokio::test]
async fn the_exit_code_of_command_is_passed_through() {
    let lock = leader_tests::FileLock::in_temp_dir();
    let status = run_to_end(
        &["run", "--lock", &lock, "--name", "exit", "--", JOB],
        &[("JOB_EXIT", "7")],
    )
    .await;
    assert_eq!(status.code(), Some(7));
    // The lease was released on the way out.
    let (json, _) = status_json(&lock, "exit").await;
    assert!(
        json.contains(r#""holder":null"#) && json.contains(r#""leaderTransitions":1"#),
        "{json}"
    );
}

/// The parent of process `pid` (COMMAND's: its supervisor), from `/proc/PID/stat`: the fourth
/// field, the second after the command's name.
fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
        .expect("the parent's pid")
}

/// The pid a shell wrote to `path`, waited for.
async fn pid_in(path: &Path) -> i32 {
    let started = tokio::time::Instant::now();
    loop {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            return pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no pid in {path:?}"
        );
        sleep(Duration::from_millis(20)).await;
    }
}

/// COMMAND exits by itself and leaves a process running in the background: `leader` stops it
/// (SIGTERM, and SIGKILL after `--grace` for one that ignores SIGTERM) before it releases the
/// lease and exits with COMMAND's code, so that nothing of this term runs beside the next
/// leader's COMMAND.
#[tokio::test]
async fn what_command_left_running_is_stopped_before_the_release() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let grace = Duration::from_secs(2);
    for (case, ignore) in [("stops", ""), ("ignores-sigterm", "trap \"\" TERM; ")] {
        let pidfile = dir.path().join(format!("{case}.pid"));
        // The background process writes its pid once it ignores SIGTERM, and COMMAND exits
        // only then: a SIGTERM that came between the fork and the `trap` would end it.
        let pid = pidfile.display();
        let script = format!(
            "sh -c '{ignore}echo $$ > {pid}; exec sleep 300' & \
             while [ ! -s {pid} ]; do sleep 0.01; done; exit 3"
        );
        let started = tokio::time::Instant::now();
        let status = run_to_end(
            &[
                "run", "--lock", &lock, "--name", case, "--grace", "2s", "--",
            ]
            .into_iter()
            .chain(["sh", "-c", &script])
            .collect::<Vec<_>>(),
            &[],
        )
        .await;
        let took = started.elapsed();
        assert_eq!(status.code(), Some(3), "{case}");
        let pid = pid_in(&pidfile).await;
        assert!(
            process_gone(pid),
            "{case}: COMMAND's background process outlived leader"
        );
        if case == "ignores-sigterm" {
            assert!(took >= grace, "{case}: killed before its grace: {took:?}");
        }
        let (json, _) = status_json(&lock, case).await;
        assert!(json.contains(r#""holder":null"#), "{case}: {json}");
    }
}

/// `leader run --grace 4s` as the only replica of election `name`, its COMMAND `command` made
/// around `program` (a shell loop that writes its pid and, on SIGTERM, runs `on_term`, then
/// leaves a file behind), sent SIGTERM once `program` runs: `program`'s pid, once `leader`
/// exited, and whether `program` finished its shutdown.
async fn stopped_by_sigterm(
    name: &str,
    on_term: &str,
    command: impl FnOnce(String) -> Vec<String>,
) -> (i32, bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let (ready, finished) = (dir.path().join("ready"), dir.path().join("finished"));
    let program = format!(
        "trap '{on_term} touch {}; exit 0' TERM; echo $$ > {}; while :; do sleep 0.1; done",
        finished.display(),
        ready.display()
    );
    // The default lease and renew deadline (15 s, 10 s) allow a grace of up to 4 s.
    let mut leader = leader_tests::candidate_command(LEADER, "run", &lock, name, "solo")
        .args(["--grace", "4s", "--"])
        .args(command(program))
        .spawn()
        .expect("spawn");
    let program_pid = pid_in(&ready).await;
    kill(pid(&leader), Signal::SIGTERM).expect("SIGTERM");
    timeout(Duration::from_secs(20), leader.wait())
        .await
        .expect("leader exits")
        .expect("status");
    (program_pid, finished.exists())
}

/// The grace covers COMMAND's whole group: a wrapper script that SIGTERM ends at once leaves
/// the program it started (not with `exec`) the grace to finish its own shutdown, instead of a
/// SIGKILL as soon as the wrapper is gone.
#[tokio::test]
async fn the_grace_covers_what_a_wrapper_started() {
    // The inner shell's trap runs after the foreground `sleep` it waits for (which the group's
    // SIGTERM ends too), and takes a second to finish.
    let (program_pid, finished) = stopped_by_sigterm("wrapped", "sleep 1;", |program| {
        vec![
            "sh".to_owned(),
            "-c".to_owned(),
            format!("sh -c \"{program}\"; true"),
        ]
    })
    .await;
    assert!(
        finished,
        "the program the wrapper started was killed before it finished its shutdown"
    );
    assert!(process_gone(program_pid));
}

/// A COMMAND that makes a process group of its own (GNU `timeout`, a shell with job control)
/// is beyond the SIGTERM `leader` sends its supervisor's group: the supervisor passes it on, so
/// the program `timeout` runs finishes its shutdown within the grace, instead of being left
/// running when `timeout` dies of the SIGKILL after it.
#[tokio::test]
async fn a_command_in_a_group_of_its_own_gets_the_sigterm() {
    let (program_pid, finished) = stopped_by_sigterm("grouped", "", |program| {
        ["timeout", "300", "sh", "-c", &program]
            .map(str::to_owned)
            .to_vec()
    })
    .await;
    let gone = process_gone(program_pid);
    if !gone {
        let _ = kill(Pid::from_raw(program_pid), Signal::SIGKILL);
    }
    assert!(finished, "the program under timeout never got the SIGTERM");
    assert!(gone, "the program under timeout outlived leader");
}

/// `leader run` as the only replica of election `name`, on a file lock in `dir`, with `args`,
/// running a COMMAND that ignores the signals `traps` and loops until killed: the lock, `leader`
/// and COMMAND's pid, once COMMAND runs.
async fn solo_looping(dir: &Path, name: &str, traps: &str, args: &[&str]) -> (String, Child, i32) {
    let lock = leader_tests::file_lock_in(dir);
    let ready = dir.join(format!("{name}.ready"));
    let program = format!(
        "trap '' {traps}; echo $$ > {}; while :; do sleep 0.1; done",
        ready.display()
    );
    let leader = leader_tests::candidate_command(LEADER, "run", &lock, name, "solo")
        .args(args)
        .args(["--", "sh", "-c", &program])
        .spawn()
        .expect("spawn");
    let program_pid = pid_in(&ready).await;
    (lock, leader, program_pid)
}

/// A second SIGTERM while `leader` waits out COMMAND's grace (a second Ctrl-C, an impatient
/// supervisor) ends the grace: COMMAND, which ignores SIGTERM, is killed at once, and `leader`
/// releases the lease and exits, a minute before the grace would have ended. A SIGHUP (which
/// systemd sends right after its SIGTERM) does not.
#[tokio::test]
async fn a_second_signal_ends_the_grace() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A lease long enough for a grace of a minute (at most 80% of lease less renew deadline).
    let (lock, mut leader, program_pid) = solo_looping(
        dir.path(),
        "impatient",
        "TERM",
        &[
            "--lease-duration",
            "100s",
            "--renew-deadline",
            "20s",
            "--grace",
            "60s",
        ],
    )
    .await;
    kill(pid(&leader), Signal::SIGTERM).expect("SIGTERM");
    // systemd's SIGHUP that follows its SIGTERM is no hurry.
    kill(pid(&leader), Signal::SIGHUP).expect("SIGHUP");
    sleep(Duration::from_millis(500)).await;
    assert!(
        !process_gone(program_pid),
        "COMMAND, which ignores SIGTERM, did not get its grace"
    );
    let second = tokio::time::Instant::now();
    kill(pid(&leader), Signal::SIGTERM).expect("a second SIGTERM");
    let status = timeout(Duration::from_secs(30), leader.wait())
        .await
        .expect("leader exits well within the grace")
        .expect("status");
    assert!(process_gone(program_pid), "COMMAND outlived leader");
    eprintln!(
        "leader exited {:?} after the second signal: {status}",
        second.elapsed()
    );
    let (json, _) = status_json(&lock, "impatient").await;
    assert!(json.contains(r#""holder":null"#), "not released: {json}");
}

/// Signals sent to every process of a unit (systemd's `SendSIGHUP=yes` after its SIGTERM,
/// `systemctl kill -s USR1` to make a program reopen its logs) reach COMMAND's supervisor too:
/// it stays, and COMMAND with it, while `leader` lives. A supervisor that SIGHUP ended killed
/// COMMAND without its grace; one that SIGUSR1 ended left what COMMAND started running.
#[tokio::test]
async fn the_supervisor_outlives_signals_sent_to_every_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (lock, mut leader, program_pid) =
        solo_looping(dir.path(), "signalled", "HUP USR1 USR2 INT QUIT", &[]).await;
    let supervisor = parent_of(program_pid);
    assert_ne!(
        supervisor,
        pid(&leader).as_raw(),
        "COMMAND runs under a supervisor"
    );
    for signal in [
        Signal::SIGHUP,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGINT,
        Signal::SIGQUIT,
    ] {
        kill(Pid::from_raw(supervisor), signal).expect("a signal to the supervisor");
    }
    sleep(Duration::from_millis(500)).await;
    assert!(!process_gone(supervisor), "the supervisor died of a signal");
    assert!(
        !process_gone(program_pid),
        "COMMAND died with its supervisor"
    );
    kill(pid(&leader), Signal::SIGTERM).expect("SIGTERM");
    let status = timeout(Duration::from_secs(30), leader.wait())
        .await
        .expect("leader stops")
        .expect("status");
    assert!(
        process_gone(program_pid),
        "COMMAND outlived leader: {status}"
    );
    let (json, _) = status_json(&lock, "signalled").await;
    assert!(json.contains(r#""holder":null"#), "not released: {json}");
}

/// `leader` stopped alone (SIGSTOP, a debugger that attached), with COMMAND running: nothing
/// renews and nothing stops COMMAND from `leader`, but its supervisor, told of every renewal,
/// kills the group within the lease of the last renewal, before another replica may lead.
/// Resumed, `leader` reads the kill as its term's end, not as COMMAND's exit, and leads again.
#[tokio::test]
async fn a_stopped_leaders_command_is_killed_by_its_supervisor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let timings = [
        "--lease-duration",
        "3s",
        "--renew-deadline",
        "2s",
        "--retry-period",
        "500ms",
        "--grace",
        "200ms",
    ];
    let (_lock, mut leader, program_pid) =
        solo_looping(dir.path(), "stopped", "TERM", &timings).await;
    kill(pid(&leader), Signal::SIGSTOP).expect("SIGSTOP");
    let stopped = tokio::time::Instant::now();
    while !process_gone(program_pid) {
        // The bound is the lease (3 s) since the last renewal, and a margin for a loaded
        // machine; without the supervisor's deadline COMMAND would run for as long as
        // `leader` stays stopped.
        assert!(
            stopped.elapsed() < Duration::from_secs(15),
            "COMMAND ran on beside a stopped leader"
        );
        sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "COMMAND killed {:?} after leader stopped",
        stopped.elapsed()
    );
    let ready = dir.path().join("stopped.ready");
    std::fs::remove_file(&ready).expect("the first pid");
    kill(pid(&leader), Signal::SIGCONT).expect("SIGCONT");
    // It goes on, and leads again: a new COMMAND.
    let again = pid_in(&ready).await;
    assert_ne!(again, program_pid);
    assert!(
        leader.try_wait().expect("status").is_none(),
        "leader exited after its COMMAND was killed"
    );
    kill(pid(&leader), Signal::SIGTERM).expect("SIGTERM");
    let status = timeout(Duration::from_secs(30), leader.wait())
        .await
        .expect("leader stops")
        .expect("status");
    assert!(process_gone(again), "COMMAND outlived leader: {status}");
}

/// COMMAND's supervisor killed (`kill -9`, the OOM killer): COMMAND dies with it, and what
/// COMMAND started in the background, which nobody would stop, is SIGKILLed by `leader` before
/// it releases the lease.
#[tokio::test]
async fn what_a_killed_supervisor_leaves_is_killed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let (ready, background) = (dir.path().join("ready"), dir.path().join("background"));
    let program = format!(
        "sleep 300 & echo $! > {}; echo $$ > {}; while :; do sleep 0.1; done",
        background.display(),
        ready.display()
    );
    let mut leader = leader_tests::candidate_command(LEADER, "run", &lock, "orphans", "solo")
        .args(["--", "sh", "-c", &program])
        .spawn()
        .expect("spawn");
    let program_pid = pid_in(&ready).await;
    let left = pid_in(&background).await;
    let supervisor = parent_of(program_pid);
    kill(Pid::from_raw(supervisor), Signal::SIGKILL).expect("SIGKILL");
    let status = timeout(Duration::from_secs(30), leader.wait())
        .await
        .expect("leader ends with its COMMAND")
        .expect("status");
    assert!(process_gone(program_pid), "COMMAND outlived its supervisor");
    assert!(
        process_gone(left),
        "what COMMAND started outlived leader: {status}"
    );
}

/// `leader status` reads a record whose lease runs past the calendar's end (another client's
/// "forever") as held and not expired, where the addition of its lease to its renew time
/// overflowed (S8: a record is read, never a reason to crash).
#[tokio::test]
async fn status_reads_a_lease_that_never_ends() {
    use leader_core::{LeaderElectionRecord, ResourceLock};
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = format!("file://{}", dir.path().display());
    let holder = leader_core::FileLock::new(dir.path().join("forever"), "someone");
    let endless = Duration::from_secs(1_000_000_000_000_000);
    holder
        .create(&LeaderElectionRecord::new(
            "someone",
            endless,
            chrono::Utc::now(),
            1,
        ))
        .await
        .expect("create");
    let (json, exited_0) = status_json(&lock, "forever").await;
    assert!(exited_0, "{json}");
    assert!(
        json.contains(r#""holder":"someone""#) && json.contains(r#""expired":false"#),
        "{json}"
    );
}

#[tokio::test]
async fn bad_flags_give_their_exit_codes() {
    let lock = leader_tests::FileLock::in_temp_dir();
    /// `leader run --name x FLAGS -- COMMAND`.
    fn run<'a>(flags: &[&'a str], command: &'a str) -> Vec<&'a str> {
        [&["run", "--name", "x"], flags, &["--", command]].concat()
    }
    for (args, code) in [
        (vec!["run", "--name", "x"], 2),
        (run(&["--lease-duration", "soon"], "true"), 2),
        (run(&["--lease-duration", "5s"], "true"), 2),
        // Past every clock's range: refused, where it once panicked.
        (run(&["--retry-period", "500000000000y"], "true"), 2),
        (run(&["--lease-duration", "2y", "--lock", &lock], "true"), 2),
        (run(&["--lock", "ftp://u:secret@h"], "true"), 3),
        (run(&["--lock", "kubernetes://Bad_Namespace"], "true"), 3),
        (run(&["--lock", "redis://127.0.0.1:1"], "true"), 4),
        (run(&["--lock", &lock], "/no/such/program"), 127),
        (
            vec!["status", "--lock", "file://relative", "--name", "x"],
            3,
        ),
    ] {
        let status = run_to_end(&args, &[]).await;
        assert_eq!(status.code(), Some(code), "{args:?}");
    }
}

/// A SIGHUP (the terminal or ssh session closed) stops `leader` as SIGTERM does: COMMAND is
/// stopped, the lease released, and it exits 0, where the signal's default action killed it
/// holding the lease. Started with SIGHUP ignored (`nohup`), it keeps running.
#[tokio::test]
async fn a_hangup_stops_leader_unless_started_under_nohup() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let log = dir.path().join("jobs.log");
    for (case, nohup) in [("hangup", false), ("nohup", true)] {
        let mut command = if nohup {
            let mut command = Command::new("nohup");
            command.arg(LEADER);
            command
        } else {
            Command::new(LEADER)
        };
        let mut leader = command
            .args(["run", "--lock", &lock, "--name", case, "--", JOB])
            .env("JOB_LOG", &log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .current_dir(dir.path())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn");
        let starts = events(&log).iter().filter(|e| e.start).count();
        nth_start(&log, starts + 1, Duration::from_secs(10)).await;
        kill(pid(&leader), Signal::SIGHUP).expect("SIGHUP");
        let exited = timeout(
            Duration::from_secs(if nohup { 2 } else { 20 }),
            leader.wait(),
        )
        .await;
        if nohup {
            assert!(
                exited.is_err(),
                "{case}: a SIGHUP stopped leader under nohup"
            );
            kill(pid(&leader), Signal::SIGTERM).expect("SIGTERM");
            leader.wait().await.expect("exits");
        } else {
            let status = exited.expect("leader exits").expect("status");
            assert_eq!(status.code(), Some(0), "{case}");
        }
        let events = events(&log);
        assert!(
            !events.last().expect("events").start,
            "{case}: COMMAND was not stopped"
        );
        let (json, _) = status_json(&lock, case).await;
        assert!(json.contains(r#""holder":null"#), "{case}: {json}");
    }
}

#[tokio::test]
async fn once_exits_with_75_when_leadership_is_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("lock");
    let log = dir.path().join("jobs.log");
    let lock = format!("file://{}", path.display());
    let mut child = leader_tests::candidate_command(LEADER, "run", &lock, "once", "solo")
        .args(["--once", "--lease-duration", "4s", "--renew-deadline", "3s"])
        .args(["--retry-period", "200ms", "--", JOB])
        .env("JOB_LOG", &log)
        .spawn()
        .expect("spawn");
    nth_start(&log, 1, Duration::from_secs(10)).await;
    // Someone else takes the record (as after a lease that expired while this one was stalled).
    use leader_core::ResourceLock;
    // The election's own directory under the URL's.
    let intruder = leader_core::FileLock::new(path.join("once"), "intruder");
    let current = intruder.get().await.expect("get").expect("record");
    let mut record = current.record.clone();
    record.holder_identity = "intruder".into();
    record.leader_transitions += 1;
    intruder
        .update(&current.version, &record)
        .await
        .expect("take over");
    let status = timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exits")
        .expect("status");
    assert_eq!(status.code(), Some(75));
    let events = events(&log);
    assert_eq!(events.len(), 2, "the job was stopped: {events:?}");
    assert!(!events[1].start);
}

/// Two `leader run` replicas on `lock` (with `env`); the first leads, and its wall clock
/// (libfaketime) steps back an hour, then forward to an hour ahead, each for two leases (S14).
/// Its job keeps running through both with the same token, and nobody else's starts: no
/// overlap, no change of hands. Then a SIGTERM hands over to the other, with a larger token.
/// On a store that skips identical writes (the Kubernetes API server, Consul), a renewal that
/// repeats the stored bytes after the step back is no renewal, and the other took over while
/// the first still ran its job.
async fn wall_clock_steps(lock: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let Some(faketime) = leader_test_support::faketime_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let offset = dir.path().join("clock-offset");
    std::fs::write(&offset, "+0").expect("offset");
    let gone = Gone::watch(&log);
    let name = format!("clock-{:08x}", fastrand::u32(..));
    let mut stepped = leader_command(lock, &name, "stepped", &log, &[])
        .envs(env.iter().copied())
        .envs(leader_test_support::faketime_env(&faketime, &offset))
        .spawn()
        .expect("spawn leader");
    let first = nth_start(&log, 1, Duration::from_secs(15)).await;
    assert_eq!(first.identity, "stepped");
    let mut steady = leader_command(lock, &name, "steady", &log, &[])
        .envs(env.iter().copied())
        .spawn()
        .expect("spawn leader");
    for step in ["-1h", "+1h"] {
        std::fs::write(&offset, step).expect("step the clock");
        sleep(LEASE * 2 + RETRY).await;
        let starts: Vec<Event> = events(&log).into_iter().filter(|e| e.start).collect();
        assert_eq!(
            starts.len(),
            1,
            "{lock}: the leader's wall clock stepped {step}: another job started: {:?}",
            events(&log)
        );
        assert!(
            matches!(stepped.try_wait(), Ok(None)),
            "{lock}: the leader exited"
        );
    }
    kill(pid(&stepped), Signal::SIGTERM).expect("SIGTERM");
    let second = nth_start(&log, 2, Duration::from_secs(10)).await;
    assert_eq!(second.identity, "steady");
    assert!(second.token > first.token, "{first:?} then {second:?}");
    for child in [&mut stepped, &mut steady] {
        let _ = kill(pid(child), Signal::SIGTERM);
        let _ = timeout(Duration::from_secs(10), child.wait()).await;
    }
    assert_one_at_a_time(&log, &[], &gone);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_lock_wall_clock_steps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_server, kubeconfig) = kube_api_server(dir.path(), &[]).await;
    wall_clock_steps(
        "kubernetes://default",
        &[("KUBECONFIG", kubeconfig.as_os_str())],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consul_lock_wall_clock_steps() {
    let server = leader_test_support::consul_api::ConsulApiServer::start().await;
    wall_clock_steps(&format!("consul://{}/e2e/", server.address()), &[]).await;
}

/// [`wall_clock_steps`] on a lock that needs no more environment.
async fn wall_clock_steps_on(lock: &str) {
    wall_clock_steps(lock, &[]).await;
}

on_each_backend!(wall_clock_steps_on:
    file_lock_wall_clock_steps => Some(leader_tests::FileLock::in_temp_dir()),
    postgres_lock_wall_clock_steps => leader_test_support::postgres_lock_or_skip(),
    /// ZooKeeper moves a znode's version on every write, identical bytes or not; the lock
    /// decides nothing by a wall clock.
    zookeeper_lock_wall_clock_steps => leader_test_support::zookeeper_lock_or_skip(),
);

/// A loopback address with a port nobody listens on.
fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("free port")
        .local_addr()
        .expect("addr")
        .port();
    format!("127.0.0.1:{port}")
}

async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .expect("request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("response");
    response
}

#[tokio::test]
async fn metrics_and_health_are_served() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let lock = leader_tests::file_lock_in(dir.path());
    let addr = free_addr();
    let mut child = Command::new(LEADER)
        .args([
            "run",
            "--lock",
            &lock,
            "--name",
            "metrics",
            "--metrics-addr",
            &addr,
            "--",
            JOB,
        ])
        .env("JOB_LOG", &log)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    nth_start(&log, 1, Duration::from_secs(10)).await;
    let metrics = http_get(&addr, "/metrics").await;
    assert!(
        metrics.starts_with("HTTP/1.0 200") || metrics.starts_with("HTTP/1.1 200"),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"leader_election_master_status{name="metrics"} 1"#),
        "{metrics}"
    );
    let health = http_get(&addr, "/healthz").await;
    assert!(
        health.contains(" 200 ") && health.ends_with("ok"),
        "{health}"
    );
    kill(pid(&child), Signal::SIGTERM).expect("SIGTERM");
    let status = timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exits")
        .expect("status");
    assert_eq!(status.code(), Some(0));
}

/// A loopback port that accepts connections and never answers, like a server hung on a lock.
fn silent_server() -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let thread = std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().take(16).flatten() {
            held.push(stream);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    (addr, thread)
}

/// Start-up checks answer within the request timeout (half the renew deadline for `run`, 5 s for
/// `status`) however a server misbehaves: connecting and the first read share one deadline.
#[tokio::test]
async fn a_server_that_never_answers_gives_exit_4_within_the_request_timeout() {
    let (addr, _server) = silent_server();
    for lock in [
        format!("postgres://postgres:postgres@{addr}/postgres"),
        format!("redis://{addr}"),
        format!("etcd://{addr}"),
        format!("zk://{addr}"),
    ] {
        let started = tokio::time::Instant::now();
        let status = run_to_end(
            &[
                "run",
                "--lock",
                &lock,
                "--name",
                "silent",
                "--renew-deadline",
                "2s",
                "--lease-duration",
                "3s",
                "--retry-period",
                "500ms",
                "--",
                "true",
            ],
            &[],
        )
        .await;
        let took = started.elapsed();
        assert_eq!(status.code(), Some(4), "{lock}");
        assert!(took < Duration::from_secs(3), "{lock}: run took {took:?}");

        let started = tokio::time::Instant::now();
        let status = run_to_end(&["status", "--lock", &lock, "--name", "silent"], &[]).await;
        let took = started.elapsed();
        assert_eq!(status.code(), Some(4), "{lock}");
        assert!(
            took < Duration::from_secs(7),
            "{lock}: status took {took:?}"
        );
    }
}

/// Each documented exit code for a lock that cannot be used or refuses us.
#[tokio::test]
async fn locks_that_cannot_be_used_give_the_documented_exit_codes() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 5: an unreadable record.
    let garbage = dir.path().join("garbage");
    std::fs::create_dir(&garbage).expect("dir");
    std::fs::write(garbage.join("v00000000000000000001.json"), "{oops").expect("write");
    let garbage = format!("file://{}", garbage.display());
    // 126: COMMAND is not executable.
    let not_executable = dir.path().join("not-executable");
    std::fs::write(&not_executable, "#!/bin/sh\n").expect("write");
    let not_executable = not_executable.display().to_string();
    let file = leader_tests::file_lock_in(dir.path());
    let mut cases: Vec<(Vec<String>, u8)> = vec![
        (vec!["run".into(), "--lock".into(), garbage.clone()], 5),
        (vec!["status".into(), "--lock".into(), garbage], 5),
        (
            vec![
                "run".into(),
                "--lock".into(),
                file,
                "--".into(),
                not_executable,
            ],
            126,
        ),
    ];
    // 3: a database that does not exist.
    let database = leader_tests::database_url();
    if let Some((server, _)) = database.rsplit_once('/') {
        let missing = format!("{server}/leader_no_such_database_{:08x}", fastrand::u32(..));
        cases.push((vec!["run".into(), "--lock".into(), missing], 3));
    }
    // 3: an etcd user and password for a server without authentication.
    let endpoints = leader_test_support::etcd_endpoints();
    if let Some(host) = endpoints.first()
        && std::net::TcpStream::connect(host.trim_start_matches("http://")).is_ok()
    {
        let lock = format!(
            "etcd://someone:secret@{}",
            host.trim_start_matches("http://")
        );
        cases.push((vec!["run".into(), "--lock".into(), lock], 3));
    }
    // 5: a Redis fence counter of the wrong type.
    let redis_url = leader_test_support::redis_url();
    if let Ok(client) = redis::Client::open(redis_url.as_str())
        && let Ok(mut conn) = client.get_multiplexed_async_connection().await
    {
        let name = format!("fence-list-{:08x}", fastrand::u32(..));
        let _: () = redis::cmd("RPUSH")
            .arg(format!("leader:{{{name}}}:fence"))
            .arg("x")
            .query_async(&mut conn)
            .await
            .expect("rpush");
        cases.push((
            vec![
                "run".into(),
                "--lock".into(),
                redis_url.clone(),
                "--name".into(),
                name,
            ],
            5,
        ));
    }
    cases.extend(zookeeper_cases().await);
    for (mut args, code) in cases {
        if !args.iter().any(|a| a == "--name") {
            args.splice(1..1, ["--name".to_owned(), "codes".to_owned()]);
        }
        if args[0] == "run" && !args.iter().any(|a| a == "--") {
            args.extend(["--".into(), "true".into()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let status = run_to_end(&args, &[]).await;
        assert_eq!(status.code(), Some(code.into()), "{args:?}");
    }
}

/// The ZooKeeper lock's documented exit codes, when the test ensemble answers: 3 for a chroot
/// that does not exist and for a lease longer than the session the ensemble grants, 4 for an
/// ensemble that is down, 5 for an election whose znodes another digest user owns.
async fn zookeeper_cases() -> Vec<(Vec<String>, u8)> {
    use leader_zookeeper::zookeeper_client as zk;
    let Some(url) = leader_test_support::zookeeper_lock_or_skip() else {
        return Vec::new();
    };
    let ensemble = leader_test_support::zookeeper_ensemble();
    let chroot = leader_test_support::zookeeper_chroot();
    let down = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let owner = zk::Client::connector()
        .with_auth("digest", b"owner:owner-secret")
        .connect(&ensemble)
        .await
        .expect("a session");
    let prefix = format!("{chroot}/codes-{:08x}", fastrand::u32(..));
    // The chroot and the prefix open to all (as the other tests find them, whichever runs
    // first), the election the owner's alone.
    owner
        .mkdir(
            &prefix,
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .expect("a prefix anyone may use");
    owner
        .create(
            &format!("{prefix}/codes"),
            b"",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::creator_all()),
        )
        .await
        .expect("an election only the owner may read");
    let run = |lock: String| vec!["run".to_owned(), "--lock".to_owned(), lock];
    vec![
        (
            run(format!(
                "zk://{ensemble}/leader-no-such-chroot-{:08x}",
                fastrand::u32(..)
            )),
            3,
        ),
        (run(format!("{url}&session_timeout=4s")), 3),
        (run(format!("zk://{down}")), 4),
        (run(format!("zk://{ensemble}?prefix={prefix}")), 5),
        (
            vec![
                "status".to_owned(),
                "--lock".to_owned(),
                format!("zk://someone:wrong@{ensemble}?prefix={prefix}"),
            ],
            5,
        ),
    ]
}

/// The log of shard `shard`'s COMMANDs: `JOB_LOG.SHARD`.
fn shard_log(log: &Path, shard: u32) -> std::path::PathBuf {
    format!("{}.{shard}", log.display()).into()
}

/// The shards whose COMMAND runs on `identity` now (started, not stopped), by the logs
/// `log.0` to `log.{count-1}`.
fn running_shards(log: &Path, count: u32, identity: &str) -> Vec<u32> {
    (0..count)
        .filter(|shard| {
            let events = events(&shard_log(log, *shard));
            events
                .iter()
                .rev()
                .find(|e| e.identity == identity)
                .is_some_and(|e| e.start)
        })
        .collect()
}

async fn wait_for_shares(log: &Path, count: u32, shares: &[(&str, usize)], within: Duration) {
    let ok = timeout(within, async {
        loop {
            if shares
                .iter()
                .all(|(identity, n)| running_shards(log, count, identity).len() == *n)
            {
                return;
            }
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        ok.is_ok(),
        "not {shares:?} within {within:?}: {:?}",
        shares
            .iter()
            .map(|(i, _)| (i, running_shards(log, count, i)))
            .collect::<Vec<_>>()
    );
}

/// `leader run --shards 6` on three replicas: two shards each, one COMMAND per shard; a
/// SIGTERM hands a replica's shards to the others at once (three each), a SIGKILL loses them
/// when their leases run out (six on the last); no shard's COMMAND ever runs twice at once and
/// tokens grow, per shard; a replica started with another count exits with code 11.
async fn shards_split_and_move(lock: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("job.log");
    let name = format!("shards-{:08x}", fastrand::u32(..));
    let count = 6;
    let shards = ["--shards", "6"];
    let gone: Vec<Gone> = (0..count)
        .map(|shard| Gone::watch(&shard_log(&log, shard)))
        .collect();
    let mut replicas: Vec<Child> = ["a", "b", "c"]
        .iter()
        .map(|id| leader_with(lock, &name, id, &log, &shards))
        .collect();
    wait_for_shares(
        &log,
        count,
        &[("a", 2), ("b", 2), ("c", 2)],
        Duration::from_secs(30),
    )
    .await;

    for bad in [
        &["--shards", "0"][..],
        &["--shards", "6", "--handover-to", "a"],
        &["--shards", "6", "--once"],
    ] {
        let mut refused = leader_with(lock, &name, "e", &log, bad);
        let status = timeout(Duration::from_secs(20), refused.wait())
            .await
            .expect("refused at once")
            .expect("status");
        assert_eq!(status.code(), Some(2), "{bad:?}");
    }
    let mut other = leader_with(lock, &name, "d", &log, &["--shards", "7"]);
    let status = timeout(Duration::from_secs(20), other.wait())
        .await
        .expect("a replica with another count exits")
        .expect("status");
    assert_eq!(status.code(), Some(11), "another count");

    let mut c = replicas.pop().expect("c");
    kill(pid(&c), Signal::SIGTERM).expect("SIGTERM");
    let status = timeout(Duration::from_secs(20), c.wait())
        .await
        .expect("c exits")
        .expect("status");
    assert_eq!(status.code(), Some(0), "a replica shut down by SIGTERM");
    // Released, so taken by the next rounds, well within a lease.
    wait_for_shares(&log, count, &[("a", 3), ("b", 3)], LEASE).await;

    let mut b = replicas.pop().expect("b");
    kill(pid(&b), Signal::SIGKILL).expect("SIGKILL");
    let killed = now();
    let _ = b.wait().await;
    wait_for_shares(&log, count, &[("a", 6)], LEASE * 3 + RETRY * 4).await;

    let mut a = replicas.pop().expect("a");
    kill(pid(&a), Signal::SIGTERM).expect("SIGTERM");
    let _ = timeout(Duration::from_secs(20), a.wait()).await;
    for (shard, gone) in gone.iter().enumerate() {
        assert_one_at_a_time(
            &shard_log(&log, shard as u32),
            &[("b".into(), killed)],
            gone,
        );
    }
}

on_each_backend!(shards_split_and_move:
    file_lock_shards_split_and_move => Some(leader_tests::FileLock::in_temp_dir()),
    postgres_lock_shards_split_and_move => leader_test_support::postgres_lock_or_skip(),
    redis_lock_shards_split_and_move => leader_test_support::redis_lock_or_skip(),
    zookeeper_lock_shards_split_and_move => leader_test_support::zookeeper_lock_or_skip(),
    etcd_lock_shards_split_and_move => leader_test_support::etcd_lock_or_skip(),
    object_store_lock_shards_split_and_move => s3_lock("shards"),
    dynamodb_lock_shards_split_and_move => leader_test_support::dynamodb_lock_or_skip("shards"),
);

/// The advisory lock holds a database session per lock: no shard sets on it (exit code 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_advisory_lock_keeps_no_shard_sets() {
    let Some(url) = leader_test_support::postgres_lock_or_skip() else {
        return;
    };
    let separator = if url.contains('?') { '&' } else { '?' };
    let lock = format!("{url}{separator}advisory=true");
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("job.log");
    let mut refused = leader_with(&lock, "shards-advisory", "a", &log, &["--shards", "4"]);
    let status = timeout(Duration::from_secs(20), refused.wait())
        .await
        .expect("refused at once")
        .expect("status");
    assert_eq!(status.code(), Some(3), "the advisory lock with --shards");
}

/// `leader run --shards --serve`: the shards owned with their tokens at `/shards`, the shard
/// metrics at `/metrics`, liveness at `/healthz`.
#[tokio::test]
async fn a_shard_set_is_served() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("job.log");
    let lock = leader_tests::file_lock_in(dir.path());
    let addr = free_addr();
    let mut child = leader_with(
        &lock,
        "served",
        "a",
        &log,
        &["--shards", "3", "--serve", &addr],
    );
    let owned = timeout(Duration::from_secs(20), async {
        loop {
            if let Ok(Ok(_)) = timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(&addr),
            )
            .await
            {
                let body = http_get(&addr, "/shards").await;
                if body.contains(r#""0":1"#)
                    && body.contains(r#""1":1"#)
                    && body.contains(r#""2":1"#)
                {
                    return body;
                }
            }
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("three shards owned at /shards");
    assert!(owned.contains(r#""members":1"#), "{owned}");
    let metrics = http_get(&addr, "/metrics").await;
    assert!(
        metrics.contains(r#"leader_shards_owned{name="served"} 3"#),
        "{metrics}"
    );
    assert!(
        http_get(&addr, "/healthz")
            .await
            .starts_with("HTTP/1.0 200")
    );
    kill(pid(&child), Signal::SIGTERM).expect("SIGTERM");
    let status = timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("exits")
        .expect("status");
    assert_eq!(status.code(), Some(0));
}

/// The supervisor `leader` starts for each COMMAND runs it only while the `leader` that started it
/// (its pid on the command line) is still its parent: one whose `leader` died before it could
/// catch the parent-death signal (lost when SIGHUP is ignored, as under `nohup`) starts nothing.
#[tokio::test]
async fn a_supervisor_starts_command_only_under_the_leader_that_started_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("ran");
    let supervise = |parent: u32| {
        let mut command = Command::new(LEADER);
        command
            .args([
                "__supervise",
                &parent.to_string(),
                "1000",
                "-",
                "--",
                "touch",
            ])
            .arg(&marker)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        command
    };
    // Started by this test process, but told another process started it (its `leader` is gone).
    let status = supervise(std::os::unix::process::parent_id())
        .status()
        .await
        .expect("supervisor");
    assert_eq!(status.code(), Some(12), "{status:?}");
    assert!(!marker.exists(), "COMMAND ran under an orphaned supervisor");
    // Its parent is the process named: COMMAND runs.
    let status = supervise(std::process::id())
        .status()
        .await
        .expect("supervisor");
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(marker.exists(), "COMMAND did not run");
}

/// `--fencing-token-floor` end to end: COMMAND's `LEADER_FENCING_TOKEN` is the floor on a lock
/// whose tokens are below it (a token is at least the floor), and the next term's token is
/// above that one again.
#[tokio::test]
async fn the_fencing_token_floor_raises_the_token_command_sees() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let seen = dir.path().join("token");
    let write = format!("echo \"$LEADER_FENCING_TOKEN\" > {}", seen.display());
    let token = || {
        std::fs::read_to_string(&seen)
            .expect("COMMAND wrote its token")
            .trim()
            .parse::<u64>()
            .expect("a number")
    };
    let run = ["run", "--lock", &lock, "--name", "floor"];
    let status = run_to_end(&[&run[..], &["--", "sh", "-c", &write]].concat(), &[]).await;
    assert_eq!(status.code(), Some(0));
    assert_eq!(token(), 1, "the first term without a floor");
    let status = run_to_end(
        &[
            &run[..],
            &["--fencing-token-floor", "5000", "--", "sh", "-c", &write],
        ]
        .concat(),
        &[],
    )
    .await;
    assert_eq!(status.code(), Some(0));
    let raised = token();
    assert_eq!(raised, 5000, "the first token of a term under the floor");
    // Through the environment too; the floor below the stored token changes nothing.
    let status = run_to_end(
        &[&run[..], &["--", "sh", "-c", &write]].concat(),
        &[("LEADER_FENCING_TOKEN_FLOOR", "10")],
    )
    .await;
    assert_eq!(status.code(), Some(0));
    assert_eq!(token(), raised + 1);
}
