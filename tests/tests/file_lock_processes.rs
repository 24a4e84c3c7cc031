//! End to end: candidate processes on one file lock. Exactly one leads; a graceful stop hands
//! over within a retry period; a SIGKILL hands over at once (the kernel drops the dead holder's
//! term lock); a frozen process holds nobody up; fencing tokens grow.

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
    let timings = [LEASE, RENEW, RETRY].map(|d| d.as_millis().to_string());
    spawn_with(who, path, &timings, tx)
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
    let path = dir.path().join("election");
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

    // Crash: no release, but the kernel frees the dead holder's term lock: another takes over
    // well before the lease would have run out.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    let mut child = children[second].take().expect("leader");
    child.kill().await.expect("kill");
    let (third, t3, at) = next_leader(&mut rx, &mut log).await;
    assert!(third != first && third != second);
    assert!(
        at - killed < LEASE / 2,
        "failover after SIGKILL took {:?}, not under half the lease",
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

/// The old leader and a follower are frozen (SIGSTOP) at random moments, again and again, on a
/// machine kept busy: the third candidate always takes over within the lease and a retry period
/// (plus a margin for the load), since no operation holds a lock a frozen process could keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_processes_never_hold_up_the_others() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    const LEASE: Duration = Duration::from_millis(800);
    const RENEW: Duration = Duration::from_millis(500);
    const RETRY: Duration = Duration::from_millis(100);
    let rounds: usize = std::env::var("FREEZE_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(50);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("election");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let timings = [LEASE, RENEW, RETRY].map(|d| d.as_millis().to_string());
    let children: Vec<Child> = (0..3)
        .map(|who| spawn_with(who, &path, &timings, tx.clone()))
        .collect();
    let pids: Vec<Pid> = children
        .iter()
        .map(|c| Pid::from_raw(c.id().expect("pid").cast_signed()))
        .collect();
    let busy = Load::start(2);
    let mut log = Vec::new();
    let (mut leader, mut token, _) = next_leader(&mut rx, &mut log).await;
    let bound = LEASE + RETRY.mul_f64(2.2) + Duration::from_secs(1);
    for round in 0..rounds {
        // Under load a leader may lose a renewal and another take over: start from the latest.
        while let Ok(event) = rx.try_recv() {
            if event.leading && event.token > token {
                (leader, token) = (event.who, event.token);
            }
            log.push(event);
        }
        let follower = (leader + 1 + fastrand::usize(0..2)) % 3;
        let other = 3 - leader - follower;
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..100))).await;
        kill(pids[follower], Signal::SIGSTOP).expect("stop follower");
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..50))).await;
        kill(pids[leader], Signal::SIGSTOP).expect("stop leader");
        let frozen = Instant::now();
        let taken = loop {
            let event = timeout(bound, rx.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!("round {round}: c{other} did not take over within {bound:?}")
                })
                .expect("candidates alive");
            let found = (event.leading && event.who == other).then_some(event.token);
            log.push(event);
            if let Some(found) = found {
                break found;
            }
        };
        assert!(
            frozen.elapsed() <= bound,
            "round {round}: {:?}",
            frozen.elapsed()
        );
        assert!(taken > token, "round {round}: token {taken} after {token}");
        for pid in [pids[leader], pids[follower]] {
            kill(pid, Signal::SIGCONT).expect("resume");
        }
        (leader, token) = (other, taken);
        // Let the resumed leader find out that it lost, before the next round.
        tokio::time::sleep(RETRY * 3).await;
    }
    drop(busy);
    for mut child in children {
        drop(child.stdin.take());
        let _ = timeout(Duration::from_secs(5), child.wait()).await;
    }
}

fn spawn_with(
    who: usize,
    path: &std::path::Path,
    timings: &[String; 3],
    tx: mpsc::UnboundedSender<Event>,
) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_candidate"))
        .arg(format!("c{who}"))
        .arg(path)
        .args(timings)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn candidate");
    forward_events(who, &mut child, tx);
    child
}

fn forward_events(who: usize, child: &mut Child, tx: mpsc::UnboundedSender<Event>) {
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
}

/// Threads that keep the CPUs busy until dropped.
struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(threads: usize) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x: u64 = 1;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005));
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
