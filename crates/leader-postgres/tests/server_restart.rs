//! The Postgres server stopped and started again under running electors. It lives in a test
//! binary of its own, so no other test of this crate runs while the server is down.
//!
//! It needs to control the server: root, Debian's `pg_ctlcluster`, and `DATABASE_URL` on
//! loopback port 5432 (what `scripts/test` sets up). Elsewhere it says so and skips.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{RENEW, RETRY, Running, unique};
use leader_core::ResourceLock;
use leader_test_support::{assert_server_down, next_leader};
use tokio::time::{Instant, sleep, timeout};

/// The local cluster's version, if this test may stop and start it.
fn controllable_cluster() -> Result<String, String> {
    let config: tokio_postgres::Config =
        common::database_url().parse().map_err(|e| format!("{e}"))?;
    let loopback = matches!(config.get_hosts().first(),
        Some(tokio_postgres::config::Host::Tcp(h)) if h == "127.0.0.1" || h == "localhost" || h == "::1");
    if !loopback || config.get_ports().first().copied().unwrap_or(5432) != 5432 {
        return Err("DATABASE_URL is not the local server on port 5432".into());
    }
    let versions =
        std::fs::read_dir("/etc/postgresql").map_err(|e| format!("no /etc/postgresql: {e}"))?;
    let mut versions: Vec<String> = versions
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    versions.sort();
    let version = versions.pop().ok_or("no cluster in /etc/postgresql")?;
    Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", "status"])
        .status()
        .map_err(|e| format!("pg_ctlcluster: {e}"))?
        .success()
        .then_some(version)
        .ok_or_else(|| "pg_ctlcluster cannot see the cluster running".into())
}

fn pg_ctl(version: &str, args: &[&str]) {
    let status = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", version, "main"])
        .args(args)
        .status()
        .expect("pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster {args:?} failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "stops the shared Postgres server under every other test: scripts/test runs it alone, after the others; by hand, `cargo test --test server_restart -- --ignored`"]
async fn electors_step_down_while_the_server_is_stopped_and_recover_when_it_is_back() {
    let Some(store) = common::store().await else {
        return;
    };
    let version = match controllable_cluster() {
        Ok(version) => version,
        Err(why) => {
            assert!(
                !common::in_ci(),
                "CI=true but the server cannot be stopped here: {why}"
            );
            eprintln!("skipping: {why}");
            return;
        }
    };
    let table_name = unique("restart-table");
    let advisory_name = unique("restart-advisory");
    let mut leaders = vec![
        Running::start(store.lock(&table_name, "t1")),
        Running::start(store.advisory_lock(&advisory_name, "a1")),
    ];
    let mut tokens = Vec::new();
    for leader in &mut leaders {
        tokens.push(leader.wait_leading(Duration::from_secs(10)).await);
    }
    let followers = [
        Running::start(store.lock(&table_name, "t2")),
        Running::start(store.advisory_lock(&advisory_name, "a2")),
    ];
    sleep(RETRY * 2).await;

    let stopped = Instant::now();
    pg_ctl(&version, &["stop", "-m", "fast"]);
    let restart = scopeguard(&version);
    assert_server_down(store.lock(&table_name, "probe").get().await);
    for leader in &mut leaders {
        timeout(
            RENEW + RETRY * 3,
            leader.state.wait_for(|s| !s.is_leading()),
        )
        .await
        .expect("the leader steps down by its renew deadline")
        .expect("alive");
    }
    assert!(stopped.elapsed() < RENEW + RETRY * 3);
    sleep(Duration::from_secs(1)).await;
    for elector in leaders.iter().chain(&followers) {
        assert!(
            elector.leading_token().is_none(),
            "leads while the server is down"
        );
        assert!(!elector.task.is_finished(), "an elector stopped");
    }

    drop(restart); // starts the server again
    for (pair, token) in [(&leaders[0], &followers[0]), (&leaders[1], &followers[1])]
        .into_iter()
        .zip(tokens)
    {
        let new_token = next_leader(&[pair.0, pair.1], Duration::from_secs(20)).await;
        assert!(new_token > token, "fencing token {token} then {new_token}");
        assert!(pair.0.leading_token().is_none() || pair.1.leading_token().is_none());
    }
    for elector in leaders.into_iter().chain(followers) {
        elector.stop().await;
    }
}

/// Starts the server again when dropped, also when an assertion failed.
struct Restart(String);

fn scopeguard(version: &str) -> Restart {
    Restart(version.to_owned())
}

impl Drop for Restart {
    fn drop(&mut self) {
        pg_ctl(&self.0, &["start"]);
        for _ in 0..100 {
            if std::net::TcpStream::connect("127.0.0.1:5432").is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
