//! End to end: `leader status` of a shard set on the file lock, while two `leader run --shards`
//! replicas run it: the count, both members alive, each shard's owner and fencing token as
//! JSON and as a table, found with `--shards` and without it; after one replica stops, the
//! other owns every shard and the roster names it alone.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout};

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");
const JOB: &str = env!("CARGO_BIN_EXE_job");
const COUNT: u32 = 4;

fn replica(lock: &str, name: &str, identity: &str, dir: &std::path::Path) -> Child {
    Command::new(LEADER)
        .arg("run")
        .args(["--lock", lock, "--name", name, "--identity", identity])
        .args(["--lease-duration", "2000ms", "--renew-deadline", "1500ms"])
        .args(["--retry-period", "200ms", "--shards", &COUNT.to_string()])
        .args(["--", JOB])
        .env("JOB_LOG", dir.join("job.log"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn leader")
}

/// `leader status` with `extra` flags: its exit code and stdout.
async fn status(lock: &str, name: &str, extra: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(LEADER)
        .args(["status", "--lock", lock, "--name", name])
        .args(extra)
        .output()
        .await
        .expect("run leader status");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

async fn status_json(lock: &str, name: &str, extra: &[&str]) -> serde_json::Value {
    let (code, stdout) = status(lock, name, &[&["--json"], extra].concat()).await;
    assert_eq!(code, Some(0), "leader status --json: {stdout}");
    serde_json::from_str(&stdout).unwrap_or_else(|err| panic!("not JSON ({err}): {stdout}"))
}

/// Each shard's owner in a status, `None` for an unowned shard.
fn owners(status: &serde_json::Value) -> BTreeMap<u64, Option<String>> {
    status["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|s| {
            let owner =
                (s["state"] == "held").then(|| s["holder"].as_str().expect("a holder").to_owned());
            (s["shard"].as_u64().expect("a number"), owner)
        })
        .collect()
}

fn members(status: &serde_json::Value) -> Vec<(String, bool)> {
    status["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| {
            (
                m["identity"].as_str().expect("identity").to_owned(),
                m["alive"].as_bool().expect("alive"),
            )
        })
        .collect()
}

async fn stop(mut child: Child) {
    if let Some(id) = child.id() {
        let _ = kill(Pid::from_raw(id.cast_signed()), Signal::SIGTERM);
    }
    let _ = timeout(Duration::from_secs(10), child.wait()).await;
}

/// Polls `leader status --json` until `done` holds of it, up to 20 s; the last status.
async fn wait_for(
    lock: &str,
    name: &str,
    mut done: impl FnMut(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let status = status_json(lock, name, &[]).await;
        if done(&status) {
            return status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "never came: {status:#}"
        );
        sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_members_and_owners_of_a_shard_set() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let name = format!("status-{:08x}", fastrand::u32(..));

    // Nothing ran yet: no set, said so, and nothing created.
    let (code, stdout) = status(&lock, &name, &["--shards"]).await;
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("no shard set"), "{stdout}");
    assert!(!dir.path().join("lock").exists(), "status created the lock");

    let a = replica(&lock, &name, "a", dir.path());
    let b = replica(&lock, &name, "b", dir.path());
    // Until a replica has written the set's record, status finds no set and
    // answers as for a single election: not yet balanced.
    let balanced = |s: &serde_json::Value| {
        if s["shardSet"] != true {
            return false;
        }
        let owners = owners(s);
        ["a", "b"]
            .iter()
            .all(|m| owners.values().filter(|o| o.as_deref() == Some(*m)).count() == 2)
    };
    let seen = wait_for(&lock, &name, balanced).await;
    assert_eq!(seen["shardSet"], true);
    assert_eq!(seen["name"], name.as_str());
    assert_eq!(seen["count"], COUNT);
    assert_eq!(seen["shards"].as_array().expect("shards").len(), 4);
    assert_eq!(seen["unowned"], serde_json::json!([]));
    assert_eq!(
        members(&seen),
        [("a".to_owned(), true), ("b".to_owned(), true)]
    );
    for shard in seen["shards"].as_array().expect("shards") {
        assert!(
            shard["fencingToken"].as_u64().is_some_and(|t| t >= 1),
            "{shard}"
        );
        assert!(shard["acquireTime"].is_string(), "{shard}");
    }
    for member in seen["members"].as_array().expect("members") {
        assert_eq!(member["shards"].as_array().expect("shards").len(), 2);
        assert!(member["renewTime"].is_string(), "{member}");
    }
    // Asked for with --shards: the same set.
    let asked = status_json(&lock, &name, &["--shards"]).await;
    assert_eq!(asked["count"], COUNT);
    assert_eq!(members(&asked), members(&seen));

    // The table: a line per member and per shard, with its owner.
    let (code, table) = status(&lock, &name, &[]).await;
    assert_eq!(code, Some(0), "{table}");
    assert!(table.contains(&format!("shard set    {name}")), "{table}");
    assert!(
        table.contains("shards       4 (4 owned, 0 unowned)"),
        "{table}"
    );
    assert!(table.contains("members      2 (2 alive)"), "{table}");
    let shard_lines: Vec<&str> = table
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<u32>().is_ok())
        })
        .collect();
    assert_eq!(shard_lines.len(), 4, "{table}");
    for line in shard_lines {
        let owner = line.split_whitespace().nth(1);
        assert!(matches!(owner, Some("a" | "b")), "{line}");
    }

    // b stops (releasing its shards and leaving the roster): a owns every shard.
    stop(b).await;
    let seen = wait_for(&lock, &name, |s| {
        s["shardSet"] == true
            && owners(s).values().all(|o| o.as_deref() == Some("a"))
            && members(s) == [("a".to_owned(), true)]
    })
    .await;
    assert_eq!(seen["unowned"], serde_json::json!([]));
    stop(a).await;
}
