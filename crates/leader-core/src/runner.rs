//! The loop that drives a [`LeaderElector`]: client-go's acquire/renew loop, kept to the safety
//! rules S1-S10.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

use crate::elector::LeaderElector;
use crate::error::LockError;
use crate::health::HealthState;
use crate::leadership::{LeaderState, Leadership, StepDown, StepDownReason};
use crate::lock::{Acquisition, ChangeStream, LeaderEvent};
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed};
use crate::retry::{Backoff, FailureLog, LogLine};

/// The loop's state: the elector it runs and what it has observed.
pub(crate) struct Runner {
    elector: LeaderElector,
    /// The last record seen, read or written.
    observed: Option<Observed>,
    /// When `observed`'s version was first seen, on this process's monotonic clock (S1, S2).
    observed_at: Instant,
    /// When the holder's lease runs out by the store's clock, as its last `Held` answer said
    /// (on this process's clock, counted from when that answer arrived). Only a wake-up time:
    /// the store itself decides a store-clock acquisition.
    store_expiry: Option<Instant>,
    /// Whether a wait was already cut short for `observed`'s expiry: an early wake-up is used
    /// once per version, so a lease that has run out never makes attempts follow each other.
    woke_for_expiry: bool,
    /// The pending handover request last seen (the candidate it names), and until when other
    /// candidates stand back: one lease duration (the record's, when the request was first seen)
    /// from then, on this process's clock.
    handover_seen: Option<(String, Instant)>,
    reported_leader: Option<String>,
    /// In a mutex only to keep the runner `Sync`; it is reached through `&mut` and never locked.
    changes: Option<Mutex<ChangeStream>>,
    watch_supported: bool,
    try_acquire_supported: bool,
    /// Waits between a candidate's attempts (S9).
    backoff: Backoff,
    /// Waits between attempts to subscribe to changes, apart from the lock's own requests: a
    /// backend whose notifications fail must not slow down the election itself.
    watch_backoff: Backoff,
    watch_retry_at: Option<Instant>,
    /// Whether a change notification already cut short a back-off since the last success.
    change_shortened_backoff: bool,
    failures: FailureLog,
    watch_failures: FailureLog,
}

enum Attempt {
    Acquired(Observed),
    /// Handed over by a release, on a lease the store confirmed alive at that instant.
    Handed(Observed, Instant),
    NotAcquired,
}

/// What a leader's renewal found.
enum Renewal {
    Renewed,
    /// Someone else holds the lease now.
    Lost,
    /// The record asks for a handover to this candidate.
    HandOver(String),
}

impl Runner {
    pub(crate) fn new(elector: LeaderElector) -> Self {
        let config = &elector.config;
        let backoff = Backoff::new(config.retry_period, config.jitter, config.lease_duration);
        Self {
            observed: None,
            observed_at: Instant::now(),
            store_expiry: None,
            woke_for_expiry: false,
            handover_seen: None,
            reported_leader: None,
            changes: None,
            watch_supported: true,
            try_acquire_supported: true,
            watch_backoff: backoff.clone(),
            backoff,
            watch_retry_at: None,
            change_shortened_backoff: false,
            failures: FailureLog::default(),
            watch_failures: FailureLog::default(),
            elector,
        }
    }

    pub(crate) async fn run(mut self, shutdown: CancellationToken) {
        m::set_leading(&self.elector.config.name, false);
        while let Some((acquired, started)) = self.acquire(&shutdown).await {
            self.lead(acquired, started, &shutdown).await;
            if shutdown.is_cancelled() {
                break;
            }
        }
        let _ = timeout(
            self.elector.config.request_timeout,
            self.elector.lock.close(),
        )
        .await;
        self.publish(LeaderState::Stopped);
        tracing::debug!("elector stopped");
    }

    fn identity(&self) -> &str {
        self.elector.lock.identity()
    }

    fn publish(&self, state: LeaderState) {
        self.elector.state.send_if_modified(|current| {
            if current.same_as(&state) {
                false
            } else {
                *current = state;
                true
            }
        });
    }

    /// Runs one lock request with the request timeout (S4).
    async fn request<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let after = self.elector.config.request_timeout;
        timeout(after, fut)
            .await
            .unwrap_or(Err(LockError::Timeout { operation, after }))
    }

    /// Reports a failed lock request: counted in metrics every time, logged as [`FailureLog`]
    /// says (S9). A lost compare-and-swap is contention, not a failure: the store answered.
    fn report_error(&mut self, operation: &'static str, err: &LockError) {
        m::error(&self.elector.config.name, operation, err.kind());
        if err.is_conflict() {
            tracing::debug!(operation, "lost a compare-and-swap");
            self.report_success();
            return;
        }
        let line = self.failures.failed(operation, err);
        log_failure(line, operation, err, self.backoff.failures());
    }

    /// Notes that the store answered: the end of an outage, if there was one.
    fn report_success(&mut self) {
        log_recovery(self.failures.succeeded(), "lock");
    }

    /// Takes note of a record read or written. The follower's clock for the holder's lease
    /// starts when a version is first seen, after the request returned (S2).
    fn observe(&mut self, observed: Observed) {
        let is_new = self
            .observed
            .as_ref()
            .is_none_or(|previous| previous.version != observed.version);
        if is_new {
            self.observed_at = Instant::now();
            self.woke_for_expiry = false;
        }
        match observed.record.handover_to() {
            Some(to)
                if self
                    .handover_seen
                    .as_ref()
                    .is_some_and(|(seen, _)| seen == to) => {}
            Some(to) => {
                tracing::info!(to, "handover requested");
                let until = Instant::now() + observed.record.lease_duration;
                self.handover_seen = Some((to.to_owned(), until));
            }
            None => self.handover_seen = None,
        }
        let holder = &observed.record.holder_identity;
        if !holder.is_empty() && self.reported_leader.as_deref() != Some(holder.as_str()) {
            tracing::info!(leader = %holder, "new leader observed");
            self.reported_leader = Some(holder.clone());
            if let Some(callback) = &self.elector.callbacks.new_leader {
                callback(holder);
            }
        }
        self.observed = Some(observed);
    }

    fn publish_following(&self) {
        let leader = self
            .observed
            .as_ref()
            .map(|o| &o.record)
            .filter(|r| !r.is_free())
            .map(|r| r.holder_identity.clone());
        self.publish(LeaderState::Following { leader });
    }

    fn desired(
        &self,
        leader_transitions: u64,
        base: Option<&LeaderElectionRecord>,
    ) -> LeaderElectionRecord {
        let now = Utc::now();
        LeaderElectionRecord {
            holder_identity: self.identity().to_owned(),
            lease_duration: self.elector.config.lease_duration,
            acquire_time: now,
            renew_time: now,
            leader_transitions,
            strategy: base.and_then(|r| r.strategy.clone()),
            // An acquisition fulfils (or overrides) a pending handover request.
            preferred_holder: None,
        }
    }

    /// Until when this candidate stands back from `record`, whose pending handover names
    /// another candidate: one lease duration from when it first saw the request. `None` when
    /// no such request is pending.
    fn stand_back_until(&self, record: &LeaderElectionRecord) -> Option<Instant> {
        if !record.reserved_for_other_than(self.identity()) {
            return None;
        }
        self.handover_seen.as_ref().map(|(_, until)| *until)
    }

    /// The candidate loop: returns the acquired record and when the acquiring request started,
    /// or `None` on shutdown.
    async fn acquire(&mut self, shutdown: &CancellationToken) -> Option<(Observed, Instant)> {
        loop {
            if shutdown.is_cancelled() {
                return None;
            }
            self.ensure_watch().await;
            let started = Instant::now();
            let attempt = tokio::select! {
                biased;
                () = shutdown.cancelled() => return None,
                attempt = self.try_acquire() => attempt,
            };
            match attempt {
                Ok(Attempt::Acquired(observed)) => {
                    self.backoff.succeeded();
                    self.report_success();
                    return Some((observed, started));
                }
                Ok(Attempt::Handed(observed, alive_since)) => {
                    // S3: the term counts from when the store last confirmed the lease alive.
                    // With less than a retry period of it left, a renewal confirms it first.
                    let config = &self.elector.config;
                    if Instant::now() + config.retry_period < alive_since + config.renew_deadline {
                        self.backoff.succeeded();
                        self.report_success();
                        return Some((observed, alive_since.min(started)));
                    }
                    let confirming = Instant::now();
                    let mut record = observed.record.clone();
                    record.renew_time = Utc::now().max(record.acquire_time);
                    let renewal = tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return None,
                        renewal = self.request("renew", self.elector.lock.renew(&observed.version, &record)) => renewal,
                    };
                    match renewal {
                        Ok(stored) => {
                            self.observe(stored.clone());
                            self.backoff.succeeded();
                            self.report_success();
                            return Some((stored, confirming));
                        }
                        Err(err) => {
                            if !err.is_conflict() {
                                self.backoff.failed();
                            }
                            self.report_error("renew", &err);
                        }
                    }
                }
                Ok(Attempt::NotAcquired) => {
                    self.backoff.succeeded();
                    self.report_success();
                }
                Err(err) => {
                    if !err.is_conflict() {
                        self.backoff.failed();
                    }
                    self.report_error("acquire", &err);
                }
            }
            self.publish_following();
            if !self.wait_for_next_attempt(started, shutdown).await {
                return None;
            }
        }
    }

    /// Waits until the next attempt; `false` on shutdown. A change notification ends the wait at
    /// once. After a failure it ends the back-off no sooner than a retry period after the last
    /// attempt started, and only once until an attempt succeeds: a stream that fires (or ends)
    /// over and over never makes a failing candidate retry faster than its back-off (S9).
    async fn wait_for_next_attempt(
        &mut self,
        attempt_started: Instant,
        shutdown: &CancellationToken,
    ) -> bool {
        let mut wake_at = Instant::now() + self.next_attempt_in();
        let failing = self.backoff.is_failing();
        if !failing {
            self.change_shortened_backoff = false;
        }
        loop {
            let changes = self.changes.as_mut();
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return false,
                () = sleep_until(wake_at) => return true,
                more = next_change(changes) => {
                    if !more {
                        // Subscribe again at the next attempt; wait out this one's time.
                        self.changes = None;
                        continue;
                    }
                    if !failing {
                        return true;
                    }
                    if !self.change_shortened_backoff {
                        self.change_shortened_backoff = true;
                        wake_at = wake_at.min(attempt_started + self.elector.config.retry_period);
                    }
                }
            }
        }
    }

    /// How long a candidate waits before the next attempt (S9): after a failure, the back-off;
    /// otherwise the jittered retry period, or less when the observed lease runs out sooner. That
    /// early wake-up is used once per observed version and only for an instant still to come.
    fn next_attempt_in(&mut self) -> Duration {
        let wait = self.backoff.wait();
        if self.backoff.is_failing() || self.woke_for_expiry {
            return wait;
        }
        let Some(observed) = &self.observed else {
            return wait;
        };
        let record = &observed.record;
        let expires = if let Some(until) = self.stand_back_until(record) {
            until
        } else if record.is_free() || record.holder_identity == self.identity() {
            return wait;
        } else {
            self.store_expiry
                .unwrap_or(self.observed_at + record.lease_duration)
        };
        let now = Instant::now();
        if expires <= now {
            return wait;
        }
        // A hair past expiry, so the check that follows sees it expired.
        let until = expires - now + Duration::from_millis(1);
        if until < wait {
            self.woke_for_expiry = true;
            return until;
        }
        wait
    }

    /// Subscribes to change notifications when there is no subscription; a failure is retried
    /// on its own back-off, and never delays an attempt.
    async fn ensure_watch(&mut self) {
        if self.changes.is_some() || !self.watch_supported {
            return;
        }
        if self.watch_retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        match self.request("watch", self.elector.lock.watch()).await {
            Ok(stream) => {
                self.watch_supported = stream.is_some();
                self.changes = stream.map(Mutex::new);
                self.watch_backoff.succeeded();
                self.watch_retry_at = None;
                log_recovery(self.watch_failures.succeeded(), "watch");
            }
            Err(err) => {
                m::error(&self.elector.config.name, "watch", err.kind());
                self.watch_backoff.failed();
                self.watch_retry_at = Some(Instant::now() + self.watch_backoff.wait());
                let line = self.watch_failures.failed("watch", &err);
                log_failure(line, "watch", &err, self.watch_backoff.failures());
            }
        }
    }

    /// One attempt of client-go's `tryAcquireOrRenew` for a candidate.
    async fn try_acquire(&mut self) -> Result<Attempt, LockError> {
        self.store_expiry = None;
        let mut current = None;
        if self.try_acquire_supported {
            let desired = self.desired(0, self.observed.as_ref().map(|o| &o.record));
            match self
                .request("try_acquire", self.elector.lock.try_acquire(&desired))
                .await?
            {
                Some(Acquisition::Acquired(observed)) => {
                    self.observe(observed.clone());
                    return Ok(Attempt::Acquired(observed));
                }
                Some(Acquisition::Handed {
                    observed,
                    alive_since,
                }) => {
                    self.observe(observed.clone());
                    return Ok(Attempt::Handed(observed, alive_since));
                }
                Some(Acquisition::Held {
                    observed,
                    expires_in,
                    renewed_in_store,
                }) => {
                    self.observe(observed.clone());
                    self.store_expiry = expires_in.map(|left| Instant::now() + left);
                    // The holder renews in the store without changing the record: only the
                    // store can say it expired (S2 by the store's clock alone).
                    if renewed_in_store {
                        return Ok(Attempt::NotAcquired);
                    }
                    // The store's clock says held; ours may still say expired (below): a record
                    // the store never expires (written without a TTL by another client) must
                    // not block the election forever (S8).
                    current = Some(observed);
                }
                Some(Acquisition::Unassigned(observed)) => {
                    if let Some(observed) = observed {
                        self.observe(observed);
                    }
                    return Ok(Attempt::NotAcquired);
                }
                None => self.try_acquire_supported = false,
            }
        }
        if current.is_none() {
            let Some(read) = self.request("get", self.elector.lock.get()).await? else {
                let created = self
                    .request("create", self.elector.lock.create(&self.desired(1, None)))
                    .await?;
                self.observe(created.clone());
                return Ok(Attempt::Acquired(created));
            };
            self.observe(read.clone());
            current = Some(read);
        }
        let Some(current) = current else {
            return Ok(Attempt::NotAcquired);
        };
        let record = &current.record;
        // S2: another holder's lease runs for *its* duration from when we first saw this version.
        if !record.is_free()
            && record.holder_identity != self.identity()
            && Instant::now() < self.observed_at + record.lease_duration
        {
            return Ok(Attempt::NotAcquired);
        }
        // A planned handover to another candidate: stand back for a lease, so that it wins.
        if self
            .stand_back_until(record)
            .is_some_and(|until| Instant::now() < until)
        {
            return Ok(Attempt::NotAcquired);
        }
        // S5: every acquisition, also our own again, gets the next fencing token.
        let desired = self.desired(record.leader_transitions + 1, Some(record));
        let stored = self
            .request(
                "update",
                self.elector.lock.update(&current.version, &desired),
            )
            .await?;
        self.observe(stored.clone());
        Ok(Attempt::Acquired(stored))
    }

    /// One term of leadership, from acquisition to step-down.
    async fn lead(&mut self, acquired: Observed, started: Instant, shutdown: &CancellationToken) {
        let fencing_token = acquired.record.leader_transitions;
        let cancel = CancellationToken::new();
        // Should this future be dropped mid-term (an aborted task), the work must still stop.
        let _cancel_on_drop = cancel.clone().drop_guard();
        let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
        let (handover_tx, mut handover_rx) = mpsc::channel::<String>(1);
        let leadership = Leadership::new(
            self.elector.config.name.clone(),
            self.identity().to_owned(),
            fencing_token,
            cancel.clone(),
            handover_tx,
            alive_tx,
        );
        // S3: the term lasts until the start of the last successful renewal plus the deadline.
        let mut deadline = started + self.elector.config.renew_deadline;
        self.health_update(|h| h.lead(started));
        tracing::info!(fencing_token, "became leader");
        m::acquired(&self.elector.config.name);
        m::set_leading(&self.elector.config.name, true);
        self.spawn_event(LeaderEvent::BecameLeader { fencing_token });
        self.publish(LeaderState::Leading(leadership.clone()));
        let work: Vec<JoinHandle<()>> = self
            .elector
            .callbacks
            .started
            .iter()
            .map(|callback| tokio::spawn(callback(leadership.clone())))
            .collect();
        drop(leadership);

        // A handover this term was asked for (by its own work, or by a request in the record).
        let mut hand_to: Option<String> = None;
        let reason = loop {
            let changes = self.changes.as_mut();
            tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                Some(to) = handover_rx.recv() => {
                    hand_to = Some(to);
                    break StepDownReason::HandedOver;
                }
                () = sleep(self.elector.config.retry_period) => {}
                // A release or a handover request: renew now, which reads what changed.
                more = next_change(changes) => if !more {
                    self.changes = None;
                },
            }
            let attempt_started = Instant::now();
            let renewed = tokio::select! {
                biased;
                () = sleep_until(deadline) => break StepDownReason::RenewDeadlineExceeded,
                () = shutdown.cancelled() => break StepDownReason::Shutdown,
                renewed = self.renew(fencing_token) => renewed,
            };
            match renewed {
                // An answer after the deadline does not extend the term; the next select ends it.
                Ok(Renewal::Renewed) if Instant::now() < deadline => {
                    self.report_success();
                    deadline = attempt_started + self.elector.config.renew_deadline;
                    m::renewed(&self.elector.config.name, attempt_started.elapsed());
                    self.health_update(|h| h.renewed(attempt_started));
                }
                Ok(Renewal::Renewed) => {}
                Ok(Renewal::Lost) => break StepDownReason::Lost,
                Ok(Renewal::HandOver(to)) => {
                    self.report_success();
                    hand_to = Some(to);
                    break StepDownReason::HandedOver;
                }
                Err(err) => self.report_error("renew", &err),
            }
        };

        cancel.cancel();
        m::set_leading(&self.elector.config.name, false);
        self.health_update(HealthState::follow);
        tracing::info!(fencing_token, ?reason, "stopped leading");
        self.publish_following();
        let stopped = self.wait_for_work(work, &mut alive_rx).await;
        let mut released = false;
        let release = match reason {
            StepDownReason::Shutdown => self.elector.config.release_on_cancel,
            StepDownReason::HandedOver => true,
            _ => false,
        };
        if release {
            if stopped {
                if reason == StepDownReason::Shutdown {
                    let _ = timeout(
                        self.elector.config.request_timeout,
                        self.elector.lock.withdraw(),
                    )
                    .await;
                }
                released = self.release(fencing_token, hand_to.as_deref()).await;
                if released && let Some(to) = &hand_to {
                    tracing::info!(fencing_token, to, "handed the lease over");
                    m::handed_over(&self.elector.config.name);
                }
            } else {
                tracing::warn!(
                    fencing_token,
                    "leader work did not stop within the grace period; not releasing the lease, it will expire"
                );
            }
        }
        self.spawn_event(LeaderEvent::StoppedLeading { fencing_token });
        if let Some(callback) = &self.elector.callbacks.stopped {
            callback(StepDown {
                fencing_token,
                reason,
                released,
            });
        }
    }

    /// Renews the lease: one request from the cached record (client-go's fast path), and a read
    /// only when that loses the compare-and-swap, which is also how a handover request written
    /// by someone else is found.
    async fn renew(&mut self, fencing_token: u64) -> Result<Renewal, LockError> {
        if let Some(cached) = self
            .observed
            .clone()
            .filter(|o| self.is_ours(o, fencing_token) && o.record.handover_to().is_none())
        {
            let mut record = cached.record.clone();
            record.renew_time = Utc::now().max(record.acquire_time);
            match self
                .request("renew", self.elector.lock.renew(&cached.version, &record))
                .await
            {
                Ok(stored) => {
                    self.observe(stored);
                    return Ok(Renewal::Renewed);
                }
                Err(err) if err.is_conflict() => {}
                Err(err) => return Err(err),
            }
        }
        m::slow_path(&self.elector.config.name);
        let Some(current) = self.request("get", self.elector.lock.get()).await? else {
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
        record.renew_time = Utc::now().max(record.acquire_time);
        let stored = if record.handover_to().is_some() {
            // A request naming this leader is fulfilled already: clear it.
            record.preferred_holder = None;
            self.request(
                "update",
                self.elector.lock.update(&current.version, &record),
            )
            .await?
        } else {
            self.request("renew", self.elector.lock.renew(&current.version, &record))
                .await?
        };
        self.observe(stored);
        Ok(Renewal::Renewed)
    }

    /// The record is this term's: our identity and our fencing token (a re-acquisition by a
    /// process with the same identity would have raised the token).
    fn is_ours(&self, observed: &Observed, fencing_token: u64) -> bool {
        observed.record.is_held_by(self.identity())
            && observed.record.leader_transitions == fencing_token
    }

    /// Waits, up to the stop grace, until the work has stopped and every clone of the
    /// leadership is gone; aborts callback tasks that outlive it.
    async fn wait_for_work(
        &self,
        work: Vec<JoinHandle<()>>,
        alive: &mut mpsc::Receiver<()>,
    ) -> bool {
        let aborts: Vec<_> = work.iter().map(JoinHandle::abort_handle).collect();
        let all_stopped = async {
            for task in work {
                if let Err(err) = task.await
                    && err.is_panic()
                {
                    tracing::error!("leader work panicked");
                }
            }
            // `None` once every `Leadership` clone has been dropped.
            while alive.recv().await.is_some() {}
        };
        if timeout(self.elector.config.stop_grace, all_stopped)
            .await
            .is_ok()
        {
            return true;
        }
        for abort in aborts {
            abort.abort();
        }
        tracing::warn!(
            grace = ?self.elector.config.stop_grace,
            "leader work still running after the stop grace; callback tasks aborted"
        );
        false
    }

    /// Clears the holder with a compare-and-swap, so a release never frees a lease that someone
    /// else holds (S6). A handover names `hand_to` as the next holder; otherwise a pending
    /// request in the record is kept.
    async fn release(&mut self, fencing_token: u64, hand_to: Option<&str>) -> bool {
        let mut current = self.observed.clone();
        // Two tries: from the cached record, then, if that lost the compare-and-swap, from a
        // fresh read. The cache can be stale without anyone else having written: a renewal cut
        // short by the shutdown may still have reached the store.
        for attempt in 0..2 {
            let Some(ours) = current.filter(|o| self.is_ours(o, fencing_token)) else {
                return false;
            };
            let now = Utc::now();
            let mut record = LeaderElectionRecord {
                holder_identity: String::new(),
                acquire_time: now,
                renew_time: now,
                ..ours.record.clone()
            };
            if let Some(to) = hand_to {
                record.preferred_holder = Some(to.to_owned());
            }
            match self
                .request("release", self.elector.lock.update(&ours.version, &record))
                .await
            {
                Ok(stored) => {
                    tracing::info!(fencing_token, "released the lease");
                    self.observe(stored);
                    return true;
                }
                Err(err) if err.is_conflict() && attempt == 0 => {
                    current = match self.request("get", self.elector.lock.get()).await {
                        Ok(fresh) => fresh,
                        Err(err) => {
                            self.report_error("release", &err);
                            return false;
                        }
                    };
                    if let Some(fresh) = &current {
                        self.observe(fresh.clone());
                    }
                }
                Err(err) => {
                    self.report_error("release", &err);
                    return false;
                }
            }
        }
        false
    }

    fn spawn_event(&self, event: LeaderEvent) {
        let lock = self.elector.lock.clone();
        let after = self.elector.config.request_timeout;
        tokio::spawn(async move {
            let _ = timeout(after, lock.record_event(&event)).await;
        });
    }

    fn health_update(&self, update: impl FnOnce(&mut HealthState)) {
        update(
            &mut self
                .elector
                .health
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
    }
}

/// Logs what [`FailureLog`] decided about a failure.
fn log_failure(line: LogLine, operation: &'static str, err: &LockError, consecutive: u32) {
    match line {
        LogLine::Started => {
            tracing::warn!(operation, error = %err, "lock request failed; retrying with back-off");
        }
        LogLine::Changed => {
            tracing::warn!(operation, error = %err, "lock request failed differently; still retrying");
        }
        LogLine::Summary { count, since } => tracing::warn!(
            operation,
            failures = count,
            since = ?since,
            consecutive,
            last_error = %err,
            "lock requests still failing"
        ),
        LogLine::Quiet | LogLine::Recovered { .. } => {
            tracing::debug!(operation, error = %err, "lock request failed");
        }
    }
}

/// Logs the end of an outage, if one ended.
fn log_recovery(line: LogLine, what: &'static str) {
    if let LogLine::Recovered { count, lasted } = line {
        tracing::info!(failures = count, lasted = ?lasted, "{what} requests succeed again");
    }
}

/// The next change notification: `true` when one arrived, `false` when the stream ended. Without
/// a stream it never completes.
async fn next_change(changes: Option<&mut Mutex<ChangeStream>>) -> bool {
    match changes {
        Some(stream) => {
            let stream = stream.get_mut().unwrap_or_else(|p| p.into_inner());
            stream.next().await.is_some()
        }
        None => std::future::pending().await,
    }
}
