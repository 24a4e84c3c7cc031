use super::*;

fn alive(pid: i32) -> bool {
    nix::sys::signal::kill(Pid::from_raw(pid), None).is_ok()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, s)| s.starts_with('Z'))
        })
}

/// A group dropped while it runs goes whole: its leader (the supervisor's place) and the
/// process it started (COMMAND's). A kill of the leader alone left the second running.
#[tokio::test]
async fn a_group_dropped_while_running_is_killed_whole() {
    let pidfile = std::env::temp_dir().join(format!("leader-group-{}.pid", std::process::id()));
    let _ = std::fs::remove_file(&pidfile);
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!("sleep 300 & echo $! > {}; wait", pidfile.display()))
        .process_group(0)
        .kill_on_drop(true);
    let group = Group {
        child: command.spawn().expect("sh"),
        pgid: None,
        watchdog: None,
        feed: None,
    };
    let started = tokio::time::Instant::now();
    let pid = loop {
        if let Some(pid) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            break pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no pid written"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(alive(pid));
    drop(group);
    let dropped = tokio::time::Instant::now();
    while alive(pid) {
        assert!(
            dropped.elapsed() < Duration::from_secs(5),
            "the group's other process outlived the drop"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = std::fs::remove_file(&pidfile);
}

/// The watchdog's end of a deadline feed nobody reads.
fn feed() -> Feed {
    Feed::pair().expect("socket pair").1
}

fn sleeper() -> (Child, Pid) {
    let child = Command::new("sleep")
        .arg("300")
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .expect("sleep");
    let pid = Pid::from_raw(child.id().expect("pid").cast_signed());
    (child, pid)
}

async fn dies_within(pid: Pid, within: Duration) -> bool {
    let started = tokio::time::Instant::now();
    while started.elapsed() < within {
        if !alive(pid.as_raw()) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// The watchdog kills a COMMAND still running past its term's deadline plus the delay, from
/// a thread of its own (whatever the runtime does); a deadline that renewals keep moving
/// keeps it alive; a dropped watchdog kills nothing.
#[tokio::test]
async fn the_watchdog_kills_a_command_past_its_deadline_only() {
    let now = std::time::Instant::now;
    let delay = Duration::from_millis(100);

    let (mut past, pid) = sleeper();
    let backstop = Backstop {
        deadline: TermDeadline::new(now()),
        after: delay,
        last: Duration::from_secs(3600),
        grace: Duration::ZERO,
    };
    let _watchdog = Watchdog::start(pid, backstop.clone(), feed()).expect("watchdog");
    assert!(dies_within(pid, Duration::from_secs(5)).await, "not killed");
    let _ = past.wait().await;

    let (mut renewed, pid) = sleeper();
    let deadline = TermDeadline::new(now() + delay);
    let watchdog = Watchdog::start(
        pid,
        Backstop {
            deadline: deadline.clone(),
            after: delay,
            last: Duration::from_secs(3600),
            grace: Duration::ZERO,
        },
        feed(),
    )
    .expect("watchdog");
    for _ in 0..20 {
        deadline.set(now() + delay);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(alive(pid.as_raw()), "killed while its deadline moved on");
    // Renewals stop: killed within the deadline and the delay.
    assert!(dies_within(pid, Duration::from_secs(5)).await, "not killed");
    let _ = renewed.wait().await;
    drop(watchdog);

    let (mut stopped, pid) = sleeper();
    let watchdog = Watchdog::start(
        pid,
        Backstop {
            deadline: TermDeadline::new(now() + delay),
            after: delay,
            last: Duration::from_secs(3600),
            grace: Duration::ZERO,
        },
        feed(),
    )
    .expect("watchdog");
    drop(watchdog);
    tokio::time::sleep(delay * 4).await;
    assert!(alive(pid.as_raw()), "a dropped watchdog killed");
    let _ = stopped.start_kill();
    let _ = stopped.wait().await;
}

/// A group the watchdog killed ends `PastDeadline`, never as an exit of COMMAND's own: read
/// as a SIGKILL of its own, `leader` exited with 137 after a freeze where it should have gone
/// on as a follower. A COMMAND that exits, or is killed by someone else, ends `Itself`.
#[tokio::test]
async fn a_kill_by_the_watchdog_is_not_an_exit_of_commands_own() {
    let group_of = |command: &mut Command, deadline: std::time::Instant| {
        let child = command
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn");
        let pid = Pid::from_raw(child.id().expect("pid").cast_signed());
        let backstop = Backstop {
            deadline: TermDeadline::new(deadline),
            after: Duration::from_millis(50),
            last: Duration::from_secs(3600),
            grace: Duration::ZERO,
        };
        let watchdog = Watchdog::start(pid, backstop, feed()).expect("watchdog");
        (
            Group {
                child,
                pgid: Some(pid),
                watchdog: Some(watchdog),
                feed: None,
            },
            pid,
        )
    };
    let now = std::time::Instant::now();
    let later = now + Duration::from_secs(300);

    let (mut past, _) = group_of(Command::new("sleep").arg("300"), now);
    let ended = tokio::time::timeout(Duration::from_secs(10), past.wait()).await;
    assert_eq!(ended, Ok(Ended::PastDeadline), "killed by the watchdog");

    let (mut exits, _) = group_of(Command::new("sh").args(["-c", "exit 3"]), later);
    assert_eq!(exits.wait().await, Ended::Itself(3));

    let (mut killed, pid) = group_of(Command::new("sleep").arg("300"), later);
    let _ = killpg(pid, Signal::SIGKILL);
    assert_eq!(killed.wait().await, Ended::Itself(137));

    // Killed by the supervisor, which says so on its socket (`leader` was stopped): the term
    // was over. A SIGKILL it did not announce is someone else's.
    for announced in [true, false] {
        let (theirs, feed) = Feed::pair().expect("socket pair");
        let (child, pid) = sleeper();
        let mut group = Group {
            child,
            pgid: Some(pid),
            watchdog: None,
            feed: Some(feed.socket),
        };
        if announced {
            use std::io::Write;
            std::os::unix::net::UnixStream::from(theirs)
                .write_all(&[KILLED])
                .expect("write");
        }
        let _ = killpg(pid, Signal::SIGKILL);
        let expected = if announced {
            Ended::PastDeadline
        } else {
            Ended::Itself(137)
        };
        assert_eq!(group.wait().await, expected);
    }
}

/// The delay leaves COMMAND its grace and ends half way to the end of the lease; the
/// supervisor's, three quarters of the way.
#[test]
fn the_backstop_falls_between_the_grace_and_the_lease() {
    let timings = Timings {
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_secs(2),
    };
    let backstop = Backstop::new(
        TermDeadline::new(std::time::Instant::now()),
        Duration::from_secs(3),
        timings,
    );
    assert_eq!(backstop.after, Duration::from_secs(4));
    assert_eq!(backstop.last, Duration::from_millis(4500));
}

/// A supervisor whose parent is not the `leader` that started it (that `leader` died before
/// the supervisor could catch SIGHUP, and the parent-death signal was lost) starts nothing;
/// with its parent in place it starts COMMAND.
#[tokio::test]
async fn a_supervisor_whose_leader_is_gone_starts_nothing() {
    let marker = std::env::temp_dir().join(format!("leader-orphan-{}.marker", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let touch = vec!["touch".to_owned(), marker.display().to_string()];

    // This process is not its own parent: as seen by a supervisor whose `leader` is gone.
    let code = supervise(Some(nix::unistd::getpid()), Duration::ZERO, None, &touch).await;
    assert_eq!(code, exit::ORPHANED);
    assert!(!marker.exists(), "COMMAND ran under an orphaned supervisor");

    let code = supervise(Some(nix::unistd::getppid()), Duration::ZERO, None, &touch).await;
    assert_eq!(code, exit::OK);
    assert!(marker.exists(), "COMMAND did not run under its leader");
    let _ = std::fs::remove_file(&marker);

    assert_eq!(
        supervise(None, Duration::ZERO, None, &touch).await,
        exit::USAGE
    );
}

/// The supervisor reads the instants `leader`'s watchdog sends whole, however the socket cuts
/// them, and keeps the newest; an instant sent again is not sent twice; a closed feed reads as
/// closed.
#[tokio::test]
async fn deadlines_reach_the_supervisor_whole_and_newest_last() {
    use std::io::Write;
    let (theirs, mut feed) = Feed::pair().expect("socket pair");
    let theirs = std::os::unix::net::UnixStream::from(theirs);
    theirs.set_nonblocking(true).expect("non-blocking");
    let theirs = tokio::net::UnixStream::from_std(theirs).expect("tokio socket");
    let now = std::time::Instant::now();
    let later = now + Duration::from_secs(5);
    feed.send(now);
    feed.send(now);
    feed.send(later);
    let mut deadline = Deadline::default();
    assert!(deadline.read(Some(&theirs)).await);
    assert!(deadline.partial.is_empty(), "two whole instants, no more");
    let at = deadline.at.expect("an instant");
    assert!(
        at.abs_diff(monotonic_nanos(later)) < 50_000_000,
        "the newest"
    );

    // Cut in three pieces: read as one.
    let (theirs, ours) = std::os::unix::net::UnixStream::pair().expect("socket pair");
    theirs.set_nonblocking(true).expect("non-blocking");
    let theirs = tokio::net::UnixStream::from_std(theirs).expect("tokio socket");
    let bytes = 42_u64.to_le_bytes();
    let mut deadline = Deadline::default();
    for piece in [&bytes[..3], &bytes[3..5], &bytes[5..]] {
        (&ours).write_all(piece).expect("write");
        assert!(deadline.read(Some(&theirs)).await);
    }
    assert_eq!(deadline.at, Some(42));
    drop(ours);
    assert!(!deadline.read(Some(&theirs)).await, "closed");
    assert_eq!(deadline.at, Some(42), "the last instant stays");
}
