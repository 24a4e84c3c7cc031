//! End to end: candidate processes on one file lock. Exactly one leads; a graceful stop hands
//! over within a retry period; a SIGKILL hands over after the lease; fencing tokens grow.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

const LEASE: Duration = Duration::from_millis(1500);
const RENEW: Duration = Duration::from_millis(1000);
const RETRY: Duration = Duration::from_millis(200);

#[derive(Debug)]
struct Event {
    at: Instant,
    who: usize,
    leading: bool,
    token: u64,
}

fn spawn(who: usize, path: &std::path::Path, tx: mpsc::UnboundedSender<Event>) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_candidate"))
        .arg(format!("c{who}"))
        .arg(path)
        .args([LEASE, RENEW, RETRY].map(|d| d.as_millis().to_string()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn candidate");
    let stdout = child.stdout.take().expect("stdout");
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let (kind, token) = line.split_once(' ').expect("event line");
            let event = Event {
                at: Instant::now(),
                who,
                leading: kind == "leading",
                token: token.parse().expect("token"),
            };
            let _ = tx.send(event);
        }
    });
    child
}

async fn next_leader(
    rx: &mut mpsc::UnboundedReceiver<Event>,
    log: &mut Vec<Event>,
) -> (usize, u64, Instant) {
    loop {
        let event = timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a leader within 10 s")
            .expect("candidates alive");
        let found = event.leading.then_some((event.who, event.token, event.at));
        log.push(event);
        if let Some(found) = found {
            return found;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_on_a_file_lock_hand_over_safely() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("election.json");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut children: Vec<Option<Child>> =
        (0..3).map(|i| Some(spawn(i, &path, tx.clone()))).collect();
    let mut log = Vec::new();

    let (first, t1, _) = next_leader(&mut rx, &mut log).await;
    tokio::time::sleep(LEASE * 2).await; // nobody else may lead meanwhile

    // Graceful stop: the leader releases; a follower takes over well within a retry period.
    let stopped = Instant::now();
    let mut child = children[first].take().expect("leader");
    drop(child.stdin.take());
    let (second, t2, at) = next_leader(&mut rx, &mut log).await;
    assert_ne!(second, first);
    assert!(
        at - stopped < RETRY * 3,
        "handover after release took {:?}",
        at - stopped
    );
    assert!(child.wait().await.expect("exit").success());

    // Crash: no release; another takes over after the lease, within lease + a generous margin.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    let mut child = children[second].take().expect("leader");
    child.kill().await.expect("kill");
    let (third, t3, at) = next_leader(&mut rx, &mut log).await;
    assert!(third != first && third != second);
    assert!(
        at - killed < LEASE + Duration::from_secs(2),
        "failover took {:?}",
        at - killed
    );
    assert!(
        t1 < t2 && t2 < t3,
        "fencing tokens must grow: {t1}, {t2}, {t3}"
    );

    for mut child in children.into_iter().flatten() {
        drop(child.stdin.take());
        let _ = timeout(Duration::from_secs(5), child.wait()).await;
    }
    while let Ok(event) = rx.try_recv() {
        log.push(event);
    }
    // At most one leader at any instant (a SIGKILLed leader prints no "stopped": it ends there).
    let mut leading: Option<usize> = None;
    for event in &log {
        if event.leading {
            assert!(
                leading.is_none() || (leading == Some(second) && event.who == third),
                "c{} started leading while c{:?} led: {log:?}",
                event.who,
                leading
            );
            leading = Some(event.who);
        } else if leading == Some(event.who) {
            leading = None;
        }
    }
}
