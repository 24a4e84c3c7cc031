//! A server process of a test's own cluster, which the test kills, freezes and starts again:
//! what each member of [`EtcdCluster`](crate::etcd_cluster::EtcdCluster) and
//! [`ZooKeeperEnsemble`](crate::zookeeper_ensemble::ZooKeeperEnsemble) keeps.

use std::process::Child;

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
