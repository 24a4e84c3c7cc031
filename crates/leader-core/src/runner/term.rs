//! A term: its work started, renewals until the renew deadline (S3), the requests its work
//! makes (a handover, a step-down, extensions), and the release at its end (S6).

use super::*;

impl Runner {
    /// One term of leadership, from acquisition to step-down; returns why it ended.
    pub(super) async fn lead(
        &mut self,
        acquired: Observed,
        started: Instant,
        shutdown: &CancellationToken,
    ) -> StepDownReason {
        let fencing_token = acquired.record.leader_transitions;
        let cancel = CancellationToken::new();
        // Should this future be dropped mid-term (an aborted task), the work must still stop.
        let _cancel_on_drop = cancel.clone().drop_guard();
        // S3: the term lasts until the start of the last successful renewal plus the deadline.
        let mut deadline = started + self.config.lease.renew_deadline;
        let shared_deadline = TermDeadline::new(deadline.into_std());
        let (leadership, mut requests, alive) = Leadership::new(
            self.config.name.clone(),
            self.identity().to_owned(),
            fencing_token,
            cancel.clone(),
            acquired.record.extensions.clone(),
            shared_deadline.clone(),
            self.config.lease.wall_clock.now(),
        );
        let extensions = leadership.extensions_handle();
        status::lock(&self.shared).renewed_at = Some(started);
        tracing::info!(fencing_token, "became leader");
        m::acquired(&self.config.name);
        m::set_leading(&self.config.name, true);
        self.spawn_event(LeaderEvent::BecameLeader { fencing_token });
        self.publish(LeaderState::Leading(leadership.uncounted()));
        let mut work = TermWork::start(
            &self.callbacks.started,
            &self.callbacks.beside,
            leadership,
            alive,
            self.config.work_exit,
            self.config.lease.retry_period,
        );

        // A handover this term was asked for (by its own work, or by a request in the record).
        let mut hand_to: Option<String> = None;
        // Extensions the term's work asked to write, with where to answer.
        let mut pending: Option<(
            ExtensionChanges,
            oneshot::Sender<Result<(), ExtensionError>>,
        )> = None;
        let reason = loop {
            let changes = self.changes.as_mut();
            tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                Some(request) = requests.recv() => match request {
                    TermRequest::HandOver(to) => {
                        hand_to = Some(to);
                        break StepDownReason::HandedOver;
                    }
                    TermRequest::StepDown => break StepDownReason::SteppedDown,
                    TermRequest::SetExtensions { changes, reply } => {
                        pending = Some((changes, reply));
                    }
                },
                end = work.ended() => match end {
                    WorkEnd::Returned => {
                        let lasted = started.elapsed();
                        if lasted < self.config.lease.retry_period {
                            // `run_while_leading(.., |_| async {})`: every term ends at once,
                            // the work runs again next term, and leadership flaps.
                            tracing::error!(
                                fencing_token,
                                ?lasted,
                                "leader work returned as soon as the term began: the term ends, \
                                 this candidate stands back and campaigns again, so leadership \
                                 flaps and the work runs once per term; work that runs until \
                                 the term ends awaits `leadership.lost()`, and a service whose \
                                 leader-only work is its requests calls `run` (no work) with \
                                 `LeaderOnlyLayer`"
                            );
                        } else {
                            tracing::warn!(fencing_token, "leader work returned: ending the term");
                        }
                        m::work_ended(&self.config.name, false);
                        break StepDownReason::WorkEnded;
                    }
                    WorkEnd::Panicked => {
                        m::work_ended(&self.config.name, true);
                        break StepDownReason::WorkPanicked;
                    }
                },
                () = sleep(self.config.lease.retry_period) => {}
                // A release or a handover request: renew now, which reads what changed.
                more = next_change(changes) => if !more {
                    self.changes = None;
                },
            }
            let attempt_started = Instant::now();
            let write = pending.take();
            let renewed = tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                renewed = self.renew(fencing_token, write.as_ref().map(|(c, _)| c)) => renewed,
            };
            let answer = |result: Result<(), ExtensionError>| {
                if let Some((_, reply)) = write {
                    let _ = reply.send(result);
                }
            };
            match renewed {
                // An answer after the deadline does not extend the term; the next select ends it.
                Ok(Renewal::Renewed) if Instant::now() < deadline => {
                    self.report_success();
                    deadline = attempt_started + self.config.lease.renew_deadline;
                    shared_deadline.set(deadline.into_std());
                    m::renewed(&self.config.name, attempt_started.elapsed());
                    status::lock(&self.shared).renewed_at = Some(attempt_started);
                    if let Some(observed) = &self.observed {
                        *extensions.lock().unwrap_or_else(|p| p.into_inner()) =
                            observed.record.extensions.clone();
                    }
                    answer(Ok(()));
                }
                Ok(Renewal::Renewed) => {
                    answer(Err(ExtensionError::Lost(LeadershipLost { fencing_token })))
                }
                Ok(Renewal::Lost) => {
                    answer(Err(ExtensionError::Lost(LeadershipLost { fencing_token })));
                    break StepDownReason::Lost;
                }
                Ok(Renewal::HandOver(to)) => {
                    answer(Err(ExtensionError::Lost(LeadershipLost { fencing_token })));
                    self.report_success();
                    hand_to = Some(to);
                    break StepDownReason::HandedOver;
                }
                Err(err) => {
                    let err = Arc::new(err);
                    answer(Err(ExtensionError::Lock(err.clone())));
                    self.report_error_shared("renew", err);
                }
            }
        };

        cancel.cancel();
        m::set_leading(&self.config.name, false);
        status::lock(&self.shared).renewed_at = None;
        tracing::info!(fencing_token, ?reason, "stopped leading");
        self.publish_following();
        let stopped = work.stop(self.config.lease.stop_grace).await;
        let mut released = false;
        let release = match reason {
            StepDownReason::Shutdown => self.config.lease.release_on_cancel,
            StepDownReason::RenewDeadlineExceeded | StepDownReason::Lost => false,
            _ => true,
        };
        if release {
            if stopped {
                if reason == StepDownReason::Shutdown {
                    let _ = timeout(self.config.lease.request_timeout, self.lock.withdraw()).await;
                }
                released = self.release(fencing_token, hand_to.as_deref()).await;
                if released && let Some(to) = &hand_to {
                    tracing::info!(fencing_token, to, "handed the lease over");
                    m::handed_over(&self.config.name);
                }
            } else {
                tracing::warn!(
                    fencing_token,
                    "leader work did not stop within the grace period; not releasing the lease, it will expire"
                );
            }
        }
        // What the release wrote (a free lease, or one handed to another), not this term.
        self.publish_following();
        self.spawn_event(LeaderEvent::StoppedLeading { fencing_token });
        if let Some(callback) = &self.callbacks.stopped {
            callback(StepDown {
                fencing_token,
                reason,
                released,
            });
        }
        reason
    }

    /// Renews the lease: one request from the cached record (client-go's fast path), and a read
    /// only when that loses the compare-and-swap, which is also how a handover request written
    /// by someone else is found.
    pub(super) async fn renew(
        &mut self,
        fencing_token: u64,
        changes: Option<&ExtensionChanges>,
    ) -> Result<Renewal, LockError> {
        if let Some(cached) = self
            .observed
            .clone()
            .filter(|o| self.is_ours(o, fencing_token) && o.record.handover_to().is_none())
        {
            let mut record = cached.record.clone();
            record.renew_time = record.renewal_time(self.config.lease.wall_clock.now());
            let written = match changes {
                // Extensions change the record: a write, which renews too.
                Some(changes) => {
                    changes.apply(&mut record.extensions);
                    self.request("update", self.lock.update(&cached.version, &record))
                        .await
                }
                None => {
                    self.request("renew", self.lock.renew(&cached.version, &record))
                        .await
                }
            };
            match written {
                Ok(stored) => {
                    self.observe(stored);
                    return Ok(Renewal::Renewed);
                }
                Err(err) if err.is_conflict() => {}
                Err(err) => return Err(err),
            }
        }
        m::slow_path(&self.config.name);
        let Some(current) = self.request("get", self.lock.get()).await? else {
            return Ok(Renewal::Lost);
        };
        self.observe(current.clone());
        if !self.is_ours(&current, fencing_token) {
            return Ok(Renewal::Lost);
        }
        if let Some(to) = current.record.handover_to()
            && to != self.identity()
        {
            return Ok(Renewal::HandOver(to.to_owned()));
        }
        let mut record = current.record.clone();
        record.renew_time = record.renewal_time(self.config.lease.wall_clock.now());
        if let Some(changes) = changes {
            changes.apply(&mut record.extensions);
        }
        let stored = if record.handover_to().is_some() || changes.is_some() {
            // A request naming this leader is fulfilled already: clear it.
            record.preferred_holder = None;
            self.request("update", self.lock.update(&current.version, &record))
                .await?
        } else {
            self.request("renew", self.lock.renew(&current.version, &record))
                .await?
        };
        self.observe(stored);
        Ok(Renewal::Renewed)
    }

    /// The record is this term's: our identity and our fencing token (a re-acquisition by a
    /// process with the same identity would have raised the token).
    pub(super) fn is_ours(&self, observed: &Observed, fencing_token: u64) -> bool {
        rules::is_term(&observed.record, self.identity(), fencing_token)
    }

    /// Clears the holder with a compare-and-swap, so a release never frees a lease that someone
    /// else holds (S6). A handover names `hand_to` as the next holder; otherwise a pending
    /// request in the record is kept.
    pub(super) async fn release(&mut self, fencing_token: u64, hand_to: Option<&str>) -> bool {
        let mut current = self.observed.clone();
        // Two tries: from the cached record, then, if that lost the compare-and-swap, from a
        // fresh read. The cache can be stale without anyone else having written: a renewal cut
        // short by the shutdown may still have reached the store.
        for attempt in 0..2 {
            let Some(ours) = current.filter(|o| self.is_ours(o, fencing_token)) else {
                return false;
            };
            let mut record = rules::released(&ours.record, self.config.lease.wall_clock.now());
            if let Some(to) = hand_to {
                record.preferred_holder = Some(to.to_owned());
            }
            match self
                .request("release", self.lock.update(&ours.version, &record))
                .await
            {
                Ok(stored) => {
                    tracing::info!(fencing_token, "released the lease");
                    self.observe(stored);
                    return true;
                }
                Err(err) if err.is_conflict() && attempt == 0 => {
                    current = match self.request("get", self.lock.get()).await {
                        Ok(fresh) => fresh,
                        Err(err) => {
                            self.report_error("release", err);
                            return false;
                        }
                    };
                    if let Some(fresh) = &current {
                        self.observe(fresh.clone());
                    }
                }
                Err(err) => {
                    self.report_error("release", err);
                    return false;
                }
            }
        }
        false
    }
}
