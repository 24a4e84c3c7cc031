//! The crate's examples, as users run them: two replicas of each on the test Postgres (a lock
//! table of the test's own), stopped with SIGTERM. The nightly job fires each instant once; the
//! leader-only route answers on the leader alone and moves with it; the sharded worker covers
//! every shard. `cargo test` builds the examples before it runs this.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, timeout};

/// The example binary `name`, beside this test's in the target directory.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/PROFILE/deps");
    profile.join("examples").join(name)
}

/// The test Postgres with a lock table of this test's own, or a skip.
fn lock_url() -> Option<String> {
    let url = leader_test_support::postgres_lock_or_skip()?;
    let table = format!("examples_{:08x}", fastrand::u32(..));
    let joiner = if url.contains('?') { '&' } else { '?' };
    Some(format!("{url}{joiner}table={table}"))
}

/// A replica of an example: its process and the lines it printed.
struct Replica {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Replica {
    fn start(name: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(example(name));
        command
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .unwrap_or_else(|err| panic!("{name} (built by cargo test): {err}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().expect("stdout");
        let seen = lines.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                seen.lock().unwrap().push(line);
            }
        });
        Self { child, lines }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// SIGTERM, as Kubernetes or systemd stop it: it exits 0, promptly.
    async fn stop(mut self) {
        let pid = self.child.id().expect("running");
        kill(Pid::from_raw(pid.cast_signed()), Signal::SIGTERM).expect("SIGTERM");
        let status = timeout(Duration::from_secs(20), self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .expect("waited");
        assert!(status.success(), "exit after SIGTERM: {status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nightly_job_fires_each_instant_on_one_replica() {
    let Some(url) = lock_url() else { return };
    let env = [("LEADER_LOCK", url.as_str()), ("SCHEDULE", "* * * * * *")];
    let a = Replica::start("nightly_job", &env);
    let b = Replica::start("nightly_job", &env);
    sleep(Duration::from_secs(6)).await;
    let mut reports: Vec<String> = a.lines().into_iter().chain(b.lines()).collect();
    a.stop().await;
    b.stop().await;
    let fired = reports.len();
    reports.sort();
    reports.dedup_by(|x, y| x.split(" (").next() == y.split(" (").next());
    assert_eq!(reports.len(), fired, "an instant fired twice: {reports:?}");
    assert!(fired >= 3, "fired {fired} times in 6 s: {reports:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_only_route_answers_on_the_leader_and_moves_with_it() {
    let Some(url) = lock_url() else { return };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let port = || {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        listener.local_addr().expect("address").to_string()
    };
    let addrs = [port(), port()];
    let mut replicas: Vec<Option<Replica>> = addrs
        .iter()
        .map(|addr| {
            Some(Replica::start(
                "leader_only_route",
                &[("LEADER_LOCK", url.as_str()), ("LISTEN", addr.as_str())],
            ))
        })
        .collect();
    let code = |path: &'static str, post: bool, addr: String| {
        let http = http.clone();
        async move {
            let url = format!("http://{addr}{path}");
            let request = if post { http.post(url) } else { http.get(url) };
            request.send().await.map(|r| r.status().as_u16()).ok()
        }
    };
    // Who leads: 200 on /leader of exactly one, once both answer.
    let leader = async {
        loop {
            let seen = [
                code("/leader", false, addrs[0].clone()).await,
                code("/leader", false, addrs[1].clone()).await,
            ];
            match seen {
                [Some(200), Some(503)] => return 0,
                [Some(503), Some(200)] => return 1,
                _ => sleep(Duration::from_millis(200)).await,
            }
        }
    };
    let leader = timeout(Duration::from_secs(30), leader)
        .await
        .expect("one leads");
    let follower = 1 - leader;
    for (at, expected) in [(leader, 200), (follower, 503)] {
        let rebuilt = code("/admin/rebuild", true, addrs[at].clone()).await;
        assert_eq!(
            rebuilt,
            Some(expected),
            "POST /admin/rebuild on replica {at}"
        );
        assert_eq!(code("/readyz", false, addrs[at].clone()).await, Some(200));
        assert_eq!(code("/healthz", false, addrs[at].clone()).await, Some(200));
    }
    // The leader stops (SIGTERM releases): the other answers the leader-only route soon.
    replicas[leader].take().expect("running").stop().await;
    let stopped = Instant::now();
    while code("/admin/rebuild", true, addrs[follower].clone()).await != Some(200) {
        assert!(
            stopped.elapsed() < Duration::from_secs(10),
            "the other replica never took over"
        );
        sleep(Duration::from_millis(100)).await;
    }
    replicas[follower].take().expect("running").stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_worker_covers_every_shard_across_replicas() {
    let Some(url) = lock_url() else { return };
    let env = [("LEADER_LOCK", url.as_str())];
    let a = Replica::start("sharded_worker", &env);
    let b = Replica::start("sharded_worker", &env);
    let shards_of = |replica: &Replica| {
        let mut shards: Vec<u32> = replica
            .lines()
            .iter()
            .filter_map(|l| l.strip_prefix("shard ")?.split(':').next()?.parse().ok())
            .collect();
        shards.sort_unstable();
        shards.dedup();
        shards
    };
    let started = Instant::now();
    loop {
        let (on_a, on_b) = (shards_of(&a), shards_of(&b));
        let mut all: Vec<u32> = on_a.iter().chain(&on_b).copied().collect();
        all.sort_unstable();
        all.dedup();
        // Every shard worked on, by both replicas between them.
        if all == (0..8).collect::<Vec<_>>() && !on_a.is_empty() && !on_b.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "shards worked on: {on_a:?} and {on_b:?}"
        );
        sleep(Duration::from_millis(250)).await;
    }
    a.stop().await;
    b.stop().await;
}

/// A write that the store refuses after `open()` (a role that may read the lock table but not
/// write it) shows in the example's log, instead of being retried in silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_shows_in_the_log() {
    let Some(base) = leader_test_support::postgres_lock_or_skip() else {
        return;
    };
    let suffix = format!("{:08x}", fastrand::u32(..));
    let (table, role) = (
        format!("examples_ro_{suffix}"),
        format!("leader_ro_{suffix}"),
    );
    let joiner = if base.contains('?') { '&' } else { '?' };
    let owner = format!("{base}{joiner}table={table}");
    // The table, made by a role that may write; then a role that may only read it.
    drop(
        leader::open(&owner, "nightly-report", "setup")
            .await
            .expect("the lock table"),
    );
    psql(
        &base,
        &format!(
            "CREATE ROLE {role} LOGIN PASSWORD 'read-only'; GRANT SELECT ON {table} TO {role};"
        ),
    );
    let mut reader = url::Url::parse(&base).expect("DATABASE_URL");
    reader.set_username(&role).expect("a user");
    reader.set_password(Some("read-only")).expect("a password");
    let reader = format!("{reader}{joiner}table={table}");
    let mut replica = Replica::start(
        "nightly_job",
        &[
            ("LEADER_LOCK", reader.as_str()),
            ("SCHEDULE", "* * * * * *"),
        ],
    );
    let until = Instant::now() + Duration::from_secs(20);
    let refused = loop {
        let lines = replica.lines();
        if let Some(line) = lines.iter().find(|l| l.contains("permission denied")) {
            break Some(line.clone());
        }
        if Instant::now() > until {
            break None;
        }
        sleep(Duration::from_millis(200)).await;
    };
    let lines = replica.lines();
    replica.child.kill().await.expect("killed");
    psql(&base, &format!("DROP OWNED BY {role}; DROP ROLE {role};"));
    let refused = refused.unwrap_or_else(|| panic!("no refused write in the log: {lines:?}"));
    assert!(
        !refused.contains("read-only"),
        "a password in the log: {refused}"
    );
}

/// Runs `sql` with psql on the database of `url` (its parameters left out, as psql knows none).
fn psql(url: &str, sql: &str) {
    let url = url.split('?').next().expect("a URL");
    let status = std::process::Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-q", "-c", sql])
        .status()
        .expect("psql (Postgres's client)");
    assert!(status.success(), "psql: {sql}");
}
