//! A term: its work started, renewals until the renew deadline (S3), the requests its work
//! makes (a handover, a step-down, extensions), and the release at its end (S6). The records a
//! term reads and writes are noted in the campaign it was won by, which goes on from them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::campaign::Campaign;
use super::context::Context;
use crate::error::LockError;
use crate::leadership::{
    ExtensionChanges, ExtensionError, LeaderState, Leadership, LeadershipLost, StepDown,
    StepDownReason, TermDeadline, TermRequest,
};
use crate::lock::LeaderEvent;
use crate::metrics as m;
use crate::record::Observed;
use crate::rules;
use crate::status;
use crate::work::{TermWork, WorkEnd};

/// Failed campaign attempts in a row while a term runs: none, as a term starts only after an
/// attempt succeeded and leaves the campaign's back-off alone.
const NO_FAILED_ATTEMPTS: u32 = 0;

/// One term of leadership, from acquisition to step-down.
pub(super) struct Term {
    /// This term's fencing token (S5).
    fencing_token: u64,
    /// When the acquiring request started: the first renewal the renew deadline counts from (S3).
    started: Instant,
    /// The renew deadline as the term's work reads it ([`Leadership::deadline`]).
    shared_deadline: TermDeadline,
    /// What the term's work asks of it.
    requests: mpsc::Receiver<TermRequest>,
    /// The record's extensions as the term's work reads them.
    extensions: Arc<Mutex<BTreeMap<String, String>>>,
    /// The term's running work.
    work: TermWork,
    /// Cancelled when the term ends: the work's [`Leadership`] is lost.
    cancel: CancellationToken,
    /// Should the term be dropped mid-way (an aborted task), the work must still stop. Kept
    /// after `work`, which is dropped first and leaves its callbacks to this cancellation.
    _cancel_on_drop: DropGuard,
}

/// What a leader's renewal found.
enum Renewal {
    /// The lease is renewed.
    Renewed,
    /// Someone else holds the lease now.
    Lost,
    /// The record asks for a handover to this candidate.
    HandOver(String),
}

impl Term {
    /// Starts the term of `acquired`, whose acquiring request started at `started`: publishes
    /// the leadership and starts the work.
    pub(super) fn begin(context: &Context, acquired: Observed, started: Instant) -> Self {
        let fencing_token = acquired.record.leader_transitions;
        let cancel = CancellationToken::new();
        let cancel_on_drop = cancel.clone().drop_guard();
        // S3: the term lasts until the start of the last successful renewal plus the deadline.
        let shared_deadline =
            TermDeadline::new((started + context.config.lease.renew_deadline).into_std());
        let (leadership, requests, alive) = Leadership::new(
            context.config.name.clone(),
            context.identity().to_owned(),
            fencing_token,
            cancel.clone(),
            acquired.record.extensions.clone(),
            shared_deadline.clone(),
            context.config.lease.wall_clock.now(),
        );
        let extensions = leadership.extensions_handle();
        status::lock(&context.shared).renewed_at = Some(started);
        tracing::info!(fencing_token, "became leader");
        m::acquired(&context.config.name);
        m::set_leading(&context.config.name, true);
        context.spawn_event(LeaderEvent::BecameLeader { fencing_token });
        context.publish(LeaderState::Leading(leadership.uncounted()));
        let work = TermWork::start(
            &context.callbacks.started,
            &context.callbacks.beside,
            leadership,
            alive,
            context.config.work_exit,
            context.config.lease.retry_period,
        );
        Self {
            fencing_token,
            started,
            shared_deadline,
            requests,
            extensions,
            work,
            cancel,
            _cancel_on_drop: cancel_on_drop,
        }
    }

    /// Leads until the term ends, then steps down; returns why it ended. The records it reads
    /// and writes are noted in `campaign`.
    pub(super) async fn lead(
        mut self,
        context: &mut Context,
        campaign: &mut Campaign,
        shutdown: &CancellationToken,
    ) -> StepDownReason {
        let (reason, hand_to) = self.hold(context, campaign, shutdown).await;
        self.step_down(context, campaign, reason, hand_to).await
    }

    /// Renews the lease and answers the work's requests until the term ends: returns why, and
    /// the candidate to hand the lease over to, if it was asked for (by its own work, or by a
    /// request in the record).
    async fn hold(
        &mut self,
        context: &mut Context,
        campaign: &mut Campaign,
        shutdown: &CancellationToken,
    ) -> (StepDownReason, Option<String>) {
        let fencing_token = self.fencing_token;
        let mut deadline = self.started + context.config.lease.renew_deadline;
        let mut hand_to: Option<String> = None;
        // Extensions the term's work asked to write, with where to answer.
        let mut pending: Option<(
            ExtensionChanges,
            oneshot::Sender<Result<(), ExtensionError>>,
        )> = None;
        let reason = loop {
            tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                Some(request) = self.requests.recv() => match request {
                    TermRequest::HandOver(to) => {
                        hand_to = Some(to);
                        break StepDownReason::HandedOver;
                    }
                    TermRequest::StepDown => break StepDownReason::SteppedDown,
                    TermRequest::SetExtensions { changes, reply } => {
                        pending = Some((changes, reply));
                    }
                },
                end = self.work.ended() => match end {
                    WorkEnd::Returned => {
                        let lasted = self.started.elapsed();
                        if lasted < context.config.lease.retry_period {
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
                        m::work_ended(&context.config.name, false);
                        break StepDownReason::WorkEnded;
                    }
                    WorkEnd::Panicked => {
                        m::work_ended(&context.config.name, true);
                        break StepDownReason::WorkPanicked;
                    }
                },
                () = sleep(context.config.lease.retry_period) => {}
                // A release or a handover request: renew now, which reads what changed.
                _ = campaign.changed() => {}
            }
            let attempt_started = Instant::now();
            let write = pending.take();
            let renewed = tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                renewed = self.renew(context, campaign, write.as_ref().map(|(c, _)| c)) => renewed,
            };
            let answer = |result: Result<(), ExtensionError>| {
                if let Some((_, reply)) = write {
                    let _ = reply.send(result);
                }
            };
            match renewed {
                // An answer after the deadline does not extend the term; the next select ends it.
                Ok(Renewal::Renewed) if Instant::now() < deadline => {
                    context.report_success();
                    deadline = attempt_started + context.config.lease.renew_deadline;
                    self.shared_deadline.set(deadline.into_std());
                    m::renewed(&context.config.name, attempt_started.elapsed());
                    status::lock(&context.shared).renewed_at = Some(attempt_started);
                    if let Some(observed) = campaign.observed() {
                        *self.extensions.lock().unwrap_or_else(|p| p.into_inner()) =
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
                    context.report_success();
                    hand_to = Some(to);
                    break StepDownReason::HandedOver;
                }
                Err(err) => {
                    let err = Arc::new(err);
                    answer(Err(ExtensionError::Lock(err.clone())));
                    context.report_error("renew", err, NO_FAILED_ATTEMPTS);
                }
            }
        };
        (reason, hand_to)
    }

    /// Ends the term for `reason`: cancels the leadership, stops the work and, unless the lease
    /// may be someone else's by now, releases it, handed over to `hand_to` if named (S6).
    /// Returns `reason`.
    async fn step_down(
        self,
        context: &mut Context,
        campaign: &mut Campaign,
        reason: StepDownReason,
        hand_to: Option<String>,
    ) -> StepDownReason {
        let fencing_token = self.fencing_token;
        self.cancel.cancel();
        m::set_leading(&context.config.name, false);
        status::lock(&context.shared).renewed_at = None;
        tracing::info!(fencing_token, ?reason, "stopped leading");
        context.publish_following(campaign.observed());
        let stopped = self.work.stop(context.config.lease.stop_grace).await;
        let mut released = false;
        let may_release = match reason {
            StepDownReason::Shutdown => context.config.lease.release_on_cancel,
            StepDownReason::RenewDeadlineExceeded | StepDownReason::Lost => false,
            _ => true,
        };
        if may_release {
            if stopped {
                if reason == StepDownReason::Shutdown {
                    let _ = timeout(
                        context.config.lease.request_timeout,
                        context.lock.withdraw(),
                    )
                    .await;
                }
                released = release(context, campaign, fencing_token, hand_to.as_deref()).await;
                if released && let Some(to) = &hand_to {
                    tracing::info!(fencing_token, to, "handed the lease over");
                    m::handed_over(&context.config.name);
                }
            } else {
                tracing::warn!(
                    fencing_token,
                    "leader work did not stop within the grace period; not releasing the lease, it will expire"
                );
            }
        }
        // What the release wrote (a free lease, or one handed to another), not this term.
        context.publish_following(campaign.observed());
        context.spawn_event(LeaderEvent::StoppedLeading { fencing_token });
        if let Some(callback) = &context.callbacks.stopped {
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
    async fn renew(
        &self,
        context: &Context,
        campaign: &mut Campaign,
        changes: Option<&ExtensionChanges>,
    ) -> Result<Renewal, LockError> {
        let fencing_token = self.fencing_token;
        let me = context.identity();
        if let Some(cached) = campaign
            .observed()
            .filter(|o| is_ours(o, me, fencing_token) && o.record.handover_to().is_none())
            .cloned()
        {
            let mut record = rules::renewal(&cached.record, &context.config.lease);
            let written = match changes {
                // Extensions change the record: a write, which renews too.
                Some(changes) => {
                    changes.apply(&mut record.extensions);
                    context
                        .request("update", context.lock.update(&cached.version, &record))
                        .await
                }
                None => {
                    context
                        .request("renew", context.lock.renew(&cached.version, &record))
                        .await
                }
            };
            match written {
                Ok(stored) => {
                    campaign.observe(context, stored);
                    return Ok(Renewal::Renewed);
                }
                Err(err) if err.is_conflict() => {}
                Err(err) => return Err(err),
            }
        }
        m::slow_path(&context.config.name);
        let Some(current) = context.request("get", context.lock.get()).await? else {
            return Ok(Renewal::Lost);
        };
        campaign.observe(context, current.clone());
        if !is_ours(&current, me, fencing_token) {
            return Ok(Renewal::Lost);
        }
        if let Some(to) = current.record.handover_to()
            && to != me
        {
            return Ok(Renewal::HandOver(to.to_owned()));
        }
        let mut record = rules::renewal(&current.record, &context.config.lease);
        if let Some(changes) = changes {
            changes.apply(&mut record.extensions);
        }
        let stored = if record.handover_to().is_some() || changes.is_some() {
            // A request naming this leader is fulfilled already: clear it.
            record.preferred_holder = None;
            context
                .request("update", context.lock.update(&current.version, &record))
                .await?
        } else {
            context
                .request("renew", context.lock.renew(&current.version, &record))
                .await?
        };
        campaign.observe(context, stored);
        Ok(Renewal::Renewed)
    }
}

/// The record is the term `fencing_token` of identity `me`: a re-acquisition by a process with
/// the same identity would have raised the token.
fn is_ours(observed: &Observed, me: &str, fencing_token: u64) -> bool {
    rules::is_term(&observed.record, me, fencing_token)
}

/// Clears the holder of term `fencing_token` with a compare-and-swap, so a release never frees
/// a lease that someone else holds (S6), and from a fresh read when the record cached is stale
/// ([`rules::release_term`]). A handover names `hand_to` as the next holder; otherwise a
/// pending request in the record is kept. True when released.
async fn release(
    context: &mut Context,
    campaign: &mut Campaign,
    fencing_token: u64,
    hand_to: Option<&str>,
) -> bool {
    let ended = {
        let context = &*context;
        rules::release_term(
            campaign.observed().cloned(),
            (context.identity(), fencing_token),
            context.config.lease.request_timeout,
            |held| {
                let mut record = rules::released(held, context.config.lease.wall_clock.now());
                if let Some(to) = hand_to {
                    record.preferred_holder = Some(to.to_owned());
                }
                record
            },
            |version, record| async move {
                context
                    .request("release", context.lock.update(&version, &record))
                    .await
            },
            || context.request("get", context.lock.get()),
        )
        .await
    };
    for seen in ended.read.into_iter().chain(ended.stored) {
        campaign.observe(context, seen);
    }
    if let Some(err) = ended.error {
        context.report_error("release", err, NO_FAILED_ATTEMPTS);
    }
    if ended.released {
        tracing::info!(fencing_token, "released the lease");
    }
    ended.released
}
