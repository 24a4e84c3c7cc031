//! End to end: `leader run --shards` on the file lock when a shard's COMMAND cannot start (the
//! `leader` binary replaced under a running replica, as in an upgrade) or keeps crashing. The
//! shard is given up, said so in a line naming it, and taken again by that replica only after a
//! back-off that grows; another replica may take it meanwhile. And a rolling restart with
//! `--static-membership`: a replica restarted under its identity (after SIGTERM, or after
//! SIGKILL within its window) takes its own shards back, and no shard moves. And `leader shards resize` while the replicas run, on the file lock,
//! Postgres, Redis and etcd: each COMMAND is started again under the new count, and no replica
//! runs COMMANDs under two counts at once.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use leader_tests::{on_each_backend, term_events as events};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::{sleep, timeout};

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");
const JOB: &str = env!("CARGO_BIN_EXE_job");
const LEASE: Duration = Duration::from_millis(2000);
const RENEW: Duration = Duration::from_millis(1500);
const RETRY: Duration = Duration::from_millis(200);

/// A replica of set `name` on `lock`, run from this `leader` with `--shards 1` and the `job`
/// binary as COMMAND (shard N's logging to `DIR/job.log.N`), each replica's stderr written to
/// `DIR/IDENTITY.stderr`. The fields change what it runs: another `binary`, more `env` for
/// COMMAND, `args` (`--shards K` and more) in place of `--shards 1`, another `command`.
struct Replica<'a> {
    binary: &'a Path,
    lock: &'a str,
    name: &'a str,
    dir: &'a Path,
    env: &'a [(&'a str, &'a str)],
    args: &'a [&'a str],
    command: &'a [&'a str],
}

impl<'a> Replica<'a> {
    fn of(lock: &'a str, name: &'a str, dir: &'a Path) -> Self {
        Self {
            binary: Path::new(LEADER),
            lock,
            name,
            dir,
            env: &[],
            args: &["--shards", "1"],
            command: &[JOB],
        }
    }

    /// Starts the replica `identity`, killed when dropped.
    fn start(&self, identity: &str) -> Child {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(stderr_of(self.dir, identity))
            .expect("stderr file");
        Command::new(self.binary)
            .arg("run")
            .args(["--lock", self.lock])
            .args(["--name", self.name])
            .args(["--identity", identity])
            .args(["--lease-duration", &ms(LEASE)])
            .args(["--renew-deadline", &ms(RENEW)])
            .args(["--retry-period", &ms(RETRY)])
            .args(self.args)
            .arg("--")
            .args(self.command)
            .env("JOB_LOG", self.dir.join("job.log"))
            .env("RUST_LOG", "warn")
            .envs(self.env.iter().copied())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn leader")
    }
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

/// `leader ARGS`, run to its end: its exit code and what it wrote, stdout then stderr.
fn leader(args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(LEADER)
        .args(args)
        .output()
        .expect("run leader");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
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

/// A replica whose own binary was replaced after it started (an upgrade) goes on starting its
/// COMMANDs: their supervisor is this process's executable as it runs, not the file it was
/// started from, which would now be another release, or nothing. (The job exits at once, so
/// that the shard is given up and its COMMAND started again, after the file is gone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_binary_was_replaced_goes_on_starting_commands() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let name = format!("replaced-{:08x}", fastrand::u32(..));
    let old = dir.path().join("leader-old");
    std::fs::copy(LEADER, &old).expect("copy the leader binary");
    let replica = Replica {
        binary: &old,
        env: &[("JOB_EXIT", "3")],
        ..Replica::of(&lock, &name, dir.path())
    }
    .start("a");
    std::fs::remove_file(&old).expect("remove the copy");
    // Each exit with the job's code is a COMMAND that started.
    let started_twice = wait_until(Duration::from_secs(20), || {
        lines_with(dir.path(), "a", "exited by itself").len() >= 2
    })
    .await;
    stop(replica).await;
    let stderr = std::fs::read_to_string(stderr_of(dir.path(), "a"));
    assert!(started_twice, "COMMAND did not start again: {stderr:?}");
    assert!(
        lines_with(dir.path(), "a", "cannot start").is_empty(),
        "{stderr:?}"
    );
}

/// A COMMAND that exits at once every time is started again after a back-off that grows, and
/// the log says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_keeps_crashing_is_restarted_after_a_back_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let name = format!("crashing-{:08x}", fastrand::u32(..));
    // The job exits with code 3 as soon as it starts.
    let crashing = Replica {
        env: &[("JOB_EXIT", "3")],
        ..Replica::of(&lock, &name, dir.path())
    }
    .start("a");
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

/// A rolling restart of two replicas with `--static-membership` on the file lock, each stopped
/// by SIGTERM and started again under its identity within the lease: each takes its own shards
/// back, and no shard's COMMAND ever starts on the other replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_with_static_membership_moves_no_shard() {
    let lock = leader_tests::FileLock::in_temp_dir();
    a_rolling_restart_moves_no_shard(&lock, Signal::SIGTERM, RETRY * 4, &[]).await;
}

/// The same with each replica SIGKILLed (a crash: nothing released) and started again after
/// longer than its lease, within a window of five leases: the other replica keeps away from
/// the crashed one's shards, which it takes back. On Postgres, whose records stay as the crash
/// left them, and etcd, which deletes them when their lease runs out.
async fn crashes_within_the_window(lock: &str) {
    let window = format!("{}ms", (LEASE * 5).as_millis());
    let args = ["--static-membership-window", window.as_str()];
    a_rolling_restart_moves_no_shard(lock, Signal::SIGKILL, LEASE * 3 / 2, &args).await;
}

on_each_backend!(crashes_within_the_window:
    postgres_lock_set_crashes_within_the_window_move_no_shard => leader_test_support::postgres_lock_or_skip(),
    etcd_lock_set_crashes_within_the_window_move_no_shard => leader_test_support::etcd_lock_or_skip(),
);

/// Two replicas of a set of four shards with `--static-membership` and `more` arguments on
/// `lock`, each in turn sent `signal` and started again under its identity `pause` later:
/// each takes its own shards back, and no shard's COMMAND ever starts on the other replica.
async fn a_rolling_restart_moves_no_shard(
    lock: &str,
    signal: Signal,
    pause: Duration,
    more: &[&str],
) {
    const SHARDS: u32 = 4;
    let dir = tempfile::tempdir().expect("tempdir");
    let name = format!("static-{:08x}", fastrand::u32(..));
    let mut args = vec!["--shards", "4", "--static-membership"];
    args.extend_from_slice(more);
    let replica = Replica {
        args: &args,
        ..Replica::of(lock, &name, dir.path())
    };
    let start = |identity: &str| replica.start(identity);
    let logs: Vec<PathBuf> = (0..SHARDS)
        .map(|shard| dir.path().join(format!("job.log.{shard}")))
        .collect();
    // Who runs each shard now (by its last event), if anyone.
    let owners = || -> Vec<Option<String>> {
        logs.iter()
            .map(|log| {
                events(log)
                    .last()
                    .filter(|e| e.start)
                    .map(|e| e.identity.clone())
            })
            .collect()
    };
    let balanced = |owners: &[Option<String>]| {
        ["a", "b"].iter().all(|id| {
            owners.iter().filter(|o| o.as_deref() == Some(*id)).count() == SHARDS as usize / 2
        })
    };
    let mut replicas = vec![("a", start("a")), ("b", start("b"))];
    assert!(
        wait_until(Duration::from_secs(20), || balanced(&owners())).await,
        "never balanced: {:?}",
        owners()
    );
    let before = owners();
    let starts_before: Vec<usize> = logs.iter().map(|log| events(log).len()).collect();
    for i in 0..replicas.len() {
        let (identity, mut old) = replicas.remove(i);
        if signal == Signal::SIGTERM {
            stop(old).await;
        } else {
            let id = old.id().expect("a running replica");
            kill(Pid::from_raw(id.cast_signed()), signal).expect("signal");
            let _ = old.wait().await;
        }
        // A restart takes a while (a Pod's new container).
        sleep(pause).await;
        let stopped: Vec<usize> = logs.iter().map(|log| events(log).len()).collect();
        replicas.insert(i, (identity, start(identity)));
        // Back when the new process runs each of its shards again (a COMMAND killed with its
        // replica may have logged no end).
        let restarted = || {
            logs.iter()
                .zip(&stopped)
                .zip(&before)
                .all(|((log, &at), owner)| {
                    owner.as_deref() != Some(identity)
                        || events(log).iter().skip(at).any(|e| e.start)
                })
        };
        assert!(
            wait_until(Duration::from_secs(20), || restarted()
                && owners() == before)
            .await,
            "{identity} did not take its shards back: {:?}, before {before:?}; {}",
            owners(),
            std::fs::read_to_string(stderr_of(dir.path(), identity)).unwrap_or_default()
        );
    }
    // `leader status` says each member is static, with its window.
    let (code, status) = leader(&["status", "--lock", lock, "--name", &name]);
    assert_eq!(code, Some(0), "{status}");
    assert_eq!(
        status.matches("yes (static, window ").count(),
        2,
        "{status}"
    );
    for (_, child) in replicas {
        stop(child).await;
    }
    for (shard, log) in logs.iter().enumerate() {
        let later: Vec<String> = events(log)
            .into_iter()
            .skip(starts_before[shard])
            .filter(|e| e.start)
            .map(|e| e.identity)
            .collect();
        assert!(
            later.iter().all(|id| Some(id) == before[shard].as_ref()),
            "shard {shard}, run by {:?}, started on {later:?} in the restart",
            before[shard]
        );
    }
}

on_each_backend!(fences_the_older:
    a_replica_started_under_a_running_identity_fences_the_older => Some(leader_tests::FileLock::in_temp_dir()),
    postgres_lock_set_fences_the_older_process_of_an_identity => leader_test_support::postgres_lock_or_skip(),
    etcd_lock_set_fences_the_older_process_of_an_identity => leader_test_support::etcd_lock_or_skip(),
);

/// `--static-membership`: a replica started while another process still runs with its
/// identity fences that process: the older one exits with code 8, saying so, its COMMANDs
/// stopped, and the newer one runs every shard, each shard's COMMAND starting only after the
/// older one's stopped. On the file lock, Postgres (renewals that write) and etcd (renewals
/// kept in the store, where the fence's write must leave the holder's lease alone).
async fn fences_the_older(lock: &str) {
    const SHARDS: u32 = 4;
    let dir = tempfile::tempdir().expect("tempdir");
    let name = format!("fenced-{:08x}", fastrand::u32(..));
    let args = ["--shards", "4", "--static-membership"];
    let replica = Replica {
        args: &args,
        ..Replica::of(lock, &name, dir.path())
    };
    let start = || replica.start("a");
    let logs: Vec<PathBuf> = (0..SHARDS)
        .map(|shard| dir.path().join(format!("job.log.{shard}")))
        .collect();
    // Each shard's COMMAND running now, by its last event: its fencing token.
    let running = || -> Vec<Option<u64>> {
        logs.iter()
            .map(|log| events(log).last().filter(|e| e.start).map(|e| e.token))
            .collect()
    };
    let mut older = start();
    assert!(
        wait_until(Duration::from_secs(20), || running()
            .iter()
            .all(Option::is_some))
        .await,
        "the first replica never ran every shard: {:?}",
        running()
    );
    let before = running();
    // Its member record names its process before the newer one starts.
    sleep(RETRY * 4).await;
    let newer = start();
    let exited = timeout(Duration::from_secs(30), older.wait())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the older replica never exited: {}",
                std::fs::read_to_string(stderr_of(dir.path(), "a")).unwrap_or_default()
            )
        })
        .expect("its status");
    assert_eq!(exited.code(), Some(8), "{exited:?}");
    assert!(
        !lines_with(dir.path(), "a", "fenced this one").is_empty(),
        "the older replica says why it stops"
    );
    let taken = |now: &[Option<u64>]| {
        now.iter()
            .zip(&before)
            .all(|(now, then)| now.is_some_and(|token| Some(token) > *then))
    };
    assert!(
        wait_until(Duration::from_secs(20), || taken(&running())).await,
        "the newer replica never ran every shard under a new term: {:?}, before {before:?}",
        running()
    );
    stop(newer).await;
    // Per shard, a start only after the stop before it: never two COMMANDs at once.
    for log in &logs {
        let starts: Vec<bool> = events(log).iter().map(|e| e.start).collect();
        assert!(
            starts.chunks(2).all(|pair| pair == [true, false]),
            "{}: {starts:?}",
            log.display()
        );
    }
}

/// `--static-membership` without an identity that outlives the process (the default is
/// HOSTNAME-PID) is refused in one line, with the usage exit code.
#[tokio::test]
async fn static_membership_without_a_lasting_identity_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(LEADER)
        .arg("run")
        .args(["--lock", &leader_tests::file_lock_in(dir.path())])
        .args([
            "--name",
            "static-refused",
            "--shards",
            "2",
            "--static-membership",
        ])
        .args(["--", JOB])
        .env_remove("POD_NAME")
        .env_remove("LEADER_IDENTITY")
        .output()
        .await
        .expect("run leader");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--identity"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

/// `leader shards resize` while two replicas run: grown from 2 to 4 shards, every shard's
/// COMMAND runs; shrunk to 1, the COMMANDs of shards 1 to 3 stop and none
/// starts again. A replica started with the old count is refused (exit 11); a set nobody ran
/// cannot be resized (exit 6).
async fn a_set_resized_while_its_replicas_run(lock: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let name = format!("resized-{:08x}", fastrand::u32(..));
    let start = |identity: &str, count: &str| {
        Replica {
            args: &["--shards", count],
            ..Replica::of(lock, &name, dir.path())
        }
        .start(identity)
    };
    let resize = |name: &str, count: &str| {
        leader(&["shards", "resize", "--lock", lock, "--name", name, count])
    };
    let log = |shard: u32| dir.path().join(format!("job.log.{shard}"));
    let running = |shard: u32| events(&log(shard)).last().is_some_and(|e| e.start);
    let replicas = [start("a", "2"), start("b", "2")];
    assert!(
        wait_until(Duration::from_secs(20), || running(0) && running(1)).await,
        "the two shards never ran"
    );
    let (code, said) = resize(&name, "4");
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("2 -> 4"), "{said}");
    assert!(
        wait_until(Duration::from_secs(20), || (0..4).all(running)).await,
        "not every shard ran after growing to 4: {:?}",
        (0..4).map(running).collect::<Vec<_>>()
    );
    let (code, said) = resize(&name, "1");
    assert_eq!(code, Some(0), "{said}");
    assert!(
        wait_until(Duration::from_secs(20), || running(0)
            && !(1..4).any(running))
        .await,
        "shards past the count still run: {:?}",
        (0..4).map(running).collect::<Vec<_>>()
    );
    let starts: Vec<usize> = (1..4)
        .map(|s| events(&log(s)).iter().filter(|e| e.start).count())
        .collect();
    // An old manifest: refused, in one line naming the command that resizes.
    let mut old = start("c", "2");
    let status = timeout(Duration::from_secs(20), old.wait())
        .await
        .expect("the replica with the old count exits")
        .expect("wait");
    assert_eq!(status.code(), Some(11));
    let refused = std::fs::read_to_string(stderr_of(dir.path(), "c")).unwrap_or_default();
    assert!(refused.contains("leader shards resize"), "{refused}");
    sleep(LEASE).await;
    let later: Vec<usize> = (1..4)
        .map(|s| events(&log(s)).iter().filter(|e| e.start).count())
        .collect();
    assert_eq!(starts, later, "a removed shard's COMMAND started again");
    for child in replicas {
        stop(child).await;
    }
    let (code, said) = resize("never-ran", "3");
    assert_eq!(code, Some(6), "{said}");
    assert_eq!(said.trim().lines().count(), 1, "{said}");
}

on_each_backend!(a_set_resized_while_its_replicas_run:
    file_lock_set_resized_while_its_replicas_run => Some(leader_tests::FileLock::in_temp_dir()),
    postgres_lock_set_resized_while_its_replicas_run => leader_test_support::postgres_lock_or_skip(),
    redis_lock_set_resized_while_its_replicas_run => leader_test_support::redis_lock_or_skip(),
    etcd_lock_set_resized_while_its_replicas_run => leader_test_support::etcd_lock_or_skip(),
);

/// `--weight` and `leader shards drain|undrain --wait` on the file lock: a replica of weight 3
/// runs three of four shards beside one of weight 1; drained, it hands them all to the other
/// (`leader status` says so) and runs none; undrained, it takes its three back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_and_drains() {
    const SHARDS: u32 = 4;
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let name = format!("weights-{:08x}", fastrand::u32(..));
    let start = |identity: &str, weight: &str| {
        Replica {
            args: &["--shards", "4", "--weight", weight],
            ..Replica::of(&lock, &name, dir.path())
        }
        .start(identity)
    };
    let leader = |args: &[&str]| leader(&[args, &["--lock", &lock, "--name", &name]].concat());
    let runs = |identity: &str| {
        (0..SHARDS)
            .filter(|shard| {
                events(&dir.path().join(format!("job.log.{shard}")))
                    .last()
                    .is_some_and(|e| e.start && e.identity == identity)
            })
            .count()
    };
    let replicas = [start("big", "3"), start("small", "1")];
    assert!(
        wait_until(Duration::from_secs(20), || runs("big") == 3
            && runs("small") == 1)
        .await,
        "not by weight: big {}, small {}",
        runs("big"),
        runs("small")
    );
    sleep(LEASE * 2).await;
    assert_eq!(
        (runs("big"), runs("small")),
        (3, 1),
        "not settled by weight"
    );
    let (code, said) = leader(&["shards", "drain", "big", "--wait", "--timeout", "20s"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        wait_until(Duration::from_secs(10), || runs("small") == 4).await,
        "the drained replica's shards did not move: small runs {}",
        runs("small")
    );
    assert_eq!(runs("big"), 0);
    let (_, status) = leader(&["status", "--shards"]);
    assert!(status.contains("drained"), "{status}");
    let (code, said) = leader(&["shards", "undrain", "big", "--wait", "--timeout", "20s"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        wait_until(Duration::from_secs(10), || runs("big") == 3).await,
        "undrained, big runs {}",
        runs("big")
    );
    // Settled there, not passing through.
    sleep(LEASE * 2).await;
    assert_eq!((runs("big"), runs("small")), (3, 1));
    let (code, said) = leader(&["shards", "drain", "nobody-yet"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("not a member"), "{said}");
    for child in replicas {
        stop(child).await;
    }
}

/// `leader shards resize` reaches the COMMANDs (S17): two replicas of a set of 2 shards, grown
/// to 4 then shrunk to 3. After each resize every shard's COMMAND runs under the new count
/// (`LEADER_SHARD_COUNT`), the COMMANDs under the old count have all stopped, and on each
/// replica the last COMMAND under the old count stopped before the first under the new count
/// started. The COMMAND logs to `job.log.cCOUNT.SHARD`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resize_restarts_every_command_under_the_new_count() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let name = format!("recount-{:08x}", fastrand::u32(..));
    let command = [
        "sh",
        "-c",
        r#"JOB_LOG="$JOB_LOG.c$LEADER_SHARD_COUNT" exec "$0""#,
        JOB,
    ];
    let replica = Replica {
        args: &["--shards", "2"],
        command: &command,
        ..Replica::of(&lock, &name, dir.path())
    };
    let start = |identity: &str| replica.start(identity);
    let log = |count: u32, shard: u32| dir.path().join(format!("job.log.c{count}.{shard}"));
    let running =
        |count: u32, shard: u32| events(&log(count, shard)).last().is_some_and(|e| e.start);
    // Every shard runs under `count`, none under `old`.
    let under = |count: u32, old: u32| {
        (0..count).all(|s| running(count, s)) && !(0..old).any(|s| running(old, s))
    };
    // On each replica, every event under `old` came before the first start under `new`.
    let in_order = |old: u32, new: u32| {
        for identity in ["a", "b"] {
            let last_old = (0..old)
                .flat_map(|s| events(&log(old, s)))
                .filter(|e| e.identity == identity)
                .map(|e| e.at)
                .max();
            let first_new = (0..new)
                .flat_map(|s| events(&log(new, s)))
                .filter(|e| e.identity == identity && e.start)
                .map(|e| e.at)
                .min();
            if let (Some(last_old), Some(first_new)) = (last_old, first_new) {
                assert!(
                    last_old < first_new,
                    "{identity} ran a COMMAND under {old} shards beside one under {new}"
                );
            }
        }
    };
    let replicas = [start("a"), start("b")];
    assert!(
        wait_until(Duration::from_secs(20), || (0..2).all(|s| running(2, s))).await,
        "the two shards never ran"
    );
    // Resized from `old` shards to `count`: every COMMAND runs under the new count, in order.
    let resize = async |old: u32, count: u32| {
        let count_arg = count.to_string();
        let (code, said) = leader(&[
            "shards", "resize", "--lock", &lock, "--name", &name, &count_arg,
        ]);
        assert_eq!(code, Some(0), "{said}");
        assert!(
            wait_until(Duration::from_secs(20), || under(count, old)).await,
            "not every shard ran under {count}: {:?}",
            (0..count).map(|s| running(count, s)).collect::<Vec<_>>()
        );
        in_order(old, count);
    };
    resize(2, 4).await;
    resize(4, 3).await;
    // Settled: nothing starts again under an old count.
    sleep(LEASE).await;
    assert!(under(3, 4) && !(0..2).any(|s| running(2, s)));
    for child in replicas {
        stop(child).await;
    }
}
