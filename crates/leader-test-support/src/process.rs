//! A server process of a test's own cluster, which the test kills, freezes and starts again:
//! what each member of [`EtcdCluster`](crate::etcd_cluster::EtcdCluster) and
//! [`ZooKeeperEnsemble`](crate::zookeeper_ensemble::ZooKeeperEnsemble) keeps, with its data
//! directory; and how such a cluster is asked, and waited for, on loopback.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A member's process, or none while it is killed. Killed when dropped.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    child: Option<Child>,
}

impl Slot {
    /// Keeps `child`, started for the member.
    pub(crate) fn set(&mut self, child: Child) {
        self.kill();
        self.child = Some(child);
    }

    /// Starts `command` for the member (what `what` names, for the panic), its standard
    /// output discarded and its standard error to `log`, and keeps the process.
    ///
    /// # Panics
    /// The process could not be started.
    pub(crate) fn start(&mut self, command: &mut Command, log: Stdio, what: &str) {
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|err| panic!("start {what}: {err}"));
        self.set(child);
    }

    /// Whether a process runs in it (frozen or not).
    pub(crate) fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// How the process ended, if it has (reaped then); `None` while it runs or when none was
    /// started.
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    /// Kills the process (SIGKILL, resumed first if frozen) and reaps it.
    pub(crate) fn kill(&mut self) {
        self.thaw();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn signal(&self, signal: Signal) {
        if let Some(child) = &self.child {
            let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
            let _ = kill(pid, signal);
        }
    }

    /// Freezes the process (SIGSTOP): its connections stay open and silent.
    pub(crate) fn freeze(&self) {
        self.signal(Signal::SIGSTOP);
    }

    /// Resumes a frozen process (SIGCONT).
    pub(crate) fn thaw(&self) {
        self.signal(Signal::SIGCONT);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A member's data directory, which outlives its restarts and is removed when dropped. A
/// member keeps it in a field after its [`Slot`], so that its process is killed first.
#[derive(Debug)]
pub(crate) struct DataDir(pub(crate) PathBuf);

impl std::ops::Deref for DataDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Sends `request` to loopback `port` and returns the whole answer, or `None` when nothing
/// answered within a second.
pub(crate) fn exchange(port: u16, request: &[u8]) -> Option<String> {
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream =
        std::net::TcpStream::connect_timeout(&address, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream.write_all(request).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

/// Asks `ready` every `every` until it gives a value, and returns that.
///
/// # Panics
/// It gave none within `within`: the panic says `failed` (what did not happen) and `within`.
pub(crate) fn wait_until<T>(
    within: Duration,
    every: Duration,
    failed: &str,
    mut ready: impl FnMut() -> Option<T>,
) -> T {
    let since = Instant::now();
    loop {
        if let Some(value) = ready() {
            return value;
        }
        assert!(since.elapsed() < within, "{failed} within {within:?}");
        std::thread::sleep(every);
    }
}
