//! What operators do beside the faults: rolling restarts and resizes of the running set.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::Command;
use tokio::time::sleep;

use super::{RESIZES, Run, ShardsReport};
use crate::harness::campaign::HarnessError;
use crate::harness::proxy::Proxy;

impl Run<'_> {
    /// What operators do beside the faults, after fault `turn`.
    pub(super) async fn operate(
        &mut self,
        turn: usize,
        report: &mut ShardsReport,
    ) -> Result<(), HarnessError> {
        if turn % 7 == 1 {
            self.rolling_restart(report).await?;
        }
        if turn % 10 == 1 {
            self.resize(report).await;
        }
        Ok(())
    }

    /// Each replica in turn: SIGTERM, and started again under the same identity a few rounds
    /// later, within the lease (static membership: its shards wait for it). One that does not
    /// exit within three leases is killed, and started under a new identity.
    pub(super) async fn rolling_restart(
        &mut self,
        report: &mut ShardsReport,
    ) -> Result<(), HarnessError> {
        for slot in 0..self.replicas.len() {
            let identity = self.replicas[slot].0.clone();
            let open = self.open_terms(&identity);
            if let Some(pid) = self.replicas[slot].1.id() {
                let _ = kill(Pid::from_raw(pid.cast_signed()), Signal::SIGTERM);
            }
            let exit = tokio::time::timeout(self.settings.lease * 3, self.replicas[slot].1.wait());
            if exit.await.is_err() {
                report.stuck_on_sigterm += 1;
                let _ = self.replicas[slot].1.start_kill();
                let _ = self.replicas[slot].1.wait().await;
                self.killed_now(open);
                self.spawn(slot)?;
            } else {
                sleep(self.settings.retry * 2).await;
                self.spawn_as(slot, identity)?;
            }
            // Before the next, this one takes its shards back, as a rollout waits for a
            // replica to be ready.
            sleep(self.settings.retry * 4).await;
        }
        report.rolling_restarts += 1;
        Ok(())
    }

    /// `leader shards resize` to the next count, through replica 0's way to the server.
    pub(super) async fn resize(&mut self, report: &mut ShardsReport) {
        let to = RESIZES[report.resizes % RESIZES.len()];
        let port = self.proxies.first().map_or(0, Proxy::port);
        let (url, env) = match self.backend.replica_lock(self.dir, port, &self.settings) {
            Ok(both) => both,
            Err(err) => {
                report.resize_failures.push(err.to_string());
                return;
            }
        };
        let out = Command::new(&self.programs.leader)
            .args(["shards", "resize", "--lock", &url, "--name", &self.name])
            .arg(to.to_string())
            .envs(env)
            .output()
            .await;
        match out {
            Ok(out) if out.status.success() => {
                self.count = to;
                report.resizes += 1;
            }
            Ok(out) => report.resize_failures.push(format!(
                "to {to}: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(err) => report.resize_failures.push(format!("to {to}: {err}")),
        }
    }
}
