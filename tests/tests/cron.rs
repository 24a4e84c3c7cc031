//! End to end: three `leader cron --every 1s` replicas per store (file, Postgres, Redis, etcd),
//! each firing appending its scheduled instant and attempt to a file; the leader SIGKILLed twice,
//! and started again under a new identity. Every scheduled instant from the first to the last is
//! started once (a later attempt only for a firing whose leader died while it ran, which may have
//! died before its COMMAND wrote a line), or counted
//! as missed in the store (the default policy runs the latest missed firing late and counts the
//! others); `leader status` shows the schedule. Bad schedules exit 9; a replica started with
//! another schedule under the same name exits 10 and changes nothing. Operators' requests
//! (suspend, trigger, resume, cancel) act through the record; a leader whose wall clock steps
//! back an hour and forward again (libfaketime) runs no firing twice.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use chrono::{DateTime, Utc};
use leader_tests::on_each_backend;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::time::sleep;

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");

fn replica(lock: &str, name: &str, identity: &str, out: &Path, every: &str) -> Child {
    replica_command(lock, name, identity, out, every)
        .spawn()
        .expect("spawn leader cron")
}

fn replica_command(lock: &str, name: &str, identity: &str, out: &Path, every: &str) -> Command {
    let mut command = cron(lock, name, identity);
    command
        .args(["--every", every])
        .args(["--lease-duration", "2s", "--renew-deadline", "1500ms"])
        .args(["--retry-period", "250ms"])
        .arg("--")
        .args([
            "sh",
            "-c",
            &format!(
                "echo \"$LEADER_FIRING_SCHEDULED $LEADER_FIRING_ATTEMPT $LEADER_FENCING_TOKEN\" >> {}; sleep 0.2",
                out.display()
            ),
        ])
        .env(
            "RUST_LOG",
            std::env::var("E2E_LOG").unwrap_or_else(|_| "warn".into()),
        );
    command
}

/// Sends SIGTERM to a running `leader cron` process.
fn terminate(child: &Child) {
    let _ = kill(
        Pid::from_raw(i32::try_from(child.id().expect("running")).expect("pid")),
        Signal::SIGTERM,
    );
}

/// [`terminate`], then waits up to 10 s for it to exit.
async fn stop(child: &mut Child) {
    terminate(child);
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
}

/// `leader cron` of schedule `name` on `lock` as `identity`, its output dropped, killed when
/// dropped: the schedule, more flags and COMMAND are for the caller to add.
fn cron(lock: &str, name: &str, identity: &str) -> Command {
    leader_tests::candidate_command(LEADER, "cron", lock, name, identity)
}

/// `leader cron WHAT` (an operator's request) for schedule `name` on `lock`, asked by alice.
async fn request(what: &str, lock: &str, name: &str) -> std::process::Output {
    Command::new(LEADER)
        .args([
            "cron", what, "--lock", lock, "--name", name, "--by", "alice",
        ])
        .output()
        .await
        .expect("leader cron request")
}

/// The lines a COMMAND wrote to `out` so far.
fn lines_of(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// `leader status --json` of the election.
async fn status(lock: &str, name: &str) -> serde_json::Value {
    let output = Command::new(LEADER)
        .args(["status", "--json", "--lock", lock, "--name", name])
        .output()
        .await
        .expect("leader status");
    serde_json::from_slice(&output.stdout).unwrap_or(serde_json::Value::Null)
}

async fn firings(lock: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("firings");
    let name = format!("cron-{:08x}", fastrand::u32(..));
    let mut replicas: Vec<(String, Child)> = (0..3)
        .map(|i| {
            let identity = format!("r{i}");
            let child = replica(lock, &name, &identity, &out, "1s");
            (identity, child)
        })
        .collect();
    sleep(Duration::from_secs(4)).await;
    for round in 0..2 {
        let holder = status(lock, &name).await["holder"]
            .as_str()
            .map(str::to_owned)
            .expect("a leader");
        let slot = replicas
            .iter()
            .position(|(identity, _)| *identity == holder)
            .expect("the leader is one of ours");
        let pid = replicas[slot].1.id().expect("running");
        let _ = kill(
            Pid::from_raw(i32::try_from(pid).expect("pid")),
            Signal::SIGKILL,
        );
        let _ = replicas[slot].1.wait().await;
        sleep(Duration::from_secs(5)).await;
        let identity = format!("r{slot}.{round}");
        replicas[slot] = (
            identity.clone(),
            replica(lock, &name, &identity, &out, "1s"),
        );
    }
    sleep(Duration::from_secs(2)).await;
    let shown = status(lock, &name).await;
    for (_, child) in &mut replicas {
        if let Some(pid) = child.id() {
            let _ = kill(
                Pid::from_raw(i32::try_from(pid).expect("pid")),
                Signal::SIGTERM,
            );
        }
    }
    for (_, child) in &mut replicas {
        let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    }
    let schedule = &shown["schedules"][0];
    assert_eq!(
        schedule["name"],
        name.as_str(),
        "status shows the schedule: {shown}"
    );
    assert_eq!(schedule["schedule"], "every 1s", "{shown}");
    assert!(schedule["next"].is_string(), "and its next firing: {shown}");
    let missed = schedule["missed"].as_u64().expect("missed count");

    let text = std::fs::read_to_string(&out).expect("firings");
    let mut attempts: BTreeMap<DateTime<Utc>, Vec<u32>> = BTreeMap::new();
    for line in text.lines() {
        let mut fields = line.split(' ');
        let scheduled = fields
            .next()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .expect("an instant")
            .with_timezone(&Utc);
        let attempt: u32 = fields.next().and_then(|a| a.parse().ok()).expect("attempt");
        attempts.entry(scheduled).or_default().push(attempt);
    }
    for (scheduled, runs) in &attempts {
        // Once per attempt, in turn: no attempt twice, each after the one before, and no more
        // attempts than leaders killed plus one. An attempt may have left no line: its leader
        // was killed after recording the firing's start and before COMMAND wrote (the next
        // leader then runs attempt 2 of a firing that shows no attempt 1).
        assert!(
            runs.windows(2).all(|pair| pair[0] < pair[1])
                && runs.iter().all(|attempt| (1..=3).contains(attempt)),
            "{lock}: {scheduled} started once per attempt, attempts in turn: {runs:?}\n{text}"
        );
    }
    let first = *attempts.keys().next().expect("firings");
    let last = *attempts.keys().last().expect("firings");
    let span = u64::try_from((last - first).num_seconds()).expect("ordered") + 1;
    let started = attempts.len() as u64;
    assert!(
        started + missed >= span,
        "{lock}: {span} instants from {first} to {last}, {started} started, {missed} counted missed: some were lost\n{text}"
    );
    assert!(
        started >= span.saturating_sub(8),
        "{lock}: two failovers of a 2 s lease miss a few firings, not {}\n{text}",
        span - started
    );
}

on_each_backend!(firings:
    file_lock_firings_survive_killed_leaders => Some(leader_tests::FileLock::in_temp_dir()),
    postgres_firings_survive_killed_leaders => leader_test_support::postgres_lock_or_skip(),
    redis_firings_survive_killed_leaders => leader_test_support::redis_lock_or_skip(),
    etcd_firings_survive_killed_leaders => leader_test_support::etcd_lock_or_skip(),
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_schedules_exit_9_in_one_line() {
    let lock = leader_tests::FileLock::in_temp_dir();
    for args in [
        vec!["--schedule", "0 0 30 2 *"],
        vec!["--schedule", "61 * * * *"],
        vec!["--schedule", "0 3 * * *", "--time-zone", "Europe/Nowhere"],
        vec!["--every", "500ms"],
    ] {
        let output = Command::new(LEADER)
            .args(["cron", "--lock", &lock, "--name", "bad"])
            .args(&args)
            .args(["--", "true"])
            .output()
            .await
            .expect("leader cron");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(9), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_another_schedule_exits_10_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let out = dir.path().join("firings");
    let mut first = replica(&lock, "mixed", "a", &out, "1s");
    sleep(Duration::from_secs(3)).await;
    terminate(&first);
    let _ = first.wait().await;
    let before = status(&lock, "mixed").await["schedules"].clone();
    let mut other = replica_command(&lock, "mixed", "b", &out, "2s")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn leader cron");
    let code = tokio::time::timeout(Duration::from_secs(20), other.wait())
        .await
        .expect("exits")
        .expect("status")
        .code();
    assert_eq!(code, Some(10));
    // One line, naming the flags that change a schedule.
    let mut stderr = String::new();
    if let Some(mut pipe) = other.stderr.take() {
        use tokio::io::AsyncReadExt;
        let _ = pipe.read_to_string(&mut stderr).await;
    }
    assert!(
        stderr.contains("--adopt-schedule") && stderr.contains("--schedule-revision"),
        "{stderr}"
    );
    assert_eq!(
        status(&lock, "mixed").await["schedules"],
        before,
        "the stored schedule is unchanged"
    );
    // With --adopt-schedule the new schedule replaces the stored one.
    let mut adopting = cron(&lock, "mixed", "c")
        .args(["--every", "2s", "--adopt-schedule", "--", "true"])
        .spawn()
        .expect("spawn leader cron");
    sleep(Duration::from_secs(4)).await;
    assert!(adopting.try_wait().expect("status").is_none(), "it runs");
    let after = status(&lock, "mixed").await;
    assert_eq!(after["schedules"][0]["schedule"], "every 2s", "{after:#}");
    assert_eq!(after["schedules"][0]["changed"]["by"], "c", "{after:#}");
    assert_eq!(
        after["schedules"][0]["changed"]["from"], "every 1s",
        "{after:#}"
    );
    terminate(&adopting);
    let _ = adopting.wait().await;
}

/// A schedule changed with `--adopt-schedule` runs none of the new schedule's instants
/// between the last one handled and the change: its first firing is its first instant after
/// the change. (A nightly `0 3 * * *` changed to `0 4 * * *` at 10:00 waits for tomorrow 04:00;
/// here, in seconds: an instant of the new schedule passes between the state's creation and
/// the change, and is not run.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_schedule_first_fires_after_the_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let out = dir.path().join("firings");
    let spawn = |identity: &str, schedule: &str, adopt: bool| {
        let mut command = cron(&lock, "changed", identity);
        command.args(["--schedule", schedule, "--retry-period", "250ms"]);
        if adopt {
            command.arg("--adopt-schedule");
        }
        command
            .args([
                "--",
                "sh",
                "-c",
                &format!("echo \"$LEADER_FIRING_SCHEDULED\" >> {}", out.display()),
            ])
            .spawn()
            .expect("spawn leader cron")
    };
    // The first configuration (yearly: it does not fire here) writes the state as it leads.
    let mut first = spawn("a", "0 0 1 1 *", false);
    let mut seen = None;
    for _ in 0..40 {
        let shown = status(&lock, "changed").await;
        if shown["schedules"][0]["schedule"].is_string() {
            seen = Some(Utc::now());
            break;
        }
        sleep(Duration::from_millis(250)).await;
    }
    let seen = seen.expect("the state is written");
    terminate(&first);
    let _ = first.wait().await;
    // An instant of the new schedule (once a minute, at this second) passes after the state
    // was written and before the change.
    let instant = seen + chrono::Duration::seconds(2);
    let second = chrono::Timelike::second(&instant);
    while Utc::now() < instant + chrono::Duration::seconds(2) {
        sleep(Duration::from_millis(200)).await;
    }
    let mut changed = spawn("b", &format!("{second} * * * * *"), true);
    sleep(Duration::from_secs(6)).await;
    let shown = status(&lock, "changed").await;
    stop(&mut changed).await;
    let schedule = &shown["schedules"][0];
    assert_eq!(
        schedule["schedule"],
        format!("cron {second} * * * * * in UTC"),
        "{shown:#}"
    );
    assert_eq!(schedule["changed"]["by"], "b", "{shown:#}");
    let ran = std::fs::read_to_string(&out).unwrap_or_default();
    assert!(
        ran.is_empty(),
        "the instant {instant} before the change ran:\n{ran}"
    );
}

/// `--overlap replace` with a COMMAND that takes 1.5 s to exit after SIGTERM (within its
/// `--grace`), every 2 s, each running longer than that: each firing stops the one before and
/// starts only once it has exited, so no two COMMANDs ever run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replace_starts_a_firing_only_after_the_replaced_command_exited() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let out = dir.path().join("firings");
    let script = format!(
        "echo \"start $LEADER_FIRING_SCHEDULED\" >> {out}; \
         trap 'sleep 1.5; echo \"end $LEADER_FIRING_SCHEDULED\" >> {out}; exit 0' TERM; \
         sleep 30 & wait; echo \"end $LEADER_FIRING_SCHEDULED\" >> {out}",
        out = out.display()
    );
    let mut leader = cron(&lock, "replaced", "a")
        .args(["--every", "2s", "--overlap", "replace", "--grace", "5s"])
        .args(["--", "sh", "-c", &script])
        .spawn()
        .expect("spawn leader cron");
    sleep(Duration::from_secs(11)).await;
    let status = status(&lock, "replaced").await;
    stop(&mut leader).await;
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let mut running = 0_i32;
    let mut starts = 0;
    for line in text.lines() {
        if line.starts_with("start") {
            running += 1;
            starts += 1;
        } else {
            running -= 1;
        }
        assert!(running <= 1, "two COMMANDs at once:\n{text}");
    }
    assert!(starts >= 3, "firings replaced one another:\n{text}");
    let schedule = &status["schedules"][0];
    assert_eq!(
        schedule["last"]["outcome"]["kind"], "replaced",
        "{status:#}"
    );
    let history = schedule["history"].as_array().expect("a history");
    assert!(history.len() >= 2, "{status:#}");
    for ended in history {
        assert_eq!(ended["identity"], "a", "{status:#}");
        assert!(ended["fencingToken"].as_u64().is_some(), "{status:#}");
        assert!(ended["startedAt"].as_str().is_some(), "{status:#}");
    }
}

/// `leader cron suspend`, `trigger` and `resume` on a running schedule (every 2 s), through the
/// record: while suspended no scheduled firing starts, a trigger still runs once with who asked
/// for it, and after `resume` the schedule runs again; a request for a schedule that is not
/// there exits 6 in one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspend_trigger_and_resume_act_through_the_record() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let out = dir.path().join("firings");
    let script = format!(
        "echo \"$LEADER_FIRING_SCHEDULED ${{LEADER_FIRING_TRIGGERED_BY:-schedule}}\" >> {}",
        out.display()
    );
    let mut leader = cron(&lock, "ops", "a")
        .args(["--every", "2s", "--retry-period", "250ms"])
        .args(["--", "sh", "-c", &script])
        .spawn()
        .expect("spawn leader cron");
    let request = async |what: &str, name: &str| request(what, &lock, name).await;
    let lines = || lines_of(&out);
    sleep(Duration::from_secs(5)).await;
    assert!(request("suspend", "ops").await.status.success());
    // The leader finds the request within a renewal and a second; a loaded machine may take
    // longer, so wait until nothing has started for 5 s (two firing periods and more).
    let mut suspended = lines().len();
    for _ in 0..10 {
        sleep(Duration::from_secs(5)).await;
        let now = lines().len();
        if now == suspended {
            break;
        }
        suspended = now;
    }
    assert!(suspended >= 1, "{:?}", lines());
    let shown = status(&lock, "ops").await;
    assert_eq!(
        shown["schedules"][0]["suspended"]["by"], "alice",
        "{shown:#}"
    );
    assert!(request("trigger", "ops").await.status.success());
    for _ in 0..20 {
        if lines().len() > suspended {
            break;
        }
        sleep(Duration::from_millis(500)).await;
    }
    sleep(Duration::from_secs(4)).await;
    let during = lines();
    assert_eq!(
        during.len(),
        suspended + 1,
        "only the trigger ran: {during:?}"
    );
    assert!(during[suspended].ends_with(" alice"), "{during:?}");
    assert!(request("resume", "ops").await.status.success());
    sleep(Duration::from_secs(5)).await;
    let after = lines();
    assert!(
        after.len() >= during.len() + 2,
        "the schedule runs again: {after:?}"
    );
    let none = request("trigger", "nothing-here").await;
    assert_eq!(none.status.code(), Some(6));
    assert_eq!(String::from_utf8_lossy(&none.stderr).lines().count(), 1);
    let shown = status(&lock, "ops").await;
    stop(&mut leader).await;
    let history = shown["schedules"][0]["history"]
        .as_array()
        .expect("history");
    assert!(
        history.iter().any(|e| e["triggeredBy"] == "alice"),
        "{shown:#}"
    );
}

/// A firing asked for now whose COMMAND runs past `--timeout` is stopped, recorded as timed
/// out, and run again once by `--retries 1` after `--retry-backoff`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_past_its_timeout_is_stopped_and_retried() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let out = dir.path().join("attempts");
    let script = format!(
        "echo \"$LEADER_FIRING_ATTEMPT\" >> {}; exec sleep 30",
        out.display()
    );
    let mut leader = cron(&lock, "slow", "a")
        .args(["--every", "1h", "--retry-period", "250ms"])
        .args(["--timeout", "1s", "--retries", "1", "--retry-backoff", "1s"])
        .args(["--grace", "1s", "--", "sh", "-c", &script])
        .spawn()
        .expect("spawn leader cron");
    sleep(Duration::from_secs(2)).await;
    let asked = Command::new(LEADER)
        .args(["cron", "trigger", "--lock", &lock, "--name", "slow"])
        .output()
        .await
        .expect("leader cron trigger");
    assert!(asked.status.success(), "{asked:?}");
    sleep(Duration::from_secs(8)).await;
    let shown = status(&lock, "slow").await;
    stop(&mut leader).await;
    let attempts = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(
        attempts.lines().collect::<Vec<_>>(),
        ["1", "2"],
        "{shown:#}"
    );
    let history = shown["schedules"][0]["history"]
        .as_array()
        .expect("history");
    let kinds: Vec<&str> = history
        .iter()
        .filter_map(|e| e["outcome"]["kind"].as_str())
        .collect();
    assert_eq!(kinds, ["timedOut", "timedOut"], "{shown:#}");
}

/// `leader cron cancel` on a firing whose COMMAND runs: the COMMAND gets SIGTERM (and exits
/// within its grace), the firing is recorded as cancelled with who asked, and `--retries 1`
/// does not run it again; with nothing left to cancel, the request exits 6 in one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_command_and_nothing_retries_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let out = dir.path().join("attempts");
    let script = format!(
        "echo \"$LEADER_FIRING_ATTEMPT\" >> {out}; \
         trap 'echo stopped >> {out}; exit 0' TERM; sleep 30 & wait",
        out = out.display()
    );
    let mut leader = cron(&lock, "long", "a")
        .args(["--every", "1h", "--retry-period", "250ms"])
        .args(["--retries", "1", "--retry-backoff", "1s", "--grace", "5s"])
        .args(["--", "sh", "-c", &script])
        .spawn()
        .expect("spawn leader cron");
    let request = async |what: &str| request(what, &lock, "long").await;
    let lines = || lines_of(&out);
    sleep(Duration::from_secs(2)).await;
    assert!(request("trigger").await.status.success());
    for _ in 0..40 {
        if !lines().is_empty() {
            break;
        }
        sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(lines(), ["1"], "the triggered firing runs");
    let cancelled = request("cancel").await;
    let said = String::from_utf8_lossy(&cancelled.stdout);
    assert!(cancelled.status.success(), "{cancelled:?}");
    assert!(said.contains("cancels the firing scheduled at"), "{said}");
    for _ in 0..40 {
        if lines().len() > 1 {
            break;
        }
        sleep(Duration::from_millis(250)).await;
    }
    // Past the retry's back-off: nothing runs it again.
    sleep(Duration::from_secs(4)).await;
    assert_eq!(lines(), ["1", "stopped"], "stopped once, never retried");
    let shown = status(&lock, "long").await;
    let schedule = &shown["schedules"][0];
    assert_eq!(
        schedule["last"]["outcome"]["kind"], "cancelled",
        "{shown:#}"
    );
    assert_eq!(schedule["last"]["outcome"]["by"], "alice", "{shown:#}");
    assert_eq!(schedule["running"], serde_json::json!([]), "{shown:#}");
    assert!(
        schedule["retrying"].as_array().is_none_or(Vec::is_empty),
        "{shown:#}"
    );
    let nothing = request("cancel").await;
    assert_eq!(nothing.status.code(), Some(6), "{nothing:?}");
    assert_eq!(String::from_utf8_lossy(&nothing.stderr).lines().count(), 1);
    stop(&mut leader).await;
}

/// Sets the wall clock of the processes that read `file` (libfaketime) to `offset`, at once:
/// written beside it and renamed over it, so that no reader finds it half written.
fn step_clock(file: &Path, offset: &str) {
    let next = file.with_extension("next");
    std::fs::write(&next, offset).expect("the clock's offset");
    std::fs::rename(&next, file).expect("the clock's offset");
}

/// A `leader cron --every 1s` leader whose wall clock (libfaketime; its monotonic clock is
/// left alone) steps back an hour, then forward an hour, a few seconds later. Each firing
/// runs at most once: no instant twice, none from the hour the clock stepped back to, no more
/// than the seconds that passed. While the clock reads behind, nothing runs (the leader
/// waits for its clock to pass the last instant handled again); within a few seconds of the
/// step forward the firings go on, the ones of the span behind found late: the latest runs
/// late and the others are counted missed, so every instant ran or is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_clock_steps_back_and_forward_runs_no_firing_twice() {
    let Some(faketime) = leader_test_support::faketime_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = leader_tests::file_lock_in(dir.path());
    let out = dir.path().join("firings");
    let offset = dir.path().join("clock-offset");
    step_clock(&offset, "+0");
    let began = Utc::now();
    let mut leader = replica_command(&lock, "stepped", "a", &out, "1s")
        .envs(leader_test_support::faketime_env(&faketime, &offset))
        .spawn()
        .expect("spawn leader cron");
    let read = || -> Vec<(DateTime<Utc>, u32)> {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let mut fields = line.split(' ');
                let at = DateTime::parse_from_rfc3339(fields.next()?).ok()?;
                Some((at.with_timezone(&Utc), fields.next()?.parse().ok()?))
            })
            .collect()
    };
    for _ in 0..60 {
        if read().len() >= 3 {
            break;
        }
        sleep(Duration::from_millis(250)).await;
    }
    assert!(read().len() >= 3, "the schedule runs: {:?}", read());
    let back = Utc::now();
    step_clock(&offset, "-1h");
    sleep(Duration::from_secs(8)).await;
    let forward = Utc::now();
    step_clock(&offset, "+0");
    sleep(Duration::from_secs(8)).await;
    let shown = status(&lock, "stepped").await;
    stop(&mut leader).await;
    let ended = Utc::now();
    let firings = read();
    let text = format!("{firings:?}\n{shown:#}");
    let seconds = |at: DateTime<Utc>| at.timestamp();
    // Safety: each instant once, all of them the schedule's own by the real clock (none from
    // the hour behind), and no more than the seconds that passed.
    let mut instants: Vec<i64> = firings.iter().map(|(at, _)| seconds(*at)).collect();
    instants.sort_unstable();
    let count = instants.len();
    instants.dedup();
    assert_eq!(instants.len(), count, "a firing ran twice: {text}");
    assert!(firings.iter().all(|(_, attempt)| *attempt == 1), "{text}");
    assert!(
        instants
            .iter()
            .all(|at| (seconds(began)..=seconds(ended)).contains(at)),
        "a firing from outside {began}..{ended}: {text}"
    );
    let elapsed = seconds(ended) - seconds(began) + 1;
    assert!(i64::try_from(count).expect("count") <= elapsed, "{text}");
    // While the clock read an hour behind, nothing ran (a margin of 2 s each side).
    assert!(
        !instants
            .iter()
            .any(|at| (seconds(back) + 2..=seconds(forward) - 2).contains(at)),
        "a firing ran while the clock read behind: {text}"
    );
    // Within a few seconds of the step forward the schedule goes on, each second again.
    let after: Vec<&i64> = instants
        .iter()
        .filter(|at| **at >= seconds(forward) + 3)
        .collect();
    assert!(
        after.len() >= 3,
        "the schedule stalled after the step forward: {text}"
    );
    // Nothing lost uncounted: each instant from the first to the last ran or is counted
    // missed, and the missed ones are the span the clock read behind (with 6 s of margin).
    let missed = shown["schedules"][0]["missed"]
        .as_i64()
        .expect("missed count");
    let (first, last) = (instants[0], instants[instants.len() - 1]);
    let span = last - first + 1;
    assert!(
        i64::try_from(count).expect("count") + missed >= span,
        "{span} instants, {count} ran, {missed} counted missed: {text}"
    );
    assert!(
        missed <= seconds(forward) - seconds(back) + 6,
        "{missed} missed: {text}"
    );
}
