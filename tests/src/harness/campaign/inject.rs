//! Injecting a fault: into the server the replicas share, or into the replica that leads.

use std::time::Duration;

use leader_test_support::etcd_cluster::EtcdCluster;
use nix::sys::signal::{Signal, kill, killpg};
use tokio::time::sleep;

use super::{
    Fault, HarnessError, Run, between, command_group, crash_and_restart, poll, process_gone,
    process_stopped, reconnect_wait, resume_command_first, resume_supervisor, stop_inside_a_write,
};
use crate::harness::proxy::Mode;
use crate::{TermEvent as Event, now_ns, term_events as events};

impl Run<'_> {
    pub(super) async fn inject(&mut self, fault: Fault) -> Result<(), HarnessError> {
        let Some((slot, term)) = self.settled_leader(Duration::from_secs(30)).await? else {
            let log = events(&self.log);
            let recent: Vec<String> = log[log.len().saturating_sub(6)..]
                .iter()
                .map(|e| {
                    let what = if e.start { "start" } else { "stop" };
                    format!("{what} {} {}", e.identity, e.token)
                })
                .collect();
            self.violate(format!(
                "no leader before injecting {}; the log ends with {recent:?}",
                fault.name()
            ));
            return Ok(());
        };
        let mut bound = self.settings.recovery_bound(self.backend, fault);
        let Some(leader_pid) = self.replicas[slot].pid() else {
            self.violations
                .push(format!("{} exited by itself", term.identity));
            return Ok(());
        };
        if fault.of_a_member() {
            self.member_fault(fault, &term).await;
            return Ok(());
        }
        let group = command_group(leader_pid.as_raw().cast_unsigned());
        let mut from = now_ns();
        let since = from;
        match fault {
            Fault::Kill => {
                let _ = kill(leader_pid, Signal::SIGKILL);
                let _ = self.replicas[slot].child.wait().await;
                let gone = poll(Duration::from_secs(5), Duration::from_millis(1), || {
                    term.pid.is_none_or(process_gone).then_some(())
                });
                if gone.await.is_none() {
                    self.violate(format!(
                        "{}'s COMMAND outlived its SIGKILLed leader by 5 s",
                        term.identity
                    ));
                }
                self.killed
                    .insert((term.identity.clone(), term.token), now_ns());
            }
            Fault::Freeze | Fault::FreezeInOperation => {
                if fault == Fault::FreezeInOperation {
                    stop_inside_a_write(leader_pid).await?;
                }
                if let Some(group) = group {
                    let _ = killpg(group, Signal::SIGSTOP);
                }
                let _ = kill(leader_pid, Signal::SIGSTOP);
                let stopped = poll(Duration::from_secs(5), Duration::from_millis(1), || {
                    (process_stopped(leader_pid.as_raw()) && term.pid.is_none_or(process_stopped))
                        .then_some(())
                });
                if stopped.await.is_none() {
                    self.violations
                        .push(format!("{} could not be frozen", term.identity));
                }
                self.frozen
                    .insert((term.identity.clone(), term.token), now_ns());
            }
            Fault::Cut => self.proxies[slot].set(Mode::Cut),
            Fault::Latency => self.proxies[slot].set(Mode::Delay(self.settings.renew * 2)),
            Fault::Restart => {
                let restarted = crash_and_restart(&mut self.server, self.settings.lease).await?;
                from = restarted.back;
                bound += reconnect_wait(self.backend, restarted.away);
            }
            Fault::ServerFreeze => {
                if let Some(server) = &self.server {
                    server.freeze();
                    sleep(self.settings.lease).await;
                    from = now_ns();
                    server.thaw();
                }
            }
            Fault::Outage => from = self.outage().await,
            Fault::MemberKill | Fault::MemberFreeze | Fault::MemberCut => {}
        }
        let recovery = self.next_start(since, from, bound * 3).await;
        match recovery {
            None => self.violate(format!(
                "{}: no new leader within {:?}",
                fault.name(),
                bound * 3
            )),
            Some(d) if d > bound => self.violate(format!(
                "{}: the next leader took {d:?}, over the bound {bound:?}",
                fault.name()
            )),
            Some(_) => {}
        }
        self.recoveries.push((fault, recovery));

        // Undo the fault.
        sleep(Duration::from_millis(300)).await; // the new leader writes meanwhile
        match fault {
            Fault::Kill => self.spawn(slot)?,
            Fault::Freeze | Fault::FreezeInOperation => {
                if let Some(group) = group {
                    resume_command_first(group);
                }
                sleep(Duration::from_millis(200)).await;
                let resumed = now_ns();
                if let Some(group) = group {
                    resume_supervisor(group);
                }
                let _ = kill(leader_pid, Signal::SIGCONT);
                // Its stop line, or its COMMAND seen gone (SIGKILLed after the grace).
                let key = (term.identity.clone(), term.token);
                let stopped = poll(Duration::from_secs(5), Duration::from_millis(2), || {
                    events(&self.log)
                        .into_iter()
                        .find(|e| !e.start && e.identity == term.identity && e.token == term.token)
                        .map(|stop| stop.at)
                        .or_else(|| self.gone().get(&key).copied())
                });
                match stopped.await {
                    Some(at) => self.resumed_stops.push(between(resumed, at)),
                    None => self.violate(format!(
                        "{} was resumed and its COMMAND still ran 5 s later",
                        term.identity
                    )),
                }
            }
            Fault::Cut | Fault::Latency => self.proxies[slot].set(Mode::Open),
            Fault::Restart
            | Fault::ServerFreeze
            | Fault::Outage
            | Fault::MemberKill
            | Fault::MemberFreeze
            | Fault::MemberCut => {}
        }
        Ok(())
    }

    /// A fault of one member of the cluster, while `term` leads: every other fault into the
    /// raft leader, the others into the members in turn. The fault lasts a renew deadline and a
    /// second; the term must still run a lease after the member is back, with no other term
    /// started. Recorded as a recovery of zero when it kept leading, `None` when it lost its
    /// term.
    pub(super) async fn member_fault(&mut self, fault: Fault, term: &Event) {
        let Some(cluster) = self.cluster.clone() else {
            self.violate(format!("{}: no cluster", fault.name()));
            return;
        };
        self.member_faults += 1;
        let turn = self.member_faults;
        let member = tokio::task::spawn_blocking({
            let cluster = cluster.clone();
            move || {
                let cluster = cluster.lock().unwrap_or_else(|p| p.into_inner());
                if turn.is_multiple_of(2) {
                    cluster.wait_for_a_leader(Duration::from_secs(10))
                } else {
                    (turn / 2) % cluster.len()
                }
            }
        })
        .await
        .expect("cluster task");
        let on_cluster = |f: Box<dyn FnOnce(&mut EtcdCluster) + Send>| {
            let cluster = cluster.clone();
            tokio::task::spawn_blocking(move || {
                f(&mut cluster.lock().unwrap_or_else(|p| p.into_inner()));
            })
        };
        let since = now_ns();
        let lasts = self.settings.renew + Duration::from_secs(1);
        match fault {
            Fault::MemberKill => {
                let _ = on_cluster(Box::new(move |c| c.kill(member))).await;
                sleep(lasts).await;
                let _ = on_cluster(Box::new(move |c| c.restart(member))).await;
            }
            Fault::MemberFreeze => {
                let _ = on_cluster(Box::new(move |c| c.freeze(member))).await;
                sleep(lasts).await;
                let _ = on_cluster(Box::new(move |c| c.thaw(member))).await;
            }
            _ => {
                self.member_proxies[member].set(Mode::Cut);
                sleep(lasts).await;
                self.member_proxies[member].set(Mode::Open);
            }
        }
        // A member that is back can still cost a term (it catches up, its clients reconnect).
        sleep(self.settings.lease).await;
        let kept = self
            .current()
            .is_some_and(|now| now.identity == term.identity && now.token == term.token)
            && !events(&self.log).iter().any(|e| e.start && e.at > since);
        if kept {
            self.recoveries.push((fault, Some(Duration::ZERO)));
        } else {
            self.recoveries.push((fault, None));
            let which = if turn.is_multiple_of(2) {
                ", the raft leader"
            } else {
                ""
            };
            self.violate(format!(
                "{} (member {member}{which}): {} lost its term {}",
                fault.name(),
                term.identity,
                term.token
            ));
        }
        let _ = on_cluster(Box::new(|c| {
            c.wait_for_a_leader(Duration::from_secs(10));
        }))
        .await;
    }
}
