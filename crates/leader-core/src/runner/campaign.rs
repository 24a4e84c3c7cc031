//! A candidate's campaign: the attempts to acquire (paced by the retry period and its back-off,
//! woken by the store's notifications), each attempt's decision on the record as read, the
//! record an acquisition writes, and what the candidate saw of the record, which the terms it
//! leads keep up to date.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::context::{Context, log_failure, log_recovery};
use crate::backoff::{Backoff, Jitter};
use crate::config::ElectorConfig;
use crate::error::LockError;
use crate::lock::{Acquisition, ChangeStream};
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed, Version};
use crate::retry::FailureLog;
use crate::rules::{self, Changes, OtherTerm, Sighting, TokensSeen, Unanswered};
use crate::status::{self, ElectionError, IdentityConflict};
use crate::view::ObservedTerm;

/// A candidate's campaign, kept across the terms it leads: what it saw, how long it waits
/// between attempts, and its subscription to the store's changes.
pub(super) struct Campaign {
    /// What this candidate saw of the record; the terms it leads keep it up to date.
    seen: Seen,
    /// Waits between attempts (S9).
    backoff: Backoff,
    /// Whether a change notification already cut short a back-off since the last success.
    change_shortened_backoff: bool,
    /// Whether the lock has a one-request acquisition ([`ResourceLock::try_acquire`]); false
    /// once it said it has none.
    ///
    /// [`ResourceLock::try_acquire`]: crate::ResourceLock::try_acquire
    try_acquire_supported: bool,
    /// Whether the one-request acquisition ever answered that the store keeps the holder's
    /// lease alive itself ([`Acquisition::Held`]'s `renewed_in_store`): the store's, then, to
    /// say when a lease ends, also by deleting its record (an expired TTL), and an unchanged
    /// version says nothing of the holder's renewals, so no candidate counts a lease for a
    /// record that may be gone.
    store_keeps_leases: bool,
    /// The subscription to the store's change notifications.
    watch: Subscription,
}

/// What one attempt to acquire got.
enum Attempt {
    /// The lease, from this attempt's request.
    Acquired(Observed),
    /// Handed over by a release, on a lease the store confirmed alive at that instant.
    Handed(Observed, Instant),
    /// Nothing: held by another, stood back from, or lost to another candidate.
    NotAcquired,
}

impl Campaign {
    /// A campaign with nothing seen yet, paced by `config`'s retry period.
    pub(super) fn new(config: &ElectorConfig) -> Self {
        let backoff = Backoff::new(config.lease.retry_period, config.lease.lease_duration)
            .jitter(Jitter::Spread(config.jitter));
        Self {
            seen: Seen::default(),
            watch: Subscription::new(backoff.clone()),
            backoff,
            change_shortened_backoff: false,
            try_acquire_supported: true,
            store_keeps_leases: false,
        }
    }

    /// The last record seen, read or written.
    pub(super) fn observed(&self) -> Option<&Observed> {
        self.seen.observed.as_ref()
    }

    /// Takes note of a record read or written ([`Seen::observe`]).
    pub(super) fn observe(&mut self, context: &Context, observed: Observed) {
        self.seen
            .observe(context, observed, self.try_acquire_supported);
    }

    /// The next change notification: `true` when one arrived, `false` when the stream ended
    /// (subscribed again at the next attempt). Without a subscription it never completes.
    pub(super) async fn changed(&mut self) -> bool {
        self.watch.changed().await
    }

    /// The candidate loop: returns the acquired record and when the acquiring request started,
    /// or `None` on shutdown.
    pub(super) async fn acquire(
        &mut self,
        context: &mut Context,
        shutdown: &CancellationToken,
    ) -> Option<(Observed, Instant)> {
        loop {
            if shutdown.is_cancelled() {
                return None;
            }
            self.watch.ensure(context).await;
            let started = Instant::now();
            let attempt = tokio::select! {
                biased;
                () = shutdown.cancelled() => return None,
                attempt = self.try_acquire(context) => attempt,
            };
            match attempt {
                Ok(Attempt::Acquired(observed)) => {
                    self.backoff.succeeded();
                    context.report_success();
                    return Some((observed, started));
                }
                Ok(Attempt::Handed(observed, alive_since)) => {
                    // S3: the term counts from when the store last confirmed the lease alive.
                    // With less than a retry period of it left, a renewal confirms it first.
                    let lease = &context.config.lease;
                    if rules::handed_term_left(lease, alive_since, Instant::now()) {
                        self.backoff.succeeded();
                        context.report_success();
                        return Some((observed, alive_since.min(started)));
                    }
                    let confirming = Instant::now();
                    let record = rules::renewal(&observed.record, lease);
                    let renewal = tokio::select! {
                        biased;
                        () = shutdown.cancelled() => return None,
                        renewal = context.request("renew", context.lock.renew(&observed.version, &record)) => renewal,
                    };
                    match renewal {
                        Ok(stored) => {
                            self.observe(context, stored.clone());
                            self.backoff.succeeded();
                            context.report_success();
                            return Some((stored, confirming));
                        }
                        Err(err) => self.failed(context, "renew", err),
                    }
                }
                Ok(Attempt::NotAcquired) => {
                    self.backoff.succeeded();
                    context.report_success();
                }
                Err(err) => self.failed(context, "acquire", err),
            }
            context.publish_following(self.observed());
            if !self.wait_for_next_attempt(context, started, shutdown).await {
                return None;
            }
        }
    }

    /// Notes a failed request: a failure for the back-off unless it lost a compare-and-swap,
    /// then reported ([`Context::report_error`]).
    fn failed(&mut self, context: &mut Context, operation: &'static str, err: LockError) {
        if !err.is_conflict() {
            self.backoff.failed();
        }
        context.report_error(operation, err, self.backoff.failures());
    }

    /// Waits until the next attempt; `false` on shutdown. A change notification ends the wait at
    /// once. After a failure it ends the back-off no sooner than a retry period after the last
    /// attempt started, and only once until an attempt succeeds: a stream that fires (or ends)
    /// over and over never makes a failing candidate retry faster than its back-off (S9).
    async fn wait_for_next_attempt(
        &mut self,
        context: &Context,
        attempt_started: Instant,
        shutdown: &CancellationToken,
    ) -> bool {
        let mut wake_at = Instant::now() + self.next_attempt_in(context.identity());
        let failing = self.backoff.is_failing();
        if !failing {
            self.change_shortened_backoff = false;
        }
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return false,
                () = sleep_until(wake_at) => return true,
                more = self.watch.changed() => {
                    if !more {
                        // Subscribe again at the next attempt; wait out this one's time.
                        continue;
                    }
                    if !failing {
                        return true;
                    }
                    if !self.change_shortened_backoff {
                        self.change_shortened_backoff = true;
                        wake_at = wake_at.min(attempt_started + context.config.lease.retry_period);
                    }
                }
            }
        }
    }

    /// How long a candidate waits before the next attempt (S9): after a failure, the back-off;
    /// otherwise the jittered retry period, or less when the observed lease runs out sooner
    /// ([`Seen::until_expiry`]).
    fn next_attempt_in(&mut self, me: &str) -> Duration {
        let wait = self.backoff.wait();
        if self.backoff.is_failing() {
            return wait;
        }
        self.seen.until_expiry(me, wait)
    }

    /// One attempt of client-go's `tryAcquireOrRenew` for a candidate.
    async fn try_acquire(&mut self, context: &Context) -> Result<Attempt, LockError> {
        let mut current = None;
        let me = context.identity();
        // S2 for a record that may be gone: a candidate that last saw another holder's lease
        // reads the record, rather than send an acquisition that would create one found gone
        // ([`rules::reads_first`]), and waits a record found gone out.
        let check = context.lock.holder_check();
        let reads_first = !self.try_acquire_supported || rules::reads_first(check);
        if reads_first && !self.store_keeps_leases && self.seen.counts_another(me) {
            match context.request("get", context.lock.get()).await? {
                None => {
                    if self.seen.gone_waits(Instant::now()) {
                        return Ok(Attempt::NotAcquired);
                    }
                }
                Some(read) => {
                    // A version first read after failed attempts may have been written at any
                    // time while they failed.
                    let seen_late = self.backoff.is_failing() && !self.seen.sees(&read.version);
                    self.observe(context, read.clone());
                    let record = &read.record;
                    let held = !record.is_free()
                        && !self.seen.started(record, me)
                        && !self.seen.run_out(&read, Instant::now());
                    if rules::waits_after_read(check, held, seen_late) {
                        return Ok(Attempt::NotAcquired);
                    }
                    // Free, run out, this process's own, or for the store to judge: acquired
                    // as from any read, in one request where the store has one.
                    if !self.try_acquire_supported {
                        current = Some(read);
                    }
                }
            }
        }
        self.seen.forget_store_answer();
        if self.try_acquire_supported {
            // The store gives the next token; what it asks for is a floor: above every token
            // seen (a record deleted and written anew starts again low) and the configured one.
            let desired = desired(
                context,
                self.seen.tokens.floor(),
                self.observed().map(|o| &o.record),
            );
            let answer = context
                .request("try_acquire", context.lock.try_acquire(&desired))
                .await;
            match self.seen.unanswered(&desired, answer)? {
                Some(Acquisition::Acquired(observed)) => {
                    self.took(context, &observed);
                    return Ok(Attempt::Acquired(observed));
                }
                Some(Acquisition::Handed {
                    observed,
                    alive_since,
                }) => {
                    self.took(context, &observed);
                    return Ok(Attempt::Handed(observed, alive_since));
                }
                Some(Acquisition::Held {
                    observed,
                    expires_in,
                    renewed_in_store,
                }) => {
                    self.store_keeps_leases |= renewed_in_store;
                    self.seen.held(
                        context,
                        observed.clone(),
                        expires_in,
                        renewed_in_store,
                        self.try_acquire_supported,
                    );
                    // The holder renews in the store without changing the record: only the
                    // store can say it expired (S2 by the store's clock alone). A term this
                    // process led itself (before its renew deadline passed) it takes again
                    // with a compare-and-swap, below.
                    if renewed_in_store && !self.seen.started(&observed.record, context.identity())
                    {
                        return Ok(Attempt::NotAcquired);
                    }
                    // The store's clock says held; ours may still say expired (below): a record
                    // the store never expires (written without a TTL by another client) must
                    // not block the election forever (S8).
                    current = Some(observed);
                }
                Some(Acquisition::Unassigned(observed)) => {
                    if let Some(observed) = observed {
                        self.observe(context, observed);
                    }
                    return Ok(Attempt::NotAcquired);
                }
                None => self.try_acquire_supported = false,
            }
        }
        if current.is_none() {
            let Some(read) = context.request("get", context.lock.get()).await? else {
                // S5: above every token seen, should the record have been deleted.
                let desired = desired(context, self.seen.tokens.floor(), None);
                let answer = context
                    .request("create", context.lock.create(&desired))
                    .await;
                let created = self.seen.unanswered(&desired, answer)?;
                self.took(context, &created);
                return Ok(Attempt::Acquired(created));
            };
            self.observe(context, read.clone());
            current = Some(read);
        }
        let Some(current) = current else {
            return Ok(Attempt::NotAcquired);
        };
        let record = &current.record;
        // S2: another holder's lease runs for *its* duration from when we first saw this version.
        // A term of this identity that this process did not start is another's (S13).
        if !record.is_free()
            && !self.seen.started(record, me)
            && !self.seen.expired(&current, Instant::now())
        {
            return Ok(Attempt::NotAcquired);
        }
        // A planned handover to another candidate: stand back for a lease, so that it wins.
        if self
            .seen
            .stand_back_until(record, me)
            .is_some_and(|until| Instant::now() < until)
        {
            return Ok(Attempt::NotAcquired);
        }
        // S5: every acquisition, also our own again, gets the next fencing token.
        let desired = desired(context, self.seen.tokens.next(record)?, Some(record));
        let answer = context
            .request("update", context.lock.update(&current.version, &desired))
            .await;
        let stored = self.seen.unanswered(&desired, answer)?;
        self.took(context, &stored);
        Ok(Attempt::Acquired(stored))
    }

    /// Takes note of a record this candidate acquired ([`Seen::took`]).
    fn took(&mut self, context: &Context, acquired: &Observed) {
        self.seen
            .took(context, acquired, self.try_acquire_supported);
    }
}

/// The record of an acquisition by this candidate with token `leader_transitions`
/// ([`rules::acquisition`]).
fn desired(
    context: &Context,
    leader_transitions: u64,
    base: Option<&LeaderElectionRecord>,
) -> LeaderElectionRecord {
    rules::acquisition(
        context.identity(),
        &context.config.lease,
        leader_transitions,
        base,
    )
}

/// What this candidate saw of the record and what follows from it: the holder's lease and a
/// pending handover request on this process's clock (S1, S2, S10), what the store said of the
/// lease, the leader last reported, and whose term the record is (S13).
#[derive(Default)]
struct Seen {
    /// The last record seen, read or written.
    observed: Option<Observed>,
    /// What this candidate saw of `observed` and since when, on this process's monotonic
    /// clock: the holder's lease (S1, S2) and a pending handover request (S10).
    sighting: Option<Sighting>,
    /// When the holder's lease runs out by the store's clock, as its last `Held` answer said
    /// (on this process's clock, counted from when that answer arrived), with the version it
    /// said it of: a later version's lease runs longer. A wake-up time, and the end of a
    /// wait for a record that may be gone; the store itself decides a store-clock
    /// acquisition.
    store_expiry: Option<(Version, Instant)>,
    /// Whether the last `Held` answer said the store keeps the holder's lease alive.
    held_in_store: bool,
    /// Whether a wait was already cut short for `observed`'s expiry: an early wake-up is used
    /// once per version, so a lease that has run out never makes attempts follow each other.
    woke_for_expiry: bool,
    /// The leader last passed to `on_new_leader`.
    reported_leader: Option<String>,
    /// The fencing token of the last term this process led (S13): a record held by this
    /// identity under another token is another process's.
    own_term: Option<u64>,
    /// A term of this identity that this process did not start, as first seen (S13).
    shared_identity: Option<OtherTerm>,
    /// The largest fencing token seen (S5), kept when the record goes.
    tokens: TokensSeen,
    /// The last acquisition sent whose answer did not come, until this candidate acquires.
    unanswered: Option<Unanswered>,
}

impl Seen {
    /// Takes note of a record read or written. The follower's clock for the holder's lease
    /// starts when a version is first seen, after the request returned (S2). `one_request`:
    /// whether the lock has a one-request acquisition, whose answers say whether the store
    /// keeps leases alive.
    fn observe(&mut self, context: &Context, observed: Observed, one_request: bool) {
        let now = Instant::now();
        self.tokens.see(&observed.record);
        self.know_own_term(context, &observed.record);
        let changes = match &mut self.sighting {
            Some(sighting) => sighting.see(&observed, now),
            None => {
                let sighting = Sighting::new(&observed, now);
                self.sighting = Some(sighting);
                Changes {
                    version: true,
                    handover: observed.record.handover_to().is_some(),
                }
            }
        };
        if changes.version {
            self.woke_for_expiry = false;
            status::lock(&context.shared).term = ObservedTerm::of(&observed.record);
        }
        if changes.handover
            && let Some(to) = observed.record.handover_to()
        {
            tracing::info!(to, "handover requested");
        }
        self.check_identity(context, &observed, one_request);
        let holder = &observed.record.holder_identity;
        if !holder.is_empty() && self.reported_leader.as_deref() != Some(holder.as_str()) {
            tracing::info!(leader = %holder, "new leader observed");
            self.reported_leader = Some(holder.clone());
            if let Some(callback) = &context.callbacks.new_leader {
                callback(holder);
            }
        }
        self.observed = Some(observed);
    }

    /// Takes note of a record this candidate acquired: its term is this process's own (S13).
    fn took(&mut self, context: &Context, acquired: &Observed, one_request: bool) {
        self.own_term = Some(acquired.record.leader_transitions);
        self.unanswered = None;
        self.observe(context, acquired.clone(), one_request);
    }

    /// Passes on the answer to an acquisition of `sent` ([`Unanswered::note`]).
    fn unanswered<T>(
        &mut self,
        sent: &LeaderElectionRecord,
        answer: Result<T, LockError>,
    ) -> Result<T, LockError> {
        Unanswered::note(&mut self.unanswered, sent, answer)
    }

    /// Knows `record` for a term of this process's when it is what an acquisition whose answer
    /// did not come wrote: the candidate then takes it again as its own (with the next token)
    /// instead of waiting out its lease as another process's (S13).
    fn know_own_term(&mut self, context: &Context, record: &LeaderElectionRecord) {
        let token = record.leader_transitions;
        if self.own_term == Some(token) {
            return;
        }
        if self
            .unanswered
            .take_if(|sent| sent.wrote(record, context.identity()))
            .is_some()
        {
            tracing::info!(
                fencing_token = token,
                "an acquisition whose answer was lost had landed: taking the term as this process's"
            );
            self.own_term = Some(token);
        }
    }

    /// Forgets what the store said of the holder's lease, before an attempt asks again.
    fn forget_store_answer(&mut self) {
        self.store_expiry = None;
        self.held_in_store = false;
    }

    /// Takes note of a `Held` answer: `observed`, whose lease runs out by the store's clock in
    /// `expires_in` if it says, and that the store keeps alive if `renewed_in_store`.
    fn held(
        &mut self,
        context: &Context,
        observed: Observed,
        expires_in: Option<Duration>,
        renewed_in_store: bool,
        one_request: bool,
    ) {
        self.store_expiry =
            expires_in.map(|left| (observed.version.clone(), Instant::now() + left));
        self.held_in_store = renewed_in_store;
        self.observe(context, observed, one_request);
        // A lease the store stopped keeping alive is counted from now (S2).
        if let Some(sighting) = &mut self.sighting {
            sighting.store_keeps(renewed_in_store, Instant::now());
        }
    }

    /// True when `record` is the term this process led last: identity `me` and its token. A
    /// term of this identity with any other token was started by another process (S13).
    fn started(&self, record: &LeaderElectionRecord, me: &str) -> bool {
        self.own_term
            .is_some_and(|token| rules::is_term(record, me, token))
    }

    /// True when the sighting is of `version`.
    fn sees(&self, version: &Version) -> bool {
        self.sighting.as_ref().is_some_and(|s| s.is(version))
    }

    /// When the lease of `version` runs out by the store's clock, as its last `Held` answer
    /// said; `None` when it said nothing of that version.
    fn store_expiry(&self, version: &Version) -> Option<Instant> {
        self.store_expiry
            .as_ref()
            .filter(|(of, _)| of == version)
            .map(|&(_, at)| at)
    }

    /// True when the last record seen is another holder's (S13: also a term of this identity
    /// that this process did not start), under a lease the candidates count
    /// ([`Sighting::counted_holder`]).
    fn counts_another(&self, me: &str) -> bool {
        let (Some(observed), Some(sighting)) = (&self.observed, &self.sighting) else {
            return false;
        };
        !self.started(&observed.record, me) && sighting.counted_holder().is_some()
    }

    /// Notes that a read at `now` found the record gone under the holder last seen: true
    /// while the candidate waits that out ([`Sighting::lease_ends_at`]), said once in the log.
    fn gone_waits(&mut self, now: Instant) -> bool {
        let (Some(observed), Some(sighting)) = (&self.observed, &mut self.sighting) else {
            return false;
        };
        if !sighting.is_gone() {
            // The early wake-up is for the end of this wait now.
            self.woke_for_expiry = false;
            tracing::warn!(
                holder = %observed.record.holder_identity,
                fencing_token = observed.record.leader_transitions,
                "the record is gone under its holder, which leads on until a renewal meets \
                 that: waiting a lease before taking the election"
            );
        }
        sighting.see_gone(now);
        now < sighting.lease_ends_at(None)
    }

    /// True when `observed`'s lease ran out at `now`, on this candidate's clock (S2) or by the
    /// store's where it said of that version (S1): the store then decides an acquisition.
    fn run_out(&self, observed: &Observed, now: Instant) -> bool {
        self.sighting.as_ref().is_some_and(|s| {
            s.is(&observed.version) && now >= s.lease_ends_at(self.store_expiry(&observed.version))
        })
    }

    /// True when `observed`'s lease ran out on this candidate's clock at `now` (S2); false for
    /// a record never seen.
    fn expired(&self, observed: &Observed, now: Instant) -> bool {
        self.sighting
            .as_ref()
            .is_some_and(|s| s.expired(observed, now))
    }

    /// Until when candidate `me` stands back from `record`, whose pending handover names
    /// another candidate: one lease duration from when it first saw the request. `None` when
    /// no such request is pending.
    fn stand_back_until(&self, record: &LeaderElectionRecord, me: &str) -> Option<Instant> {
        self.sighting.as_ref()?.stand_back_until(record, me)
    }

    /// How long candidate `me` waits for its next attempt instead of `wait`: less when the
    /// observed lease (or a stand-back) runs out sooner. That early wake-up is used once per
    /// observed version and only for an instant still to come.
    fn until_expiry(&mut self, me: &str, wait: Duration) -> Duration {
        if self.woke_for_expiry {
            return wait;
        }
        let Some(observed) = &self.observed else {
            return wait;
        };
        let record = &observed.record;
        let expires = if let Some(until) = self.stand_back_until(record, me) {
            until
        } else if record.is_free() || self.started(record, me) {
            return wait;
        } else if let Some(sighting) = &self.sighting {
            sighting.lease_ends_at(self.store_expiry(&observed.version))
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

    /// S13: a lease held under this candidate's identity by a term this process did not start
    /// is another process's. Says so once when first seen, and reports a conflict once that
    /// term is seen alive: renewed in the record, or still held by the store after it would
    /// have run out. A process of this identity that died holding the lease is not a conflict:
    /// its lease runs out and this one takes over.
    fn check_identity(&mut self, context: &Context, observed: &Observed, one_request: bool) {
        let record = &observed.record;
        let me = context.identity();
        if !rules::started_elsewhere(record, me, self.own_term) {
            if self.shared_identity.take().is_some_and(|s| s.reported()) {
                status::lock(&context.shared).identity_conflict = None;
                tracing::info!("the term of the other process with this identity is over");
            }
            return;
        }
        let now = Instant::now();
        let seen = match &mut self.shared_identity {
            Some(seen) if seen.is(observed) => seen,
            _ => {
                tracing::warn!(
                    identity = me,
                    fencing_token = record.leader_transitions,
                    "the lease is held under this candidate's identity by a term this process did \
                     not start: waiting for it as for another holder (another process may run \
                     with the same identity)"
                );
                let first_expiry = self.store_expiry(&observed.version);
                self.shared_identity = Some(OtherTerm::new(observed, now, first_expiry));
                return;
            }
        };
        // Whether the store keeps leases alive without a new version, as its last answer said;
        // unknown without such answers (a store with no one-request acquisition).
        let kept = one_request.then_some(self.held_in_store);
        if !seen.seen_alive(observed, kept, context.config.lease.retry_period, now) {
            return;
        }
        let conflict = IdentityConflict {
            lock: context.lock.describe(),
            identity: me.to_owned(),
            fencing_token: record.leader_transitions,
        };
        tracing::error!(
            identity = me,
            fencing_token = record.leader_transitions,
            "{conflict}"
        );
        m::identity_conflict(&context.config.name);
        status::lock(&context.shared).identity_conflict = Some(conflict.clone());
        if let Some(callback) = &context.callbacks.error {
            callback(&ElectionError::IdentityConflict(conflict));
        }
    }
}

/// The subscription to the store's change notifications ([`ResourceLock::watch`]), made again
/// on a back-off of its own: a backend whose notifications fail must not slow down the
/// election itself, and a failure never delays an attempt.
///
/// [`ResourceLock::watch`]: crate::ResourceLock::watch
struct Subscription {
    /// The notifications. In a mutex only to keep the runner `Sync`; it is reached through
    /// `&mut` and never locked.
    changes: Option<Mutex<ChangeStream>>,
    /// False once the lock said it has no notifications.
    supported: bool,
    /// Waits between attempts to subscribe, apart from the lock's own requests.
    backoff: Backoff,
    /// No attempt to subscribe before this instant.
    retry_at: Option<Instant>,
    /// The failed attempts to subscribe, logged as one outage (S9).
    failures: FailureLog,
}

impl Subscription {
    /// No subscription yet; failed attempts wait as `backoff` says.
    fn new(backoff: Backoff) -> Self {
        Self {
            changes: None,
            supported: true,
            backoff,
            retry_at: None,
            failures: FailureLog::default(),
        }
    }

    /// Subscribes to change notifications when there is no subscription; a failure is retried
    /// on its own back-off, and never delays an attempt.
    async fn ensure(&mut self, context: &Context) {
        if self.changes.is_some() || !self.supported {
            return;
        }
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        match context.request("watch", context.lock.watch()).await {
            Ok(stream) => {
                self.supported = stream.is_some();
                self.changes = stream.map(Mutex::new);
                self.backoff.succeeded();
                self.retry_at = None;
                log_recovery(self.failures.succeeded(), "watch");
            }
            Err(err) => {
                m::error(&context.config.name, "watch", err.kind());
                self.backoff.failed();
                self.retry_at = Some(Instant::now() + self.backoff.wait());
                let line = self.failures.failed("watch", &err);
                log_failure(line, "watch", &err, self.backoff.failures());
                context.tell_error(ElectionError::Lock {
                    operation: "watch",
                    error: Arc::new(err),
                });
            }
        }
    }

    /// The next change notification: `true` when one arrived, `false` when the stream ended,
    /// which drops the subscription. Without a subscription it never completes.
    async fn changed(&mut self) -> bool {
        let Some(stream) = &mut self.changes else {
            return std::future::pending().await;
        };
        let stream = stream.get_mut().unwrap_or_else(|p| p.into_inner());
        let more = stream.next().await.is_some();
        if !more {
            self.changes = None;
        }
        more
    }
}
