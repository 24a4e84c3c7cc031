//! A candidate's campaign: the attempts to acquire (paced by the retry period, woken by the
//! store's notifications), each attempt's decision on the record as read, and the record an
//! acquisition writes.

use super::*;

impl Runner {
    /// The record of an acquisition by this candidate with token `leader_transitions`
    /// ([`rules::acquisition`]).
    pub(super) fn desired(
        &self,
        leader_transitions: u64,
        base: Option<&LeaderElectionRecord>,
    ) -> LeaderElectionRecord {
        rules::acquisition(
            self.identity(),
            &self.config.lease,
            leader_transitions,
            base,
        )
    }

    /// Until when this candidate stands back from `record`, whose pending handover names
    /// another candidate: one lease duration from when it first saw the request. `None` when
    /// no such request is pending.
    pub(super) fn stand_back_until(&self, record: &LeaderElectionRecord) -> Option<Instant> {
        self.sighting
            .as_ref()?
            .stand_back_until(record, self.identity())
    }

    /// The candidate loop: returns the acquired record and when the acquiring request started,
    /// or `None` on shutdown.
    pub(super) async fn acquire(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Option<(Observed, Instant)> {
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
                    let config = &self.config;
                    if Instant::now() + config.lease.retry_period
                        < alive_since + config.lease.renew_deadline
                    {
                        self.backoff.succeeded();
                        self.report_success();
                        return Some((observed, alive_since.min(started)));
                    }
                    let confirming = Instant::now();
                    let mut record = observed.record.clone();
                    record.renew_time = record.renewal_time(self.config.lease.wall_clock.now());
                    let renewal = tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return None,
                        renewal = self.request("renew", self.lock.renew(&observed.version, &record)) => renewal,
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
                            self.report_error("renew", err);
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
                    self.report_error("acquire", err);
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
    pub(super) async fn wait_for_next_attempt(
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
                        wake_at = wake_at.min(attempt_started + self.config.lease.retry_period);
                    }
                }
            }
        }
    }

    /// How long a candidate waits before the next attempt (S9): after a failure, the back-off;
    /// otherwise the jittered retry period, or less when the observed lease runs out sooner. That
    /// early wake-up is used once per observed version and only for an instant still to come.
    pub(super) fn next_attempt_in(&mut self) -> Duration {
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
        } else if record.is_free() || self.started(record) {
            return wait;
        } else if let Some(expiry) = self.store_expiry {
            expiry
        } else if let Some(sighting) = &self.sighting {
            sighting.lease_ends(record)
        } else {
            return wait;
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
    pub(super) async fn ensure_watch(&mut self) {
        if self.changes.is_some() || !self.watch_supported {
            return;
        }
        if self.watch_retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        match self.request("watch", self.lock.watch()).await {
            Ok(stream) => {
                self.watch_supported = stream.is_some();
                self.changes = stream.map(Mutex::new);
                self.watch_backoff.succeeded();
                self.watch_retry_at = None;
                log_recovery(self.watch_failures.succeeded(), "watch");
            }
            Err(err) => {
                m::error(&self.config.name, "watch", err.kind());
                self.watch_backoff.failed();
                self.watch_retry_at = Some(Instant::now() + self.watch_backoff.wait());
                let line = self.watch_failures.failed("watch", &err);
                log_failure(line, "watch", &err, self.watch_backoff.failures());
                self.tell_error(ElectionError::Lock {
                    operation: "watch",
                    error: Arc::new(err),
                });
            }
        }
    }

    /// One attempt of client-go's `tryAcquireOrRenew` for a candidate.
    pub(super) async fn try_acquire(&mut self) -> Result<Attempt, LockError> {
        self.store_expiry = None;
        self.held_in_store = false;
        let mut current = None;
        if self.try_acquire_supported {
            // The store gives the next token; the floor, if any, is what it asks for at least.
            let desired = self.desired(0, self.observed.as_ref().map(|o| &o.record));
            match self
                .request("try_acquire", self.lock.try_acquire(&desired))
                .await?
            {
                Some(Acquisition::Acquired(observed)) => {
                    self.took(&observed);
                    return Ok(Attempt::Acquired(observed));
                }
                Some(Acquisition::Handed {
                    observed,
                    alive_since,
                }) => {
                    self.took(&observed);
                    return Ok(Attempt::Handed(observed, alive_since));
                }
                Some(Acquisition::Held {
                    observed,
                    expires_in,
                    renewed_in_store,
                }) => {
                    self.store_expiry = expires_in.map(|left| Instant::now() + left);
                    self.held_in_store = renewed_in_store;
                    self.observe(observed.clone());
                    // A lease the store stopped keeping alive is counted from now (S2).
                    if let Some(sighting) = &mut self.sighting {
                        sighting.store_keeps(renewed_in_store, Instant::now());
                    }
                    // The holder renews in the store without changing the record: only the
                    // store can say it expired (S2 by the store's clock alone). A term this
                    // process led itself (before its renew deadline passed) it takes again
                    // with a compare-and-swap, below.
                    if renewed_in_store && !self.started(&observed.record) {
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
            let Some(read) = self.request("get", self.lock.get()).await? else {
                let created = self
                    .request("create", self.lock.create(&self.desired(1, None)))
                    .await?;
                self.took(&created);
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
        // A term of this identity that this process did not start is another's (S13).
        if !record.is_free()
            && !self.started(record)
            && !self
                .sighting
                .as_ref()
                .is_some_and(|s| s.expired(&current, Instant::now()))
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
        let desired = self.desired(next_token(record)?, Some(record));
        let stored = self
            .request("update", self.lock.update(&current.version, &desired))
            .await?;
        self.took(&stored);
        Ok(Attempt::Acquired(stored))
    }
}
