//! End to end: `leader status` and `leader run` never print the password of their lock URL,
//! whatever it holds (`/`, `?`, `#`, `@`, `:`, raw or percent-encoded), for each backend that
//! takes one in its URL. Nothing listens where the URLs point: each command fails at start, on
//! the URL or on connecting, and says so on stderr.

use std::process::Stdio;
use std::sync::Arc;

use leader_test_support::secrets::{passwords, shows_password};
use tokio::process::Command;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");

/// A lock URL of each backend with `password`, on ports where nothing listens.
fn urls(password: &str) -> [String; 6] {
    [
        format!("postgres://app:{password}@127.0.0.1:9/app"),
        format!("mysql://app:{password}@127.0.0.1:9/app"),
        format!("redis://:{password}@127.0.0.1:9"),
        format!("nats://app:{password}@127.0.0.1:9/locks"),
        format!("etcd://app:{password}@127.0.0.1:9,127.0.0.1:10/"),
        format!("consul://app:{password}@127.0.0.1:9/locks/"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_never_prints_the_password_of_its_lock_url() {
    let slots = Arc::new(Semaphore::new(16));
    let mut commands = JoinSet::new();
    for password in passwords() {
        for url in urls(&password) {
            for args in [
                vec!["status", "--lock", &url, "--name", "jobs"],
                vec!["run", "--lock", &url, "--name", "jobs", "--", "true"],
            ] {
                let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
                let slots = Arc::clone(&slots);
                let url = url.clone();
                commands.spawn(async move {
                    let _slot = slots.acquire().await.expect("slot");
                    let output = Command::new(LEADER)
                        .args(&args)
                        .env_remove("RUST_LOG")
                        .env_remove("LEADER_LOCK")
                        .stdin(Stdio::null())
                        .kill_on_drop(true)
                        .output()
                        .await
                        .expect("run leader");
                    (url, args[0].clone(), output)
                });
            }
        }
    }
    let mut shown = Vec::new();
    while let Some(done) = commands.join_next().await {
        let (url, command, output) = done.expect("command task");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(!output.status.success(), "leader {command} {url}: {stderr}");
        assert!(
            stderr.contains("leader"),
            "leader {command} {url}: {stderr}"
        );
        if shows_password(&format!("{stdout} {stderr}")) {
            shown.push(format!("leader {command} --lock {url}: {stderr}"));
        }
    }
    shown.sort();
    assert!(
        shown.is_empty(),
        "{} commands showed the password:\n{}",
        shown.len(),
        shown.join("\n")
    );
}
