//! The supervised COMMAND: started in its own process group while leading, stopped with SIGTERM
//! then SIGKILL when leadership ends, and never left behind when `leader` itself dies.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use leader_core::{TermDeadline, Timings};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use crate::exit;

/// What to run, and the environment to give it.
#[derive(Clone, Debug)]
pub(crate) struct Program {
    pub(crate) command: Vec<String>,
    pub(crate) name: String,
    pub(crate) identity: String,
    /// More environment for COMMAND (`leader cron`: the firing).
    pub(crate) env: Vec<(String, String)>,
}

impl Program {
    /// Starts the command for the term with `fencing_token`, under a supervisor process: this
    /// same executable run as `leader __supervise PID -- COMMAND...` (PID: this process's),
    /// which leads a new process group and has COMMAND as its child. On Linux the supervisor's
    /// parent-death signal is SIGHUP: should `leader` die (SIGKILL, OOM), the supervisor kills
    /// the whole group, COMMAND's own children included, so nothing it started runs beside the
    /// next leader's COMMAND. A `leader` that dies before the supervisor can catch SIGHUP (the
    /// signal is then lost when SIGHUP is ignored, as under `nohup`) is found by the supervisor
    /// itself: its parent is no longer PID, and it exits without starting COMMAND.
    ///
    /// This runtime has one thread, which lives as long as the process: `PR_SET_PDEATHSIG` fires
    /// when the *thread* that spawned the child exits.
    ///
    /// `term_lock` (a file lock's [`FileLock::term_lock`](leader_core::FileLock::term_lock)) is
    /// inherited by the supervisor and COMMAND, so followers see this term alive until every
    /// process of it is gone, not only `leader`.
    ///
    /// `backstop` starts a watchdog thread that SIGKILLs the group should COMMAND still run
    /// past the term's deadline plus the backstop's delay: the term's end is otherwise acted on
    /// by this process's runtime, which a hang (a deadlock, a blocking call) would stop. The
    /// thread also tells the supervisor, through a socket pair, when it should kill the group
    /// itself ([`Backstop::last`]): a `leader` that is stopped (SIGSTOP, a debugger) renews
    /// nothing and kills nothing, and its COMMAND would otherwise run on beside the next
    /// leader's. The supervisor answers on the same socket when it did.
    pub(crate) fn spawn(
        &self,
        fencing_token: u64,
        term_lock: Option<File>,
        backstop: Backstop,
    ) -> io::Result<Group> {
        let (theirs, mut feed) = Feed::pair()?;
        let mut command = Command::new(this_executable()?);
        command
            .arg0(ARG0)
            .arg(SUPERVISE)
            .arg(std::process::id().to_string())
            .arg(backstop.grace.as_millis().to_string())
            .arg(theirs.as_raw_fd().to_string())
            .arg("--")
            .args(&self.command)
            .env("LEADER_NAME", &self.name)
            .env("LEADER_IDENTITY", &self.identity)
            .env("LEADER_FENCING_TOKEN", fencing_token.to_string())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .process_group(0)
            .kill_on_drop(true);
        set_parent_death_signal(&mut command, Signal::SIGHUP);
        if let Some(file) = &term_lock {
            inherit(&mut command, file.as_raw_fd());
        }
        inherit(&mut command, theirs.as_raw_fd());
        // The supervisor knows its first deadline before it starts COMMAND.
        feed.send(backstop.last_at());
        // The parent's handles close here; the child's copy keeps the lock, and its end of
        // the socket.
        let child = command.spawn()?;
        drop(theirs);
        let told = Arc::clone(&feed.socket);
        let pgid = child.id().map(|id| Pid::from_raw(id.cast_signed()));
        let watchdog = match pgid {
            Some(pgid) => Some(Watchdog::start(pgid, backstop, feed)?),
            None => None,
        };
        Ok(Group {
            child,
            pgid,
            watchdog,
            feed: Some(told),
        })
    }
}

/// The executable the supervisor runs: this one. On Linux `/proc/self/exe`, which names this
/// process's executable even once its file was replaced or removed (an upgrade of `leader` while
/// it runs), where the path it was started from would start another release, or nothing; that
/// path where `/proc` is not mounted.
fn this_executable() -> io::Result<std::path::PathBuf> {
    let own = std::path::Path::new("/proc/self/exe");
    if cfg!(target_os = "linux") && own.exists() {
        Ok(own.into())
    } else {
        // No `/proc` (a chroot without it): the path it was started from.
        std::env::current_exe()
    }
}

/// The name the supervisor shows in `ps`.
const ARG0: &str = "leader";

/// When a COMMAND must be gone at the latest: `after` past the term's deadline (the grace to stop
/// it, and less than the rest of the lease, so that it is gone before another replica may lead).
#[derive(Clone, Debug)]
pub(crate) struct Backstop {
    pub(crate) deadline: TermDeadline,
    pub(crate) after: Duration,
    /// Past the term's deadline, when the supervisor kills the group itself, should this
    /// process not have (it is stopped: SIGSTOP, a debugger): later than `after`, and still
    /// within the lease.
    pub(crate) last: Duration,
    /// The time COMMAND's processes have between SIGTERM and SIGKILL.
    pub(crate) grace: Duration,
}

impl Backstop {
    /// `deadline` with the delays for `grace` and `timings`: this process's watchdog half way
    /// from the end of the grace to the end of the stop window (the lease after the renew
    /// deadline), where COMMAND would run beside the next leader's; the supervisor's three
    /// quarters of the way.
    pub(crate) fn new(deadline: TermDeadline, grace: Duration, timings: Timings) -> Self {
        let left = timings.stop_window().saturating_sub(grace);
        Self {
            deadline,
            after: grace + left / 2,
            last: grace + left / 4 * 3,
            grace,
        }
    }

    /// When the supervisor kills the group unless told of a later deadline.
    fn last_at(&self) -> std::time::Instant {
        self.deadline.get() + self.last
    }
}

/// A thread of its own that SIGKILLs a process group once the term's deadline, plus a delay, has
/// passed without being moved by a renewal; stopped when dropped. The runtime's own timer and
/// SIGTERM come first; this acts only when they did not.
#[derive(Debug)]
struct Watchdog {
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// Set before the watchdog kills the group.
    killed: Arc<AtomicBool>,
}

impl Watchdog {
    fn start(group: Pid, backstop: Backstop, feed: Feed) -> io::Result<Self> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let killed = Arc::new(AtomicBool::new(false));
        let (theirs, kills) = (stop.clone(), killed.clone());
        // The group's leader as started: a number the kernel gave to another process since
        // (the supervisor reaped, the number reused) is never signalled.
        let leader = started_at(group);
        std::thread::Builder::new()
            .name("leader-watchdog".into())
            .spawn(move || watch(group, leader, &backstop, feed, &theirs, &kills))?;
        Ok(Self { stop, killed })
    }

    fn killed(&self) -> bool {
        self.killed.load(Ordering::SeqCst)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (stopped, wake) = &*self.stop;
        *stopped.lock().unwrap_or_else(|p| p.into_inner()) = true;
        wake.notify_one();
    }
}

/// The fields of `/proc/PID/stat` after the command name (the state first), if the process
/// exists.
fn stat_fields(pid: Pid) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(") ")?.1.to_owned())
}

/// Whether process `pid` has ended and waits to be reaped (a zombie).
fn ended(pid: Pid) -> bool {
    stat_fields(pid).is_some_and(|fields| fields.starts_with(['Z', 'X']))
}

/// When process `pid` started (clock ticks since boot, `/proc/PID/stat`), if it exists.
fn started_at(pid: Pid) -> Option<u64> {
    // Field 22, the 20th after the command name.
    stat_fields(pid)?.split(' ').nth(19)?.parse().ok()
}

/// How often the watchdog looks for a deadline that renewals moved, to tell the supervisor.
const FEED_EVERY: Duration = Duration::from_millis(100);

fn watch(
    group: Pid,
    leader: Option<u64>,
    backstop: &Backstop,
    mut feed: Feed,
    stop: &(Mutex<bool>, Condvar),
    killed: &AtomicBool,
) {
    let (stopped, wake) = stop;
    let mut stopped = stopped.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if *stopped {
            return;
        }
        let deadline = backstop.deadline.get();
        feed.send(backstop.last_at());
        let kill_at = deadline + backstop.after;
        let now = std::time::Instant::now();
        if now >= kill_at {
            if leader.is_none() || started_at(group) != leader || ended(group) {
                // The supervisor is gone (or killed the group itself), and its group with it.
                return;
            }
            // Before the kill: whoever reaps the group must know it was not COMMAND's doing.
            killed.store(true, Ordering::SeqCst);
            let _ = killpg(group, Signal::SIGKILL);
            say(format_args!(
                "leader: COMMAND still ran {:?} past its term's deadline (this process was stopped or stuck): killed its process group {group}",
                now - deadline
            ));
            return;
        }
        stopped = wake
            .wait_timeout(stopped, (kill_at - now).min(FEED_EVERY))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// `leader`'s end of the socket pair it shares with a supervisor: it sends the instants by which
/// the supervisor must have killed the group (eight bytes each, [`monotonic_nanos`]), and reads
/// the supervisor's word ([`KILLED`]) that it did. Sends never block (a supervisor that reads
/// nothing must not stop the watchdog): what the socket does not take now goes later, an
/// instant not yet begun replaced by a newer one.
#[derive(Debug)]
struct Feed {
    socket: Arc<std::os::unix::net::UnixStream>,
    /// The instant last sent, or queued.
    sent: Option<std::time::Instant>,
    /// The bytes of an instant the socket took in part, then of the newest one.
    pending: Vec<u8>,
}

/// What a supervisor writes on its socket just before it kills its group.
const KILLED: u8 = b'K';

impl Feed {
    /// The supervisor's end (to inherit), and this process's.
    fn pair() -> io::Result<(OwnedFd, Self)> {
        // Both ends are close-on-exec: the supervisor's is made inheritable for its spawn only.
        let (theirs, ours) = std::os::unix::net::UnixStream::pair()?;
        ours.set_nonblocking(true)?;
        let feed = Self {
            socket: Arc::new(ours),
            sent: None,
            pending: Vec::new(),
        };
        Ok((theirs.into(), feed))
    }

    /// Tells the supervisor to kill the group at `at` unless told of a later instant.
    fn send(&mut self, at: std::time::Instant) {
        use std::io::Write;
        if self.sent != Some(at) {
            self.sent = Some(at);
            // Whole instants not begun are dropped for the newest: part of one the socket took
            // must be finished first.
            self.pending.truncate(self.pending.len() % 8);
            self.pending
                .extend_from_slice(&monotonic_nanos(at).to_le_bytes());
        }
        while !self.pending.is_empty() {
            match (&*self.socket).write(&self.pending) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    self.pending.drain(..n);
                }
            }
        }
    }
}

/// Whether the supervisor that shared `socket` said it killed its group ([`KILLED`]).
fn told_killed(socket: &std::os::unix::net::UnixStream) -> bool {
    use std::io::Read;
    let mut buf = [0u8; 16];
    matches!((&*socket).read(&mut buf), Ok(n) if buf[..n].contains(&KILLED))
}

/// `at` on `CLOCK_MONOTONIC`, which every process of the machine reads alike (and which
/// `std::time::Instant` reads on Linux), in nanoseconds.
fn monotonic_nanos(at: std::time::Instant) -> u64 {
    let now = std::time::Instant::now();
    let clock = monotonic_now();
    let at = if at >= now {
        clock + (at - now)
    } else {
        clock.saturating_sub(now - at)
    };
    u64::try_from(at.as_nanos()).unwrap_or(u64::MAX)
}

/// `CLOCK_MONOTONIC` now, the clock of [`monotonic_nanos`].
fn monotonic_now() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(Duration::from)
        .unwrap_or_default()
}

/// A started COMMAND's process group: its supervisor leads it, COMMAND and COMMAND's children
/// are in it. Dropped while it runs (`leader` returning from `main` with COMMANDs still
/// running, a panic unwinding, a task dropped), the whole group is SIGKILLed: killing the
/// supervisor alone, as the process handle's own kill on drop does, would leave COMMAND running
/// with nobody left to stop it, beside the next holder's.
#[derive(Debug)]
pub(crate) struct Group {
    child: Child,
    /// The group's number: the supervisor's pid, kept past its reaping, for what it leaves.
    pgid: Option<Pid>,
    watchdog: Option<Watchdog>,
    /// This process's end of the socket shared with the supervisor ([`Feed`]).
    feed: Option<Arc<std::os::unix::net::UnixStream>>,
}

/// How a started COMMAND ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// By itself (its own exit, or a signal `leader` did not send), with the exit code that
    /// reports it ([`exit_code`]; [`exit::FAILURE`] if it could not be waited for).
    Itself(u8),
    /// Killed by the watchdog or by the supervisor, past its term's deadline: the term is over
    /// (this process was stopped or stuck), which is no exit of COMMAND's own to report.
    PastDeadline,
}

impl Group {
    /// The supervisor's process id (its group's), until it has been reaped.
    pub(crate) fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Waits until COMMAND's supervisor has ended, and says how. This, not the process
    /// handle's own `wait`, is how a term learns that COMMAND ended: a kill by the watchdog
    /// shows in the status as a SIGKILL, which read as COMMAND's own end would make `leader`
    /// exit with 137 where it should go on as a follower.
    ///
    /// A group the supervisor killed, as it says on its socket, ends `PastDeadline` too.
    ///
    /// The supervisor ends only once nothing else runs in its group, unless it was killed (an
    /// operator's `kill -9`, the OOM killer): then COMMAND dies with it (its parent-death
    /// signal), but what COMMAND started would run on, beside the next leader's COMMAND. So
    /// whatever is left in the group is SIGKILLed, and waited for, before this returns.
    pub(crate) async fn wait(&mut self) -> Ended {
        use std::os::unix::process::ExitStatusExt;
        let status = self.child.wait().await;
        let by_supervisor = status
            .as_ref()
            .is_ok_and(|s| s.signal() == Some(Signal::SIGKILL as i32))
            && self.feed.as_deref().is_some_and(told_killed);
        if let Some(pgid) = self.pgid {
            kill_the_rest(pgid).await;
        }
        match &self.watchdog {
            Some(watchdog) if watchdog.killed() => Ended::PastDeadline,
            _ if by_supervisor => Ended::PastDeadline,
            _ => Ended::Itself(status.map_or(exit::FAILURE, exit_code)),
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // `id` is `None` once the supervisor has been reaped: its group is gone then, and the
        // number may be another process's.
        if let Some(id) = self.child.id() {
            let _ = killpg(Pid::from_raw(id.cast_signed()), Signal::SIGKILL);
        }
    }
}

/// The hidden subcommand that runs the supervisor.
pub(crate) const SUPERVISE: &str = "__supervise";

/// The supervisor: runs COMMAND as its child, in its own process group; mirrors how COMMAND ended
/// (exit code, or death by the same signal); on SIGHUP once its parent `leader` died kills the
/// whole group at once. The signals a service manager or an operator sends to every process
/// of a unit (SIGINT, SIGQUIT, SIGUSR1, ...) are caught and left. SIGTERM from `leader`
/// reaches COMMAND through the group; the supervisor then just waits for it.
///
/// It ends only once nothing else runs in its group: what COMMAND started and left running
/// when it exited (a process in the background, a program a wrapper script started without
/// `exec`) is stopped as COMMAND would have been, SIGTERM then SIGKILL after `grace`
/// ([`stop_the_rest`]), so that `leader` learns of COMMAND's end, and releases the lease, only
/// when none of its processes runs.
///
/// `feed` is the socket on which `leader`'s watchdog says when the group must be gone (eight
/// bytes at a time, [`monotonic_nanos`]), each renewal moving that instant on: should it pass,
/// `leader` is stopped (SIGSTOP, a debugger) or stuck, and the supervisor SIGKILLs the group,
/// itself included, having said so on the socket ([`KILLED`]) for `leader` to read. A feed
/// closed by `leader` leaves the last instant in force.
///
/// `parent` is the pid of the `leader` that started it. Until the SIGHUP handler is installed a
/// parent-death signal can be lost (ignored, when `leader` itself ignores SIGHUP and the
/// supervisor inherited that), so once it is installed the supervisor checks that its parent is
/// still `parent`, and exits with [`exit::ORPHANED`] without starting COMMAND if not: a COMMAND
/// started then would run with nobody left to stop it.
pub(crate) async fn supervise(
    parent: Option<Pid>,
    grace: Duration,
    feed: Option<OwnedFd>,
    command: &[String],
) -> u8 {
    use tokio::signal::unix::{SignalKind, signal};
    let (Some(parent), Some((program, args))) = (parent, command.split_first()) else {
        say(format_args!(
            "leader: usage: leader __supervise PID GRACE_MILLIS FEED_FD -- COMMAND..."
        ));
        return exit::USAGE;
    };
    // The feed is the supervisor's alone: COMMAND does not inherit it.
    let feed = feed
        .filter(|fd| {
            use nix::fcntl::{F_SETFD, FdFlag, fcntl};
            fcntl(fd, F_SETFD(FdFlag::FD_CLOEXEC)).is_ok()
        })
        .and_then(|fd| {
            let socket = std::os::unix::net::UnixStream::from(fd);
            socket.set_nonblocking(true).ok()?;
            tokio::net::UnixStream::from_std(socket).ok()
        });
    let mut reading = feed.is_some();
    let (Ok(mut hangup), Ok(mut terminate)) = (
        signal(SignalKind::hangup()),
        signal(SignalKind::terminate()),
    ) else {
        say(format_args!("leader: cannot handle signals"));
        return exit::FAILURE;
    };
    // Signals meant for COMMAND, or sent to every process of a unit (`systemctl kill -s USR1`,
    // `KillMode=control-group`), are not the supervisor's: their default action would end it,
    // and with it COMMAND (its parent-death signal), leaving what COMMAND started running
    // beside the next leader's COMMAND. Caught and left; COMMAND starts with the defaults.
    let _left: Vec<_> = [
        Signal::SIGINT,
        Signal::SIGQUIT,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGALRM,
        Signal::SIGIO,
        Signal::SIGVTALRM,
        Signal::SIGPROF,
        #[cfg(target_os = "linux")]
        Signal::SIGPWR,
    ]
    .into_iter()
    .filter_map(|left| signal(SignalKind::from_raw(left as i32)).ok())
    .collect();
    // From here on a SIGHUP is caught; a parent that died before is seen here.
    if nix::unistd::getppid() != parent {
        say(format_args!(
            "leader: the leader process {parent} that started this COMMAND's supervisor is gone; \
             COMMAND not started"
        ));
        return exit::ORPHANED;
    }
    // COMMAND dies with the supervisor, whatever kills it (SIGKILL included, which the
    // supervisor cannot pass on to the group).
    let mut command = Command::new(program);
    command.args(args);
    set_parent_death_signal(&mut command, Signal::SIGKILL);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            say(format_args!("leader: cannot start {program:?}: {err}"));
            return spawn_error_code(&err);
        }
    };
    // When `leader` asked the group to stop: the grace counts from then.
    let mut terminated = None;
    let mut deadline = Deadline::default();
    loop {
        let due = deadline.at;
        tokio::select! {
            // What the feed says first: a deadline already moved on is never acted on.
            biased;
            read = deadline.read(feed.as_ref().filter(|_| reading)) => {
                if !read {
                    // `leader` closed it: the last deadline stays.
                    reading = false;
                }
            }
            () = passes(due) => {
                // `leader` renews nothing and stops nothing: stopped, or stuck.
                if nix::unistd::getpgrp() == nix::unistd::getpid() {
                    say(format_args!(
                        "leader: the leader process {parent} neither renewed nor stopped COMMAND by its term's deadline (it is stopped or stuck): killing COMMAND's process group"
                    ));
                    // `leader`, resumed, reads the kill as its term's end.
                    if let Some(feed) = &feed {
                        let _ = feed.try_write(&[KILLED]);
                    }
                    let _ = killpg(nix::unistd::getpgrp(), Signal::SIGKILL);
                }
                deadline.at = None;
            }
            status = child.wait() => {
                stop_the_rest(grace, terminated).await;
                return match status {
                    Ok(status) => mirror(status),
                    Err(_) => exit::FAILURE,
                };
            }
            _ = hangup.recv() => {
                // `leader` is gone (its parent-death signal): nothing may keep running in this
                // group. A SIGHUP while it lives was sent to every process (systemd's
                // `SendSIGHUP=yes` after its SIGTERM): `leader` acts on its own copy.
                if nix::unistd::getppid() != parent {
                    let _ = killpg(nix::unistd::getpgrp(), Signal::SIGKILL);
                }
            }
            _ = terminate.recv() => {
                terminated.get_or_insert_with(std::time::Instant::now);
                pass_on_stop(child.id());
            }
        }
    }
}

/// The instant by which the supervisor's group must be gone, as `leader`'s watchdog last said.
#[derive(Debug, Default)]
struct Deadline {
    /// On `CLOCK_MONOTONIC`, in nanoseconds.
    at: Option<u64>,
    /// The bytes of an instant read in part.
    partial: Vec<u8>,
}

impl Deadline {
    /// Reads what the feed holds; false once it is closed (or there is none: then it never
    /// returns).
    async fn read(&mut self, feed: Option<&tokio::net::UnixStream>) -> bool {
        let Some(feed) = feed else {
            return std::future::pending().await;
        };
        let mut buf = [0u8; 512];
        // `readable` is cancel-safe, and `try_read` takes nothing unless it returns it.
        let n = loop {
            if feed.readable().await.is_err() {
                return false;
            }
            match feed.try_read(&mut buf) {
                Ok(0) => return false,
                Ok(n) => break n,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return false,
            }
        };
        self.partial.extend_from_slice(&buf[..n]);
        let whole = self.partial.len() / 8 * 8;
        if let Some(last) = self.partial[..whole].chunks_exact(8).next_back() {
            self.at = last.try_into().ok().map(u64::from_le_bytes);
        }
        self.partial.drain(..whole);
        true
    }
}

/// Returns once instant `at` ([`monotonic_nanos`]) has passed; never without one.
async fn passes(at: Option<u64>) {
    let Some(at) = at else {
        return std::future::pending().await;
    };
    tokio::time::sleep(Duration::from_nanos(at).saturating_sub(monotonic_now())).await;
}

/// What the supervisor does with the SIGTERM `leader` sent its group: it reaches COMMAND there,
/// but not a COMMAND that made a group of its own (GNU `timeout`, a shell with job control,
/// `sudo` with a terminal), which would otherwise hear of its term's end only as the SIGKILL
/// after the grace, and whose children that outlive it are beyond any signal then: such a
/// COMMAND (`pid`) gets the SIGTERM too. A SIGCONT follows both, as systemd sends, so that a
/// stopped process (SIGTSTP, or SIGTTOU writing to the terminal from a background group)
/// takes the SIGTERM now instead of waiting for the SIGKILL.
fn pass_on_stop(pid: Option<u32>) {
    let group = nix::unistd::getpgrp();
    if let Some(pid) = pid.map(|pid| Pid::from_raw(pid.cast_signed()))
        && !in_group(pid, group)
    {
        let _ = nix::sys::signal::kill(pid, Signal::SIGTERM);
        let _ = nix::sys::signal::kill(pid, Signal::SIGCONT);
    }
    if group == nix::unistd::getpid() {
        let _ = killpg(group, Signal::SIGCONT);
    }
}

/// Writes `message` as a line to standard error, if it can: a closed pipe there must not end the
/// supervisor (`eprintln!` panics on it) before it stopped what COMMAND left behind.
fn say(message: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{message}");
}

/// SIGKILLs what is left of `group` once its leader, the supervisor, has ended, and waits (a
/// second at most) until none of it runs. A group with no process left is no longer anyone's:
/// its number is not a process's until then, so the signal reaches only what was COMMAND's.
async fn kill_the_rest(group: Pid) {
    if killpg(group, Signal::SIGKILL).is_err() {
        return;
    }
    let since = std::time::Instant::now();
    while !others_in_group(group).is_empty() && since.elapsed() < Duration::from_secs(1) {
        tokio::time::sleep(GROUP_POLL).await;
    }
}

/// How often [`stop_the_rest`] looks again at what is left of the group.
const GROUP_POLL: Duration = Duration::from_millis(20);

/// Stops the other processes of the supervisor's group, once COMMAND has ended: SIGTERM to the
/// group (unless `leader` sent it already, at `terminated`), then SIGKILL to each process still
/// there `grace` after it; returns when none is left. The SIGKILL goes to each process rather
/// than to the group, which would end the supervisor too, before it could report COMMAND's end.
///
/// A process that left the group (`setsid`, a daemon) is beyond its reach, as it is beyond a
/// SIGTERM to the group. Does nothing in a process that does not lead its own group (the tests
/// that run the supervisor inside the test process).
async fn stop_the_rest(grace: Duration, terminated: Option<std::time::Instant>) {
    let group = nix::unistd::getpgrp();
    if group != nix::unistd::getpid() || others_in_group(group).is_empty() {
        return;
    }
    let since = terminated.unwrap_or_else(|| {
        // The supervisor catches SIGTERM: the signal stops the others only.
        let _ = killpg(group, Signal::SIGTERM);
        std::time::Instant::now()
    });
    let mut killed = false;
    loop {
        tokio::time::sleep(GROUP_POLL).await;
        let others = others_in_group(group);
        if others.is_empty() {
            return;
        }
        if killed || since.elapsed() >= grace {
            if !killed {
                say(format_args!(
                    "leader: {} process(es) COMMAND left in its group did not stop within {grace:?} after SIGTERM; sending SIGKILL",
                    others.len()
                ));
            }
            killed = true;
            for pid in others {
                let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
            }
        }
    }
}

/// The processes of `group` other than this one, as `/proc` shows them (none where there is no
/// `/proc`). A zombie, which has ended and waits for its parent to collect it, does not count.
fn others_in_group(group: Pid) -> Vec<Pid> {
    let me = nix::unistd::getpid();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .map(Pid::from_raw)
        .filter(|&pid| pid != me && in_group(pid, group))
        .collect()
}

/// Whether process `pid` runs, and in `group` (`/proc/PID/stat`: the state, then the group as
/// the third field after the command name).
fn in_group(pid: Pid, group: Pid) -> bool {
    let Some(fields) = stat_fields(pid) else {
        return false;
    };
    let mut fields = fields.split(' ');
    let running = fields
        .next()
        .is_some_and(|state| !matches!(state, "Z" | "X"));
    running && fields.nth(1).and_then(|g| g.parse().ok()) == Some(group.as_raw())
}

/// Ends the supervisor the way COMMAND ended: by the same signal, or with the same code.
fn mirror(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    if let Some(signal) = status.signal().and_then(|s| Signal::try_from(s).ok()) {
        die_by(signal);
    }
    exit_code(status)
}

#[allow(unsafe_code)]
fn die_by(signal: Signal) {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, sigaction};
    let default = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
    // SAFETY: restoring the default disposition installs no handler, so no handler can run with
    // broken assumptions; the process ends right after.
    let _ = unsafe { sigaction(signal, &default) };
    let _ = nix::sys::signal::raise(signal);
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn set_parent_death_signal(command: &mut Command, signal: Signal) {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the child between fork and exec, and only makes
    // async-signal-safe system calls (prctl, getppid); it allocates nothing and takes no lock.
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(signal).map_err(io::Error::from)?;
            // The parent may have died before prctl took effect: then nothing would kill us.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::other("the parent exited while starting COMMAND"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn set_parent_death_signal(_command: &mut Command, _signal: Signal) {}

/// Lets the child, and what it executes, keep the open file `fd` (clears close-on-exec in it).
#[allow(unsafe_code)]
fn inherit(command: &mut Command, fd: RawFd) {
    use nix::fcntl::{F_SETFD, FdFlag, fcntl};
    use std::os::fd::BorrowedFd;
    // SAFETY: the closure runs in the child between fork and exec and makes one
    // async-signal-safe system call (fcntl) on a descriptor the parent keeps open until the
    // spawn returns; it allocates nothing and takes no lock.
    unsafe {
        command.pre_exec(move || {
            let fd = BorrowedFd::borrow_raw(fd);
            fcntl(fd, F_SETFD(FdFlag::empty())).map_err(io::Error::from)?;
            Ok(())
        });
    }
}

/// The socket the supervisor inherited as descriptor `fd`, if it is open and a socket. Called
/// once, at the supervisor's start, before anything else of it opens a file.
#[allow(unsafe_code)]
pub(crate) fn inherited(fd: RawFd) -> Option<OwnedFd> {
    use nix::sys::stat::{SFlag, fstat};
    use std::os::fd::{BorrowedFd, FromRawFd};
    if fd < 3 {
        return None;
    }
    // SAFETY: only borrowed for a `fstat`, which fails harmlessly on a descriptor that is not
    // open.
    let stat = fstat(unsafe { BorrowedFd::borrow_raw(fd) }).ok()?;
    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFSOCK {
        return None;
    }
    // SAFETY: `fd` is open (fstat succeeded) and was inherited across exec: nothing else in
    // this process holds it, and it is taken once.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Cancelled by a second stop signal ([`cut_graces_short`]).
static HURRIED: std::sync::LazyLock<leader_core::CancellationToken> =
    std::sync::LazyLock::new(leader_core::CancellationToken::new);

/// Ends every COMMAND's grace now: those stopping are sent SIGKILL at once, and those stopped
/// later get no grace. What a second SIGTERM or Ctrl-C asks for: `leader` still releases only
/// once COMMAND is gone (S6).
pub(crate) fn cut_graces_short() {
    HURRIED.cancel();
}

/// Stops the child's whole process group: SIGTERM, then SIGKILL after `grace` (or at once once
/// [`cut_graces_short`]); returns once the child has been reaped.
pub(crate) async fn terminate(group: &mut Group, grace: Duration) -> io::Result<ExitStatus> {
    let (child, pgid) = (&mut group.child, group.pgid);
    let status = match child.try_wait() {
        Ok(Some(status)) => Ok(status),
        _ => stop(child, pgid, grace).await,
    };
    // What a supervisor that was killed left in its group (it otherwise ends only once the
    // group is empty) goes before the term's end is reported, also when a `wait` that reaped
    // the supervisor was dropped before it had seen to it.
    if let Some(pgid) = pgid {
        kill_the_rest(pgid).await;
    }
    status
}

/// SIGTERM to group `pgid`, then SIGKILL after `grace` (or at once, once hurried); returns
/// once its leader, `child`, has been reaped.
async fn stop(child: &mut Child, pgid: Option<Pid>, grace: Duration) -> io::Result<ExitStatus> {
    if let Some(pgid) = pgid {
        let _ = killpg(pgid, Signal::SIGTERM);
    }
    let within_grace = async {
        tokio::select! {
            status = child.wait() => Some(status),
            () = tokio::time::sleep(grace) => None,
            () = HURRIED.cancelled() => None,
        }
    };
    if let Some(status) = within_grace.await {
        return status;
    }
    if HURRIED.is_cancelled() {
        tracing::warn!("a second signal: sending COMMAND SIGKILL without the rest of its grace");
    } else {
        tracing::warn!(
            ?grace,
            "COMMAND did not stop after SIGTERM; sending SIGKILL"
        );
    }
    if let Some(pgid) = pgid {
        let _ = killpg(pgid, Signal::SIGKILL);
    }
    child.wait().await
}

/// The exit code that reports `status`: the child's own code, or 128 + the signal that killed it,
/// as shells do.
pub(crate) fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(exit::FAILURE),
        (None, Some(signal)) => u8::try_from(128 + signal).unwrap_or(exit::FAILURE),
        (None, None) => exit::FAILURE,
    }
}

/// The exit code for a COMMAND that could not be started: 127 when it was not found, 126 when
/// it could not be executed, as shells do.
pub(crate) fn spawn_error_code(err: &io::Error) -> u8 {
    match err.kind() {
        io::ErrorKind::NotFound => exit::NOT_FOUND,
        _ => exit::NOT_EXECUTABLE,
    }
}

#[cfg(test)]
mod tests;
