//! The loop of a shard set's member: a round per retry period (renew everything it holds in one
//! batch, read the set in another, then take, give or leave shards), a timer per term (S3).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use futures_util::future::join_all;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::assign::{affinity, gifts, shares};
use super::locks::{Known, LockSet, Renewal, Reread};
use super::{
    COUNT_EXTENSION, Callbacks, MEMBER_PREFIX, ShardsConfig, ShardsError, ShardsState, member_key,
    roster_key, shard_key,
};
use crate::error::LockError;
use crate::leadership::{Leadership, StepDown, StepDownReason, TermDeadline, TermRequest};
use crate::lock::{Acquisition, ResourceLock};
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed, Version};
use crate::retry::Backoff;
use crate::status::IdentityConflict;

/// How many shards a member tries to take at once (each a request on its own record).
const CLAIMS_AT_ONCE: usize = 32;

/// The roster is no election: its `lease_duration` only tells stores that expire records (a
/// free Redis record expires after it) to keep it. Members write it again once a day.
const ROSTER_LEASE: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);
/// How old the roster's last write may grow before a member writes it again.
const ROSTER_REFRESH: chrono::TimeDelta = chrono::TimeDelta::days(1);

/// How long a shard's work must have run for its next give-up to count as a first one again
/// (Kubernetes's CrashLoopBackOff resets after as long).
const GIVE_UP_RESET: std::time::Duration = std::time::Duration::from_secs(600);
/// The longest a member waits before taking again a shard whose work gave it up (as
/// CrashLoopBackOff's cap).
const GIVE_UP_CAP: std::time::Duration = std::time::Duration::from_secs(300);

/// One term this member holds: a shard's, or its member record's.
struct Term {
    key: String,
    observed: Observed,
    /// When the term started.
    started: Instant,
    /// Moved on by each successful renewal; its timer ends the term when it passes (S3).
    deadline: watch::Sender<Instant>,
    /// The same deadline, for the leadership's readers on other threads.
    shared_deadline: TermDeadline,
    cancel: CancellationToken,
    /// The counted leadership of a shard's term (none for the member record).
    leadership: Option<Leadership>,
    requests: Option<mpsc::Receiver<TermRequest>>,
    alive: Option<mpsc::Receiver<()>>,
}

impl Term {
    fn token(&self) -> u64 {
        self.observed.record.leader_transitions
    }

    fn past_deadline(&self) -> bool {
        self.cancel.is_cancelled() || Instant::now() >= *self.deadline.borrow()
    }

    /// A renewal that started at `started` succeeded: the term lasts until `until` (or a
    /// later deadline that a renewal started after it set already).
    fn extend(&self, until: Instant) {
        let mut latest = until;
        self.deadline.send_if_modified(|deadline| {
            latest = (*deadline).max(until);
            let moved = latest != *deadline;
            *deadline = latest;
            moved
        });
        self.shared_deadline.set(latest.into_std());
    }
}

/// A term dropped without being ended ends (its timer would end it at its deadline anyway).
impl Drop for Term {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A shard whose work gave it up on this member: not taken again by this member before
/// `until` (S9 for work: a crashing work is not restarted at once, every time).
struct GaveUp {
    /// Consecutive give-ups of terms that ended soon after they started.
    backoff: Backoff,
    /// When the last give-up was.
    at: Instant,
    until: Instant,
}

/// What this member saw of a record: the follower's clock for its lease (S2), and since when
/// a handover request names someone.
struct Seen {
    version: Version,
    since: Instant,
    handover: Option<(String, Instant)>,
}

/// One acquisition attempt: its result, and what it learnt on the way.
struct Claim {
    /// The record taken and when its term starts, or `None` when not taken.
    result: Result<Option<(Observed, Instant)>, LockError>,
    /// The record the store showed as held by another.
    held: Option<Observed>,
    /// The store has no one-request acquisition.
    no_try_acquire: bool,
}

/// One read of the set.
struct View {
    roster: Option<Observed>,
    members: HashMap<String, Option<Observed>>,
    /// Whether every shard was read (into [`Runner::shard_records`]).
    shards: bool,
}

pub(crate) struct Runner {
    config: ShardsConfig,
    set: Arc<dyn LockSet>,
    me: String,
    callbacks: Callbacks,
    state: watch::Sender<ShardsState>,
    owned: BTreeMap<u32, Term>,
    member: Option<Term>,
    /// The member record's term this process started, if any (S13).
    member_token: Option<u64>,
    conflict: Option<(u64, Version, bool)>,
    seen: HashMap<String, Seen>,
    /// Members named by the last roster read: identity by member key.
    roster_members: BTreeMap<String, String>,
    try_acquire_supported: bool,
    /// Whether the store renews leases without a new version, learned from this member's own
    /// first renewal: then a member record's unchanged version says nothing of its age.
    renews_in_store: Option<bool>,
    backoff: Backoff,
    next_attempt: Instant,
    problem: Option<ShardsError>,
    /// The members alive as last read.
    live: usize,
    /// The most shards a live member owns less the fewest, as last read.
    imbalance: usize,
    /// When each other member's record was last found alive by the store's own word, where
    /// renewals leave the record as it is (see [`Runner::probe`]).
    probed: HashMap<String, Instant>,
    releases: JoinSet<u32>,
    /// The shards whose work gave them up, while this member waits before taking them again.
    gave_up: BTreeMap<u32, GaveUp>,
    /// The shards given up whose release is under way, or whose term ended while its work
    /// still runs, with the task that waits for it: neither this member's nor to take again
    /// until it ends, though their records still name this member.
    releasing: BTreeMap<u32, tokio::task::Id>,
    /// The key of each shard, made once.
    shard_keys: Vec<String>,
    /// What every shard's key begins with.
    shard_prefix: String,
    /// What this member saw of each shard (of other records: `seen`).
    shard_seen: Vec<Option<Seen>>,
    /// Each shard's record as the last read of every shard found it: a read passes their
    /// versions, and the store need not send a record still at its version again.
    shard_records: Vec<Option<Observed>>,
    /// Whether each shard was read yet (an absent record is known only then).
    shard_read: Vec<bool>,
    /// What a read asks for: the roster, the members it names, every shard; made again only
    /// when the roster's members change.
    read_keys: Vec<String>,
    /// Whether the shards owned changed since the state was last published.
    owned_changed: bool,
    /// True while the last read of every shard found nothing to do, here or anywhere (see
    /// [`Runner::act`]), and nothing changed since: rounds read the roster and the members
    /// alone, and the shards once per half a lease.
    settled: bool,
    /// The live members as of the last read of every shard.
    settled_live: BTreeSet<String>,
    /// When the shards must be read again, settled or not.
    full_read_due: Instant,
}

impl Runner {
    pub(crate) fn new(
        config: ShardsConfig,
        set: Arc<dyn LockSet>,
        callbacks: Callbacks,
        state: watch::Sender<ShardsState>,
    ) -> Self {
        let me = set.identity().to_owned();
        let backoff = Backoff::new(config.retry_period, 0.2, config.lease_duration);
        let shard_keys: Vec<String> = (0..config.count)
            .map(|s| shard_key(&config.name, s))
            .collect();
        // The key of shard 0 less its number.
        let mut shard_prefix = shard_key(&config.name, 0);
        shard_prefix.pop();
        let mut read_keys = Vec::with_capacity(shard_keys.len() + 1);
        read_keys.push(roster_key(&config.name));
        read_keys.extend(shard_keys.iter().cloned());
        Self {
            config,
            set,
            me,
            callbacks,
            state,
            owned: BTreeMap::new(),
            member: None,
            member_token: None,
            conflict: None,
            seen: HashMap::new(),
            roster_members: BTreeMap::new(),
            try_acquire_supported: true,
            renews_in_store: None,
            backoff,
            next_attempt: Instant::now(),
            problem: None,
            live: 0,
            imbalance: 0,
            probed: HashMap::new(),
            releases: JoinSet::new(),
            releasing: BTreeMap::new(),
            gave_up: BTreeMap::new(),
            shard_prefix,
            shard_seen: std::iter::repeat_with(|| None)
                .take(shard_keys.len())
                .collect(),
            shard_records: std::iter::repeat_with(|| None)
                .take(shard_keys.len())
                .collect(),
            shard_read: vec![false; shard_keys.len()],
            shard_keys,
            read_keys,
            owned_changed: true,
            settled: false,
            settled_live: BTreeSet::new(),
            full_read_due: Instant::now(),
        }
    }

    pub(crate) async fn run(mut self, shutdown: CancellationToken) -> Result<(), ShardsError> {
        let name = self.config.name.clone();
        tracing::info!(
            shards = name,
            count = self.config.count,
            identity = self.me,
            "joining the shard set"
        );
        let mut result = Ok(());
        // Renewals keep their pace, a retry period apart; reads and acquisitions back off
        // while the store fails (S9).
        let mut round = tokio::time::interval(self.config.retry_period);
        round.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                _ = round.tick() => {}
            }
            self.serve_requests().await;
            if Instant::now() >= self.next_attempt {
                let full = !self.settled || Instant::now() >= self.full_read_due;
                // A read of the roster and the members goes with the renewals, in one request
                // where the store allows it; a read of every shard only after them, so that
                // the renewals never wait for its answer (a round's terms are extended only
                // once its renewals' answer is in).
                if full {
                    self.renew().await;
                }
                let mut step = self.read_and_act(full, !full).await;
                // A change seen in a read of the members alone: read the shards at once.
                if matches!(step, Ok(true)) && !full && !self.settled {
                    step = self.read_and_act(true, false).await;
                }
                if let Err(err) = step {
                    // The caller says so (the `leader` command in one line).
                    result = Err(err);
                    break;
                }
            } else {
                self.renew().await;
            }
            self.publish(false);
        }
        self.leave().await;
        self.publish(true);
        result
    }

    /// A read of the set (`full`: with every shard), after this round's renewals when `renew`
    /// says so, and what follows from it. False when the read failed (reported, and the next
    /// one backs off).
    async fn read_and_act(&mut self, full: bool, renew: bool) -> Result<bool, ShardsError> {
        match self.read(full, renew).await {
            Ok(view) => {
                self.backoff.succeeded();
                self.next_attempt = Instant::now();
                self.act(view).await?;
                Ok(true)
            }
            Err(err) => {
                self.backoff.failed();
                self.next_attempt = Instant::now() + self.backoff.wait();
                self.report("read", &err);
                Ok(false)
            }
        }
    }

    fn report(&self, operation: &'static str, err: &LockError) {
        m::error(&self.config.name, operation, err.kind());
        tracing::warn!(shards = self.config.name, operation, error = %err, "shard set request failed");
    }

    async fn request<T>(
        &self,
        operation: &'static str,
        key: &str,
        request: impl std::future::Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        match tokio::time::timeout(self.config.request_timeout, request).await {
            Ok(result) => result,
            Err(_) => Err(LockError::Timeout {
                lock: format!("{} {key}", self.set.describe()),
                operation,
                after: self.config.request_timeout,
            }),
        }
    }

    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.set.lock(key)
    }

    /// Notes a record read or written: the follower's clock for its lease starts when a
    /// version is first seen (S2).
    fn observe(&mut self, key: &str, observed: Option<&Observed>) {
        if let Some(shard) = self.shard_index(key) {
            note(&mut self.shard_seen[shard], observed);
            return;
        }
        let Some(observed) = observed else {
            self.seen.remove(key);
            return;
        };
        // Most keys are known: look them up without making a key.
        if let Some(seen) = self.seen.get_mut(key) {
            note_seen(seen, observed);
        } else {
            let mut slot = None;
            note(&mut slot, Some(observed));
            self.seen.extend(slot.map(|seen| (key.to_owned(), seen)));
        }
    }

    /// The shard whose key is `key`, if it is one of this set's shards.
    fn shard_index(&self, key: &str) -> Option<usize> {
        let index: usize = key.strip_prefix(&self.shard_prefix)?.parse().ok()?;
        (self.shard_keys.get(index)? == key).then_some(index)
    }

    /// What this member saw of record `key`.
    fn seen(&self, key: &str) -> Option<&Seen> {
        match self.shard_index(key) {
            Some(shard) => self.shard_seen[shard].as_ref(),
            None => self.seen.get(key),
        }
    }

    /// True when `observed` has stayed unchanged for its lease since this member first saw it.
    fn expired(&self, key: &str, observed: &Observed) -> bool {
        self.seen(key).is_some_and(|seen| {
            seen.version == observed.version
                && Instant::now() >= seen.since + observed.record.lease_duration
        })
    }

    /// True while a handover request names another member and this one stands back from it
    /// (a request naming another candidate than the one seen is new: it is stood back from).
    fn standing_back(&self, key: &str, record: &LeaderElectionRecord) -> bool {
        record.reserved_for_other_than(&self.me)
            && self
                .seen(key)
                .and_then(|s| s.handover.as_ref())
                .filter(|(to, _)| record.handover_to() == Some(to.as_str()))
                .is_none_or(|(_, since)| Instant::now() < *since + record.lease_duration)
    }

    fn desired(&self, token: u64, base: Option<&LeaderElectionRecord>) -> LeaderElectionRecord {
        let now = self.config.wall_clock.now();
        LeaderElectionRecord {
            holder_identity: self.me.clone(),
            lease_duration: self.config.lease_duration,
            acquire_time: now,
            renew_time: now,
            leader_transitions: token,
            strategy: base.and_then(|r| r.strategy.clone()),
            preferred_holder: None,
            extensions: base.map(|r| r.extensions.clone()).unwrap_or_default(),
        }
    }

    /// One acquisition attempt of `key`, whose last read is `current`: the store's clock where
    /// it has one, else the follower's (S2). Many run at once (each on its own record), so it
    /// changes nothing here: [`Runner::note_claim`] notes what it learnt.
    async fn claim(&self, key: &str, mut current: Option<Observed>) -> Claim {
        let mut claim = Claim {
            result: Ok(None),
            held: None,
            no_try_acquire: false,
        };
        let lock = self.lock(key);
        let started = Instant::now();
        if self.try_acquire_supported {
            let desired = self.desired(0, current.as_ref().map(|o| &o.record));
            match self
                .request("try_acquire", key, lock.try_acquire(&desired))
                .await
            {
                Err(err) => claim.result = Err(err),
                Ok(Some(Acquisition::Acquired(observed))) => {
                    claim.result = Ok(Some((observed, started)));
                }
                Ok(Some(Acquisition::Handed {
                    observed,
                    alive_since,
                })) => claim.result = Ok(Some((observed, alive_since.min(started)))),
                Ok(Some(Acquisition::Held {
                    observed,
                    renewed_in_store,
                    ..
                })) => {
                    claim.held = Some(observed.clone());
                    if !renewed_in_store {
                        current = Some(observed);
                        claim.result = self.claim_by_update(key, &lock, current, started).await;
                    }
                }
                Ok(Some(Acquisition::Unassigned(_))) => {}
                Ok(None) => {
                    claim.no_try_acquire = true;
                    claim.result = self.claim_by_update(key, &lock, current, started).await;
                }
            }
            return claim;
        }
        claim.result = self.claim_by_update(key, &lock, current, started).await;
        claim
    }

    /// An acquisition by compare-and-swap on the record as read: taken only when free or seen
    /// unchanged for its lease by this member's clock (S2), with the next token (S5). What the
    /// store showed of `key` in this attempt is already in `current` (a version this member
    /// had not seen is not expired, as it would not be once noted).
    async fn claim_by_update(
        &self,
        key: &str,
        lock: &Arc<dyn ResourceLock>,
        current: Option<Observed>,
        started: Instant,
    ) -> Result<Option<(Observed, Instant)>, LockError> {
        let Some(current) = current else {
            let created = self
                .request("create", key, lock.create(&self.desired(1, None)))
                .await?;
            return Ok(Some((created, started)));
        };
        let record = &current.record;
        if (!record.is_free() && !self.expired(key, &current)) || self.standing_back(key, record) {
            return Ok(None);
        }
        // S5: every acquisition gets the next token.
        let desired = self.desired(record.leader_transitions + 1, Some(record));
        let stored = self
            .request("update", key, lock.update(&current.version, &desired))
            .await?;
        Ok(Some((stored, started)))
    }

    /// Notes what an acquisition attempt of `key` learnt: the record the store showed, whether
    /// the store has a one-request acquisition, and the record taken. Returns the attempt's
    /// result.
    fn note_claim(
        &mut self,
        key: &str,
        claim: Claim,
    ) -> Result<Option<(Observed, Instant)>, LockError> {
        if claim.no_try_acquire {
            self.try_acquire_supported = false;
        }
        if let Some(held) = &claim.held {
            self.observe(key, Some(held));
        }
        if let Ok(Some((observed, _))) = &claim.result {
            self.observe(key, Some(observed));
        }
        claim.result
    }

    /// A term that starts now: its timer, and for a shard its leadership.
    fn start_term(
        &self,
        key: String,
        shard: Option<u32>,
        observed: Observed,
        started: Instant,
    ) -> Term {
        let cancel = CancellationToken::new();
        let (deadline, until) = watch::channel(started + self.config.renew_deadline);
        let shared_deadline = TermDeadline::new((started + self.config.renew_deadline).into_std());
        end_at_deadline(cancel.clone(), until);
        let (leadership, requests, alive) = match shard {
            Some(shard) => {
                let (leadership, requests, alive) = Leadership::new(
                    format!("{}/{shard}", self.config.name),
                    self.me.clone(),
                    observed.record.leader_transitions,
                    cancel.clone(),
                    observed.record.extensions.clone(),
                    shared_deadline.clone(),
                    self.config.wall_clock.now(),
                );
                (Some(leadership), Some(requests), Some(alive))
            }
            None => (None, None, None),
        };
        Term {
            key,
            observed,
            started,
            deadline,
            shared_deadline,
            cancel,
            leadership,
            requests,
            alive,
        }
    }

    /// Renews the member record and every shard in one batch (see [`renewed`](Self::renewed)).
    async fn renew(&mut self) {
        let (renewals, whose) = self.renewals();
        if renewals.is_empty() {
            return;
        }
        let started = Instant::now();
        match tokio::time::timeout(self.config.request_timeout, self.set.renew_many(&renewals))
            .await
        {
            Ok(results) => self.renewed(whose, results, started).await,
            Err(_) => self.renew_timed_out(),
        }
    }

    fn renew_timed_out(&self) {
        let err = LockError::Timeout {
            lock: self.set.describe(),
            operation: "renew",
            after: self.config.request_timeout,
        };
        self.report("renew", &err);
    }

    /// This round's renewals of the member record and every shard, and whose each is (`None`:
    /// the member record's), once the terms past their deadline have ended.
    fn renewals(&mut self) -> (Vec<Renewal>, Vec<Option<u32>>) {
        self.drop_expired();
        let mut renewals = Vec::new();
        let mut whose = Vec::new();
        let terms = self.member.iter().map(|t| (None, t));
        for (shard, term) in terms.chain(self.owned.iter().map(|(&s, t)| (Some(s), t))) {
            whose.push(shard);
            renewals.push(self.renewal_of(term));
        }
        (renewals, whose)
    }

    /// The renewal of `term` from the record it last saw.
    fn renewal_of(&self, term: &Term) -> Renewal {
        let mut record = term.observed.record.clone();
        record.renew_time = record.renewal_time(self.config.wall_clock.now());
        Renewal {
            key: term.key.clone(),
            version: term.observed.version.clone(),
            record,
        }
    }

    /// The term of `whose`: a shard's, or (`None`) the member record's.
    fn term(&self, whose: Option<u32>) -> Option<&Term> {
        match whose {
            Some(shard) => self.owned.get(&shard),
            None => self.member.as_ref(),
        }
    }

    /// The term of `whose`, to change.
    fn term_mut(&mut self, whose: Option<u32>) -> Option<&mut Term> {
        match whose {
            Some(shard) => self.owned.get_mut(&shard),
            None => self.member.as_mut(),
        }
    }

    /// Takes the answers of the renewals sent at `started`; one whose deadline passed
    /// meanwhile is not extended (S3). The terms whose renewal conflicted are read again and,
    /// when still this member's, renewed at once (see [`reread`](Self::reread)).
    async fn renewed(
        &mut self,
        whose: Vec<Option<u32>>,
        results: Vec<Result<Observed, LockError>>,
        started: Instant,
    ) {
        let conflicts = self.take_renewals(whose, results, started);
        if !conflicts.is_empty() {
            let again = self.reread(conflicts).await;
            if !again.is_empty() {
                let (whose, renewals): (Vec<_>, Vec<_>) = again.into_iter().unzip();
                let started = Instant::now();
                match tokio::time::timeout(
                    self.config.request_timeout,
                    self.set.renew_many(&renewals),
                )
                .await
                {
                    Ok(results) => {
                        for whose in self.take_renewals(whose, results, started) {
                            self.lose(whose);
                        }
                    }
                    Err(_) => self.renew_timed_out(),
                }
            }
        }
        self.drop_expired();
    }

    /// Reads the records of the terms whose renewal conflicted before declaring any lost: a
    /// renewal that timed out may have reached the store, and then the record moved on under
    /// this very term (as the elector's slow path does). A record that still names this
    /// member with the term's token is still the term's: its version is adopted, and the term
    /// returned with its renewal to send at once (a shard whose record asks for a handover is
    /// handed over instead). The others are lost. Should the read fail, the terms go on until a
    /// renewal succeeds or their deadline passes (S3), as after any failed renewal.
    async fn reread(&mut self, conflicts: Vec<Option<u32>>) -> Vec<(Option<u32>, Renewal)> {
        m::slow_path(&self.config.name);
        let mut terms = Vec::with_capacity(conflicts.len());
        for whose in conflicts {
            if let Some(term) = self.term_mut(whose).filter(|t| !t.past_deadline()) {
                let key = term.key.clone();
                terms.push((whose, key));
            }
        }
        let keys: Vec<String> = terms.iter().map(|(_, key)| key.clone()).collect();
        let answers =
            match tokio::time::timeout(self.config.request_timeout, self.set.get_many(&keys)).await
            {
                Ok(answers) if answers.len() == keys.len() => answers,
                Ok(_) => {
                    let err = LockError::unavailable(
                        "shards",
                        format!(
                            "{}: a batch read answered another number of keys",
                            self.set.describe()
                        ),
                    );
                    self.report("get", &err);
                    return Vec::new();
                }
                Err(_) => {
                    let err = LockError::Timeout {
                        lock: self.set.describe(),
                        operation: "get",
                        after: self.config.request_timeout,
                    };
                    self.report("get", &err);
                    return Vec::new();
                }
            };
        let mut again = Vec::new();
        for ((whose, key), answer) in terms.into_iter().zip(answers) {
            let current = match answer {
                Ok(current) => current,
                Err(err) => {
                    self.report("get", &err);
                    continue;
                }
            };
            self.observe(&key, current.as_ref());
            let me = self.me.clone();
            let Some(term) = self.term_mut(whose) else {
                continue;
            };
            let Some(current) = current.filter(|c| {
                c.record.is_held_by(&me) && c.record.leader_transitions == term.token()
            }) else {
                self.lose(whose);
                continue;
            };
            let handover = current
                .record
                .handover_to()
                .filter(|to| *to != me)
                .map(str::to_owned);
            term.observed = current;
            match (whose, handover) {
                (Some(shard), Some(to)) => self.give(shard, Some(&to), StepDownReason::HandedOver),
                _ => {
                    if let Some(term) = self.term(whose) {
                        again.push((whose, self.renewal_of(term)));
                    }
                }
            }
        }
        again
    }

    /// Ends the term of `whose` (a shard's, or the member record's): its record is another's.
    fn lose(&mut self, whose: Option<u32>) {
        let Some(term) = self.term(whose) else {
            return;
        };
        term.cancel.cancel();
        tracing::warn!(
            shards = self.config.name,
            key = term.key,
            "lost: the record is no longer this member's"
        );
        match whose {
            Some(shard) => self.end(shard, StepDownReason::Lost),
            None => self.member = None,
        }
    }

    /// Takes the answers of the renewals sent at `started`: a term renewed is extended unless
    /// its deadline passed meanwhile (S3). Returns the terms whose renewal conflicted.
    fn take_renewals(
        &mut self,
        whose: Vec<Option<u32>>,
        results: Vec<Result<Observed, LockError>>,
        started: Instant,
    ) -> Vec<Option<u32>> {
        let took = started.elapsed();
        let mut failed = None;
        let mut renewed = 0usize;
        let mut conflicts = Vec::new();
        let renew_deadline = self.config.renew_deadline;
        for (shard, result) in whose.into_iter().zip(results) {
            let learn = shard.is_none() && self.renews_in_store.is_none();
            let Some(term) = self.term_mut(shard) else {
                continue;
            };
            if term.past_deadline() {
                continue;
            }
            match result {
                Ok(stored) => {
                    let kept_version = stored.version == term.observed.version;
                    term.observed = stored;
                    term.extend(started + renew_deadline);
                    renewed += 1;
                    if learn {
                        self.renews_in_store = Some(kept_version);
                    }
                }
                Err(err) if err.is_conflict() => conflicts.push(shard),
                Err(err) => failed = Some(err),
            }
        }
        if renewed > 0 {
            m::renewed(&self.config.name, took);
        }
        if let Some(err) = failed {
            self.report("renew", &err);
        }
        conflicts
    }

    /// Ends the terms whose deadline passed (their timers have cancelled them already, or do
    /// so now).
    fn drop_expired(&mut self) {
        let expired: Vec<u32> = self
            .owned
            .iter()
            .filter(|(_, t)| t.past_deadline())
            .map(|(&s, _)| s)
            .collect();
        for shard in expired {
            tracing::warn!(
                shards = self.config.name,
                shard,
                "renew deadline passed: the shard's term ends"
            );
            self.end(shard, StepDownReason::RenewDeadlineExceeded);
        }
        if self.member.as_ref().is_some_and(Term::past_deadline) {
            self.member = None;
        }
    }

    /// Ends the term of `shard` without releasing it. Until its work has stopped, the shard is
    /// kept out as a release under way is: its record may still name this member (on a store
    /// whose leases outlive a term, such as a member's one etcd lease, for as long as the
    /// member lives), and taking it again then would start its work a second time beside the
    /// first.
    fn end(&mut self, shard: u32, reason: StepDownReason) {
        if let Some(mut term) = self.owned.remove(&shard) {
            self.owned_changed = true;
            self.settled = false;
            term.cancel.cancel();
            m::shard_moved(&self.config.name, reason_label(reason));
            let stopped = self.callbacks.stopped.as_ref();
            tell_stopped(stopped, shard, term.token(), reason, false);
            if let Some(mut alive) = term.alive.take() {
                drop(term);
                let task = self.releases.spawn(async move {
                    let _ = alive.recv().await;
                    shard
                });
                self.releasing.insert(shard, task.id());
            }
        }
    }

    /// Ends the term of `shard` and releases it once its work has stopped (S6), naming `to` as
    /// the next owner when given (S10); in the background, so renewals keep their pace.
    fn give(&mut self, shard: u32, to: Option<&str>, reason: StepDownReason) {
        let Some(mut term) = self.owned.remove(&shard) else {
            return;
        };
        self.owned_changed = true;
        self.settled = false;
        term.cancel.cancel();
        let lock = self.lock(&term.key);
        let grace = self.config.stop_grace;
        let timeout = self.config.request_timeout;
        let stopped = self.callbacks.stopped.clone();
        let to = to.map(str::to_owned);
        let name = self.config.name.clone();
        let clock = self.config.wall_clock.clone();
        m::shard_moved(&name, reason_label(reason));
        tracing::info!(shards = name, shard, to, "releasing the shard");
        let task = self.releases.spawn(async move {
            let fencing_token = term.token();
            drop(term.leadership.take());
            let work_stopped = match term.alive.as_mut() {
                Some(alive) => tokio::time::timeout(grace, alive.recv()).await.is_ok(),
                None => true,
            };
            let mut released = false;
            if work_stopped {
                let now = clock.now();
                let record = LeaderElectionRecord {
                    holder_identity: String::new(),
                    acquire_time: now,
                    renew_time: now,
                    preferred_holder: to,
                    ..term.observed.record.clone()
                };
                released =
                    tokio::time::timeout(timeout, lock.update(&term.observed.version, &record))
                        .await
                        .is_ok_and(|r| r.is_ok());
            } else {
                tracing::warn!(
                    shards = name,
                    shard,
                    "the shard's work did not stop in time: leaving the shard to expire"
                );
            }
            tell_stopped(stopped.as_ref(), shard, fencing_token, reason, released);
            // This member takes the shard again only once the work has stopped.
            if let Some(alive) = term.alive.as_mut().filter(|_| !work_stopped) {
                let _ = alive.recv().await;
            }
            shard
        });
        self.releasing.insert(shard, task.id());
    }

    /// Forgets the releases that ended: their shards are read as anyone's again.
    fn reap_releases(&mut self) {
        while let Some(ended) = self.releases.try_join_next() {
            match ended {
                Ok(shard) => {
                    self.releasing.remove(&shard);
                }
                Err(err) => self.releasing.retain(|_, task| *task != err.id()),
            }
        }
    }

    /// The requests of shards' work: a step-down, a handover, extensions to write.
    async fn serve_requests(&mut self) {
        let mut asked = Vec::new();
        for (&shard, term) in &mut self.owned {
            if let Some(requests) = term.requests.as_mut() {
                while let Ok(request) = requests.try_recv() {
                    asked.push((shard, request));
                }
            }
        }
        for (shard, request) in asked {
            match request {
                TermRequest::StepDown => {
                    self.back_off(shard);
                    self.give(shard, None, StepDownReason::SteppedDown);
                }
                TermRequest::HandOver(to) => {
                    self.give(shard, Some(&to), StepDownReason::HandedOver)
                }
                TermRequest::SetExtensions { changes, reply } => {
                    let answer = self.write_extensions(shard, &changes).await;
                    let _ = reply.send(answer);
                }
            }
        }
    }

    /// The work of `shard` gave it up: this member takes it again only after a back-off, the
    /// jittered retry period at first, doubling with each give-up that follows the last one
    /// within [`GIVE_UP_RESET`] (unless the term ran that long), up to [`GIVE_UP_CAP`].
    fn back_off(&mut self, shard: u32) {
        let Some(term) = self.owned.get(&shard) else {
            return;
        };
        let now = Instant::now();
        let ran = now - term.started;
        let retry = self.config.retry_period;
        let gave_up = self.gave_up.entry(shard).or_insert_with(|| GaveUp {
            backoff: Backoff::new(retry, 0.2, GIVE_UP_CAP),
            at: now,
            until: now,
        });
        if ran >= GIVE_UP_RESET || now >= gave_up.at + GIVE_UP_RESET {
            gave_up.backoff.succeeded();
        }
        gave_up.backoff.failed();
        let wait = gave_up.backoff.wait();
        gave_up.at = now;
        gave_up.until = now + wait;
        tracing::warn!(
            shards = self.config.name,
            shard,
            times = gave_up.backoff.failures(),
            ran = ?ran,
            after = ?wait,
            "the shard's work gave it up: taking it again after a back-off"
        );
    }

    /// True while this member waits before taking `shard` again (see [`Runner::back_off`]).
    fn backing_off(&self, shard: u32) -> bool {
        self.gave_up
            .get(&shard)
            .is_some_and(|g| Instant::now() < g.until)
    }

    async fn write_extensions(
        &mut self,
        shard: u32,
        changes: &crate::leadership::ExtensionChanges,
    ) -> Result<(), crate::leadership::ExtensionError> {
        use crate::leadership::{ExtensionError, LeadershipLost};
        let Some(term) = self.owned.get(&shard) else {
            return Err(ExtensionError::Lost(LeadershipLost { fencing_token: 0 }));
        };
        let lost = LeadershipLost {
            fencing_token: term.token(),
        };
        let mut record = term.observed.record.clone();
        changes.apply(&mut record.extensions);
        record.renew_time = record.renewal_time(self.config.wall_clock.now());
        let (key, version) = (term.key.clone(), term.observed.version.clone());
        let started = Instant::now();
        let result = self
            .request("update", &key, self.lock(&key).update(&version, &record))
            .await;
        let Some(term) = self.owned.get_mut(&shard).filter(|t| !t.past_deadline()) else {
            return Err(lost.into());
        };
        match result {
            Ok(stored) => {
                if let Some(leadership) = &term.leadership {
                    *leadership
                        .extensions_handle()
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = stored.record.extensions.clone();
                }
                term.observed = stored;
                term.extend(started + self.config.renew_deadline);
                Ok(())
            }
            Err(err) if err.is_conflict() => {
                self.end(shard, StepDownReason::Lost);
                Err(lost.into())
            }
            Err(err) => Err(ExtensionError::Lock(Arc::new(err))),
        }
    }

    /// Reads the roster, the member records it named last time and (`full`) every shard, in
    /// one batch; the shards with the versions last read, so that the store may answer those
    /// unchanged without sending them ([`LockSet::get_changed`]). With `renew`, this round's
    /// renewals go first, in the same request where the store allows it
    /// ([`LockSet::renew_and_read`]).
    async fn read(&mut self, full: bool, renew: bool) -> Result<View, LockError> {
        let (renewals, whose) = if renew {
            self.renewals()
        } else {
            Default::default()
        };
        let keys = std::mem::take(&mut self.read_keys);
        if self.shard_records.len() != self.shard_keys.len() {
            // A round dropped while it acted (see `act`) took them along: read them all again.
            self.shard_records = std::iter::repeat_with(|| None)
                .take(self.shard_keys.len())
                .collect();
            self.shard_read.fill(false);
        }
        let first_shard = 1 + self.roster_members.len();
        let asked = if full {
            &keys[..]
        } else {
            &keys[..first_shard]
        };
        let known: Vec<Known<'_>> = std::iter::repeat_n(Known::Nothing, first_shard)
            .chain(
                self.shard_records
                    .iter()
                    .zip(&self.shard_read)
                    .map(|(record, &read)| match record {
                        _ if !read => Known::Nothing,
                        None => Known::Absent,
                        Some(observed) => Known::Version(&observed.version),
                    })
                    .take(asked.len() - first_shard),
            )
            .collect();
        let started = Instant::now();
        let results = if renewals.is_empty() {
            tokio::time::timeout(
                self.config.request_timeout,
                self.set.get_changed(asked, &known),
            )
            .await
        } else {
            let answer = tokio::time::timeout(
                self.config.request_timeout,
                self.set.renew_and_read(&renewals, asked, &known),
            )
            .await;
            drop(known);
            match answer {
                Ok(answer) => {
                    self.renewed(whose, answer.renewed, started).await;
                    Ok(answer.read)
                }
                Err(elapsed) => {
                    self.renew_timed_out();
                    Err(elapsed)
                }
            }
        };
        let results = match results {
            Ok(results) if results.len() == asked.len() => results,
            Ok(_) => {
                self.read_keys = keys;
                return Err(LockError::unavailable(
                    "shards",
                    format!(
                        "{}: a batch read answered another number of keys",
                        self.set.describe()
                    ),
                ));
            }
            Err(_) => {
                self.read_keys = keys;
                return Err(LockError::Timeout {
                    lock: self.set.describe(),
                    operation: "get",
                    after: self.config.request_timeout,
                });
            }
        };
        let mut head = Vec::with_capacity(first_shard);
        let mut failed = None;
        for (i, (key, result)) in asked.iter().zip(results).enumerate() {
            let answer = match result {
                Ok(answer) => answer,
                Err(err) => {
                    failed = Some(err);
                    break;
                }
            };
            match i.checked_sub(first_shard) {
                // The shards come in order, after the roster and the members.
                Some(shard) => {
                    if let Reread::Now(observed) = answer {
                        self.shard_records[shard] = observed;
                    }
                    self.shard_read[shard] = true;
                    note(
                        &mut self.shard_seen[shard],
                        self.shard_records[shard].as_ref(),
                    );
                }
                None => {
                    let observed = match answer {
                        Reread::Now(observed) => observed,
                        // Never asked with a version: a store that says so anyway is read
                        // again next round.
                        Reread::Same => {
                            failed = Some(LockError::unavailable(
                                "shards",
                                format!(
                                    "{}: {key} answered unchanged unasked",
                                    self.set.describe()
                                ),
                            ));
                            break;
                        }
                    };
                    self.observe(key, observed.as_ref());
                    head.push(observed);
                }
            }
        }
        self.read_keys = keys;
        if let Some(err) = failed {
            return Err(err);
        }
        let mut head = head.into_iter();
        let roster = head.next().flatten();
        let members = self.roster_members.values().cloned().zip(head).collect();
        Ok(View {
            roster,
            members,
            shards: full,
        })
    }

    /// Acts on a read: the roster, this member's record, then the shares.
    async fn act(&mut self, view: View) -> Result<(), ShardsError> {
        let Some(roster) = self.check_roster(view.roster).await? else {
            self.settled = false;
            return Ok(());
        };
        self.hold_member_record(view.members.get(&self.me).cloned().flatten())
            .await;
        let dead = self.probe(&view.members).await;
        let mut live = self.live_members(&view.members);
        live.retain(|m| !dead.contains(m));
        self.live = live.len();
        self.prune(&roster, &view.members, &live).await;
        if self.member.is_none() {
            self.settled = false;
            return Ok(());
        }
        self.reap_releases();
        if !view.shards {
            // A member that died is seen by its record (read every round); its shards' last
            // versions by the next full read, half a lease at most after its last renewal.
            if live != self.settled_live {
                self.settled = false;
            }
            return Ok(());
        }
        // Out of `self` while this round acts on it (put back below; nothing returns early).
        let view_shards = std::mem::take(&mut self.shard_records);
        let count = self.config.count;
        let mut owners: BTreeMap<String, Vec<u32>> =
            live.iter().map(|m| (m.clone(), Vec::new())).collect();
        // One pass over the shards sorts them out: a live member's; this member's though it
        // holds no term of them (lapsed: a term that ended by its deadline, say; the others
        // count them as this member's, so it does too, and takes them again, since nobody else
        // would: once their lease has run out, or at once where the lease is this member's
        // own); or open (absent, free, or held by a member not alive), which this member may
        // take. A shard this member gave up, or whose term ended, is none of these until its
        // release ends or its work stopped: counted as lapsed, it would be given or taken
        // again beside the work still running. A shard whose work gave it up here is not taken
        // again before its back-off ends (held back, if its record still names this member).
        let now = Instant::now();
        self.gave_up.retain(|_, g| now < g.at + GIVE_UP_RESET);
        let mut lapsed: Vec<u32> = Vec::new();
        let mut held_back: Vec<u32> = Vec::new();
        let mut open: Vec<u32> = Vec::new();
        for (shard, observed) in (0..count).zip(&view_shards) {
            if self.owned.contains_key(&shard) || self.releasing.contains_key(&shard) {
                continue;
            }
            let holder = observed
                .as_ref()
                .map(|o| o.record.holder_identity.as_str())
                .filter(|h| !h.is_empty());
            let backing_off = self.backing_off(shard);
            match holder {
                Some(holder) if holder == self.me && backing_off => held_back.push(shard),
                Some(holder) if holder == self.me => lapsed.push(shard),
                Some(holder) => match owners.get_mut(holder) {
                    Some(list) => list.push(shard),
                    None if backing_off => {}
                    None => open.push(shard),
                },
                None if backing_off => {}
                None => open.push(shard),
            }
        }
        let mine = self.owned.keys().chain(&lapsed).chain(&held_back).copied();
        owners.insert(self.me.clone(), mine.collect());
        let counts = owners.iter().map(|(m, s)| (m.clone(), s.len())).collect();
        let shares = shares(count, &counts);
        let counts = owners.values().map(Vec::len);
        self.imbalance = counts.clone().max().unwrap_or(0) - counts.min().unwrap_or(0);
        // Only a shard this member holds a term of can be handed over (its work stopped, then
        // its record released to the receiver). A lapsed shard counts towards this member's
        // surplus but is retaken first, and given in a later round if still surplus.
        let mut gifts = gifts(&self.me, &owners, &shares);
        gifts.retain(|(shard, _)| self.owned.contains_key(shard));
        let share = shares.get(&self.me).copied().unwrap_or(0);
        // Distinct shards, all owned: no more gifts than shards owned.
        let kept = self.owned.len() - gifts.len() + lapsed.len() + held_back.len();
        let room = share.saturating_sub(kept);
        // Nothing to do, here or (as far as this read shows) anywhere: every shard owned by a
        // live member, within one of each other. Until the members or this member's shards
        // change, the next rounds read the roster and the members alone.
        let idle = gifts.is_empty()
            && room == 0
            && lapsed.is_empty()
            && open.is_empty()
            && self.releasing.is_empty()
            && !self.gave_up.values().any(|g| now < g.until);
        self.settled = idle && self.imbalance <= 1;
        self.settled_live = live;
        self.full_read_due = Instant::now() + self.config.lease_duration / 2;
        for (shard, to) in gifts {
            self.give(shard, Some(&to), StepDownReason::HandedOver);
        }
        self.take(room, &lapsed, &open, &view_shards).await;
        self.shard_records = view_shards;
        Ok(())
    }

    /// Checks the roster (creates it, or joins it): the roster when this member may go on.
    async fn check_roster(
        &mut self,
        roster: Option<Observed>,
    ) -> Result<Option<Observed>, ShardsError> {
        let name = self.config.name.clone();
        let key = roster_key(&name);
        let my_entry = format!("{MEMBER_PREFIX}{}", member_key(&name, &self.me));
        let Some(roster) = roster else {
            let mut record = LeaderElectionRecord {
                holder_identity: String::new(),
                lease_duration: ROSTER_LEASE,
                acquire_time: self.config.wall_clock.now(),
                renew_time: self.config.wall_clock.now(),
                leader_transitions: 0,
                strategy: None,
                preferred_holder: None,
                extensions: BTreeMap::new(),
            };
            record
                .extensions
                .insert(COUNT_EXTENSION.into(), self.config.count.to_string());
            record.extensions.insert(my_entry, self.me.clone());
            match self
                .request("create", &key, self.lock(&key).create(&record))
                .await
            {
                Ok(created) => {
                    tracing::info!(
                        shards = name,
                        count = self.config.count,
                        "created the shard set's roster"
                    );
                    self.note_roster(&created);
                }
                Err(err) if err.is_conflict() => {}
                Err(err) => self.report("create", &err),
            }
            return Ok(None);
        };
        let value = roster.record.extensions.get(COUNT_EXTENSION);
        let stored = value.and_then(|v| v.parse::<u32>().ok()).filter(|&c| c > 0);
        let Some(stored) = stored else {
            let err = ShardsError::InvalidRoster {
                name,
                roster: key,
                value: value.cloned(),
            };
            if self.problem.as_ref() != Some(&err) {
                tracing::error!("{err}");
            }
            self.problem = Some(err);
            return Ok(None);
        };
        if stored != self.config.count {
            return Err(ShardsError::CountMismatch {
                name,
                stored,
                ours: self.config.count,
                roster: key,
            });
        }
        if matches!(self.problem, Some(ShardsError::InvalidRoster { .. })) {
            self.problem = None;
        }
        self.note_roster(&roster);
        let stale = self.config.wall_clock.now() - roster.record.renew_time > ROSTER_REFRESH;
        let joining = !roster.record.extensions.contains_key(&my_entry);
        if joining || stale {
            let mut record = roster.record.clone();
            record.extensions.insert(my_entry, self.me.clone());
            record.lease_duration = ROSTER_LEASE;
            record.renew_time = self.config.wall_clock.now();
            let stored = self.write_roster(&roster.version, &record).await;
            if stored.is_some() && joining {
                tracing::info!(shards = name, "joined the shard set's roster");
            }
            return Ok(stored);
        }
        Ok(Some(roster))
    }

    fn note_roster(&mut self, roster: &Observed) {
        let members = roster
            .record
            .extensions
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(MEMBER_PREFIX).map(|key| (key, v)));
        if members
            .clone()
            .eq(self.roster_members.iter().map(|(k, v)| (k.as_str(), v)))
        {
            return;
        }
        self.roster_members = members.map(|(k, v)| (k.to_owned(), v.clone())).collect();
        // The keys a read asks for follow the roster's members.
        let mut keys = Vec::with_capacity(1 + self.roster_members.len() + self.shard_keys.len());
        keys.push(roster_key(&self.config.name));
        keys.extend(self.roster_members.keys().cloned());
        keys.extend(self.shard_keys.iter().cloned());
        self.read_keys = keys;
    }

    /// Takes this member's record when it does not hold it: a record of its identity that it
    /// did not write is another process's (S13), waited out as any other holder's.
    async fn hold_member_record(&mut self, current: Option<Observed>) {
        if self.member.is_some() {
            return;
        }
        let key = member_key(&self.config.name, &self.me);
        if let Some(current) = &current {
            self.check_identity(current);
        }
        let claim = self.claim(&key, current).await;
        match self.note_claim(&key, claim) {
            Ok(Some((observed, started))) => {
                self.member_token = Some(observed.record.leader_transitions);
                if self.conflict.take().is_some() {
                    self.problem = None;
                    tracing::info!(
                        shards = self.config.name,
                        "the other process with this identity is gone"
                    );
                }
                self.member = Some(self.start_term(key, None, observed, started));
            }
            Ok(None) => {}
            Err(err) if err.is_conflict() => {}
            Err(err) => self.report("acquire", &err),
        }
    }

    /// S13: this identity's member record held by a term this process did not start, and seen
    /// renewed (or outliving its lease), is another process's: say so once.
    fn check_identity(&mut self, current: &Observed) {
        let record = &current.record;
        if !record.is_held_by(&self.me) || self.member_token == Some(record.leader_transitions) {
            return;
        }
        let token = record.leader_transitions;
        match &mut self.conflict {
            Some((t, version, reported)) if *t == token => {
                let renewed = *version != current.version;
                let outlived = self.renews_in_store != Some(false)
                    && self
                        .seen
                        .get(&member_key(&self.config.name, &self.me))
                        .is_some_and(|s| {
                            Instant::now()
                                >= s.since + record.lease_duration * 2 + self.config.retry_period
                        });
                if !*reported && (renewed || outlived) {
                    *reported = true;
                    let conflict = IdentityConflict {
                        lock: format!(
                            "{} {}",
                            self.set.describe(),
                            member_key(&self.config.name, &self.me)
                        ),
                        identity: self.me.clone(),
                        fencing_token: token,
                    };
                    tracing::error!(shards = self.config.name, "{conflict}");
                    m::identity_conflict(&self.config.name);
                    self.problem = Some(ShardsError::IdentityConflict(conflict));
                }
            }
            _ => {
                tracing::warn!(
                    shards = self.config.name,
                    identity = self.me,
                    fencing_token = token,
                    "this identity's member record is held by a term this process did not start: \
                     waiting for it as for another member's (another process may run with the same identity)"
                );
                self.conflict = Some((token, current.version.clone(), false));
            }
        }
    }

    /// The members alive: named by the roster, holding their member record, and not seen
    /// unchanged past its lease where renewals change the version. This member once it holds
    /// its own.
    fn live_members(&self, members: &HashMap<String, Option<Observed>>) -> BTreeSet<String> {
        let mut live: BTreeSet<String> = members
            .iter()
            .filter(|(identity, observed)| {
                observed.as_ref().is_some_and(|o| {
                    o.record.is_held_by(identity)
                        && !(self.renews_in_store == Some(false)
                            && self.expired(&member_key(&self.config.name, identity), o))
                })
            })
            .map(|(identity, _)| identity.clone())
            .collect();
        live.remove(&self.me);
        if self.member.is_some() {
            live.insert(self.me.clone());
        }
        live
    }

    /// Where the store renews leases without changing the record, a record that looks held may
    /// belong to a member long dead, whose lease only the store knows ran out: asks the store
    /// ([`try_acquire`](ResourceLock::try_acquire)) about each other member at most once per
    /// lease, and lets go at once of a record it was given that way. Returns the members
    /// found dead.
    async fn probe(&mut self, members: &HashMap<String, Option<Observed>>) -> BTreeSet<String> {
        let mut dead = BTreeSet::new();
        if self.renews_in_store != Some(true)
            || self.set.reads_show_expiry()
            || self.member.is_none()
            || !self.try_acquire_supported
        {
            return dead;
        }
        let now = Instant::now();
        let lease = self.config.lease_duration;
        let due: Vec<(String, Observed)> = members
            .iter()
            .filter(|(identity, _)| **identity != self.me)
            .filter_map(|(identity, observed)| {
                let observed = observed
                    .as_ref()
                    .filter(|o| o.record.is_held_by(identity))?;
                let last = self.probed.entry(identity.clone()).or_insert(now);
                (now >= *last + lease).then(|| (identity.clone(), observed.clone()))
            })
            .collect();
        for (identity, observed) in due {
            let key = member_key(&self.config.name, &identity);
            let lock = self.lock(&key);
            let desired = self.desired(0, Some(&observed.record));
            match self
                .request("try_acquire", &key, lock.try_acquire(&desired))
                .await
            {
                Ok(Some(
                    Acquisition::Acquired(taken)
                    | Acquisition::Handed {
                        observed: taken, ..
                    },
                )) => {
                    tracing::info!(
                        shards = self.config.name,
                        member = identity,
                        "a member's lease ran out: it left or died"
                    );
                    let freed = LeaderElectionRecord {
                        holder_identity: String::new(),
                        ..taken.record.clone()
                    };
                    let _ = self
                        .request("release", &key, lock.update(&taken.version, &freed))
                        .await;
                    self.probed.remove(&identity);
                    dead.insert(identity);
                }
                Ok(_) => {
                    self.probed.insert(identity, Instant::now());
                }
                Err(err) => self.report("try_acquire", &err),
            }
        }
        self.probed
            .retain(|identity, _| members.contains_key(identity));
        dead
    }

    /// Removes from the roster the members whose record is gone, free, or (where renewals
    /// change the version) unchanged for twice its lease: members that left or died.
    async fn prune(
        &mut self,
        roster: &Observed,
        members: &HashMap<String, Option<Observed>>,
        live: &BTreeSet<String>,
    ) {
        if self.member.is_none() || self.renews_in_store.is_none() {
            return;
        }
        let name = self.config.name.clone();
        let gone: Vec<String> = members
            .iter()
            .filter(|(identity, observed)| {
                !live.contains(*identity)
                    && match observed {
                        None => true,
                        Some(o) => {
                            o.record.is_free()
                                || !o.record.is_held_by(identity)
                                || self.seen(&member_key(&name, identity)).is_some_and(|s| {
                                    Instant::now() >= s.since + o.record.lease_duration * 2
                                })
                        }
                    }
            })
            .map(|(identity, _)| identity.clone())
            .collect();
        if gone.is_empty() {
            return;
        }
        let mut record = roster.record.clone();
        for identity in &gone {
            record
                .extensions
                .remove(&format!("{MEMBER_PREFIX}{}", member_key(&name, identity)));
        }
        if self.write_roster(&roster.version, &record).await.is_some() {
            tracing::info!(shards = name, members = ?gone, "removed members that left from the roster");
        }
    }

    /// Writes the roster by compare-and-swap: the roster as stored, or `None` when another
    /// member wrote it first or the store failed (reported).
    async fn write_roster(
        &mut self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Option<Observed> {
        let key = roster_key(&self.config.name);
        match self
            .request("update", &key, self.lock(&key).update(version, record))
            .await
        {
            Ok(stored) => {
                self.note_roster(&stored);
                Some(stored)
            }
            Err(err) => {
                if !err.is_conflict() {
                    self.report("update", &err);
                }
                None
            }
        }
    }

    /// Takes up to `room` shards of `open` (those no live member owns: handed to this member
    /// first, then those it likes best), and one more when a shard has stayed free for a
    /// lease whatever the shares say (members whose view is stale leave no shard unowned for
    /// long). The `lapsed` shards are taken again whatever the room.
    async fn take(
        &mut self,
        room: usize,
        lapsed: &[u32],
        open: &[u32],
        shards: &[Option<Observed>],
    ) {
        let mut candidates: Vec<(bool, u64, u32)> = Vec::new();
        let mut stuck = None;
        for &shard in open {
            let observed = &shards[shard as usize];
            let key = &self.shard_keys[shard as usize];
            let handed_to_me = observed
                .as_ref()
                .is_some_and(|o| o.record.handover_to() == Some(self.me.as_str()));
            if observed
                .as_ref()
                .is_some_and(|o| self.standing_back(key, &o.record))
            {
                continue;
            }
            let free_for_long = observed
                .as_ref()
                .is_some_and(|o| o.record.is_free() && self.expired(key, o));
            if free_for_long && stuck.is_none() {
                stuck = Some(shard);
            }
            // Without room only the stuck shard is wanted: no need to rank every shard.
            if room > 0 {
                candidates.push((handed_to_me, affinity(&self.me, shard), shard));
            }
        }
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        // Lapsed shards first, then candidates until `room` are taken: a shard another member
        // took first (a conflict) makes way for the next candidate.
        let lapsed_count = lapsed.len();
        let mut wanted: Vec<u32> = lapsed.to_vec();
        wanted.extend(candidates.iter().map(|&(_, _, s)| s));
        if wanted.is_empty() {
            wanted.extend(stuck);
        }
        let mut taken = 0;
        let mut next = 0;
        // A request per shard taken, up to `CLAIMS_AT_ONCE` at a time, each on its own record:
        // the round ends in time for the next renewals, and the rest waits for the next round.
        let budget = Instant::now() + self.config.retry_period / 2;
        while next < wanted.len() && Instant::now() < budget {
            // A batch never mixes lapsed shards and candidates, nor takes more than the room.
            let limit = if next < lapsed_count {
                lapsed_count - next
            } else if room > 0 {
                room.saturating_sub(taken)
            } else {
                wanted.len() - next
            };
            let batch = &wanted[next..wanted.len().min(next + limit.min(CLAIMS_AT_ONCE))];
            if batch.is_empty() {
                break;
            }
            let retaking = next < lapsed_count;
            next += batch.len();
            let claims = join_all(batch.iter().map(|&shard| {
                let current = shards[shard as usize].clone();
                self.claim(&self.shard_keys[shard as usize], current)
            }))
            .await;
            let mut failed = false;
            for (&shard, claim) in batch.iter().zip(claims) {
                let key = self.shard_keys[shard as usize].clone();
                match self.note_claim(&key, claim) {
                    Ok(Some((observed, started))) => {
                        let token = observed.record.leader_transitions;
                        let term = self.start_term(key, Some(shard), observed, started);
                        tracing::info!(
                            shards = self.config.name,
                            shard,
                            fencing_token = token,
                            "took the shard"
                        );
                        m::shard_moved(&self.config.name, "acquired");
                        let counted = term.leadership.clone();
                        self.owned.insert(shard, term);
                        self.owned_changed = true;
                        if !retaking {
                            taken += 1;
                        }
                        if let (Some(started), Some(leadership)) =
                            (&self.callbacks.started, counted)
                        {
                            started(shard, leadership);
                        }
                    }
                    Ok(None) => {}
                    Err(err) if err.is_conflict() => {}
                    Err(err) => {
                        if !failed {
                            self.report("acquire", &err);
                        }
                        failed = true;
                    }
                }
            }
            if failed {
                break;
            }
        }
    }

    /// Publishes the state when it changed: a round that changed nothing wakes no subscriber
    /// and copies no list of shards.
    fn publish(&mut self, stopped: bool) {
        let members = self.live;
        m::set_shards(&self.config.name, self.owned.len(), members, self.imbalance);
        let owned_changed = std::mem::take(&mut self.owned_changed);
        let owned = owned_changed.then(|| {
            self.owned
                .iter()
                .filter_map(|(&s, t)| t.leadership.as_ref().map(|l| (s, l.uncounted())))
                .collect()
        });
        let problem = &self.problem;
        self.state.send_if_modified(|state| {
            let changed = owned.is_some()
                || state.members != members
                || state.problem != *problem
                || state.stopped != stopped;
            if let Some(owned) = owned {
                state.owned = owned;
            }
            state.members = members;
            state.problem.clone_from(problem);
            state.stopped = stopped;
            changed
        });
    }

    /// Shutdown: every shard's work stopped and its shard released (S6), then the member
    /// record and the roster entry.
    async fn leave(&mut self) {
        let shards: Vec<u32> = self.owned.keys().copied().collect();
        for shard in shards {
            if self.config.release_on_cancel {
                self.give(shard, None, StepDownReason::Shutdown);
            } else {
                self.end(shard, StepDownReason::Shutdown);
            }
        }
        let bound = self.config.stop_grace + self.config.request_timeout;
        let _ = tokio::time::timeout(bound, async {
            while self.releases.join_next().await.is_some() {}
        })
        .await;
        self.releases.abort_all();
        if !self.config.release_on_cancel {
            return;
        }
        let name = self.config.name.clone();
        let key = roster_key(&name);
        let entry = format!("{MEMBER_PREFIX}{}", member_key(&name, &self.me));
        for _ in 0..2 {
            let Ok(Some(roster)) = self.request("get", &key, self.lock(&key).get()).await else {
                break;
            };
            if !roster.record.extensions.contains_key(&entry) {
                break;
            }
            let mut record = roster.record.clone();
            record.extensions.remove(&entry);
            if self.write_roster(&roster.version, &record).await.is_some() {
                break;
            }
        }
        if let Some(member) = self.member.take() {
            member.cancel.cancel();
            let record = LeaderElectionRecord {
                holder_identity: String::new(),
                ..member.observed.record.clone()
            };
            let _ = self
                .request(
                    "release",
                    &member.key,
                    self.lock(&member.key)
                        .update(&member.observed.version, &record),
                )
                .await;
        }
    }
}

/// Notes a read or written record in what was seen of it (see [`Runner::observe`]).
fn note(slot: &mut Option<Seen>, observed: Option<&Observed>) {
    let Some(observed) = observed else {
        *slot = None;
        return;
    };
    match slot {
        Some(seen) => note_seen(seen, observed),
        None => {
            *slot = Some(Seen {
                version: observed.version.clone(),
                since: Instant::now(),
                handover: observed
                    .record
                    .handover_to()
                    .map(|to| (to.to_owned(), Instant::now())),
            });
        }
    }
}

/// Notes `observed` in what was seen of its record: the follower's clock for its lease starts
/// when a version is first seen (S2), and the stand-back clock when a handover is first seen.
fn note_seen(seen: &mut Seen, observed: &Observed) {
    let now = Instant::now();
    if seen.version != observed.version {
        seen.version.clone_from(&observed.version);
        seen.since = now;
    }
    match observed.record.handover_to() {
        Some(to) if seen.handover.as_ref().is_some_and(|(h, _)| h == to) => {}
        Some(to) => seen.handover = Some((to.to_owned(), now)),
        None => seen.handover = None,
    }
}

fn tell_stopped(
    callback: Option<&Arc<super::Stopped>>,
    shard: u32,
    fencing_token: u64,
    reason: StepDownReason,
    released: bool,
) {
    if let Some(stopped) = callback {
        stopped(
            shard,
            StepDown {
                fencing_token,
                reason,
                released,
            },
        );
    }
}

fn reason_label(reason: StepDownReason) -> &'static str {
    match reason {
        StepDownReason::Lost => "lost",
        StepDownReason::RenewDeadlineExceeded => "expired",
        StepDownReason::HandedOver => "handed_over",
        _ => "released",
    }
}

/// The timer of a term (S3): cancels it once its deadline passes without being moved on. It
/// wakes at the deadline it last read, not at each renewal: a renewal only moves the deadline
/// later, and a term dropped is cancelled by its drop.
fn end_at_deadline(cancel: CancellationToken, deadline: watch::Receiver<Instant>) {
    tokio::spawn(async move {
        loop {
            let until = *deadline.borrow();
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep_until(until) => {
                    if Instant::now() >= *deadline.borrow() {
                        cancel.cancel();
                        return;
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use async_trait::async_trait;
    use tokio::time::sleep;
    use tokio_util::sync::CancellationToken;

    use super::super::{KeyedLocks, Known, LockSet, Renewal, RenewedAndRead, Shards};
    use crate::config::Timings;
    use crate::error::LockError;
    use crate::leadership::StepDownReason;
    use crate::lock::ResourceLock;
    use crate::memory::MemoryStore;
    use crate::record::Observed;

    const TIMINGS: Timings = Timings {
        lease_duration: Duration::from_secs(10),
        renew_deadline: Duration::from_secs(8),
        retry_period: Duration::from_secs(1),
    };

    /// A member's records, with the number of keys of each read, and a 0 for each batch of
    /// renewals sent alone (not with a read).
    #[derive(Debug)]
    struct Reads {
        inner: KeyedLocks,
        sizes: Arc<Mutex<Vec<usize>>>,
    }

    #[async_trait]
    impl LockSet for Reads {
        fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
            self.inner.lock(key)
        }
        fn identity(&self) -> &str {
            self.inner.identity()
        }
        fn describe(&self) -> String {
            self.inner.describe()
        }
        async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
            self.sizes.lock().unwrap().push(keys.len());
            self.inner.get_many(keys).await
        }
        async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
            self.sizes.lock().unwrap().push(0);
            self.inner.renew_many(renewals).await
        }
        async fn renew_and_read(
            &self,
            renewals: &[Renewal],
            keys: &[String],
            known: &[Known<'_>],
        ) -> RenewedAndRead {
            self.sizes.lock().unwrap().push(keys.len());
            self.inner.renew_and_read(renewals, keys, known).await
        }
    }

    /// Once balanced, a member reads every shard once per half a lease, and otherwise the
    /// roster and the members alone, with its renewals in the same request (its renewals go
    /// alone before a full read); a round that changes nothing publishes nothing. Then a join is seen by the members' read, and the
    /// shards are read again at once.
    #[tokio::test]
    async fn a_settled_member_reads_the_shards_only_now_and_then() {
        tokio::time::pause();
        const COUNT: u32 = 30;
        let store = MemoryStore::new();
        let shutdown = CancellationToken::new();
        let join = |identity: &str| {
            let store = store.clone();
            let sizes = Arc::new(Mutex::new(Vec::new()));
            let locks = Reads {
                inner: KeyedLocks::new(identity, "memory", move |key, identity| {
                    Arc::new(store.lock(key, identity))
                }),
                sizes: sizes.clone(),
            };
            let shards = Shards::builder("jobs", COUNT, locks)
                .timings(TIMINGS)
                .build()
                .unwrap();
            let state = shards.subscribe();
            let task = tokio::spawn(
                shards.run_per_shard(shutdown.clone(), |_, _| std::future::pending::<()>()),
            );
            (sizes, state, task)
        };
        let (sizes, mut state, first) = join("a");
        let others = [join("b"), join("c")];
        let mut waited = Duration::ZERO;
        while state.borrow().owned.len() != 10
            || others.iter().any(|(_, s, _)| s.borrow().owned.len() != 10)
        {
            assert!(waited < Duration::from_secs(120), "not balanced");
            sleep(TIMINGS.retry_period).await;
            waited += TIMINGS.retry_period;
        }
        sleep(TIMINGS.lease_duration).await;
        state.mark_unchanged();
        sizes.lock().unwrap().clear();
        // Twenty rounds with nothing changing.
        sleep(TIMINGS.retry_period * 20).await;
        let mut reads = std::mem::take(&mut *sizes.lock().unwrap());
        let alone = reads.iter().filter(|&&n| n == 0).count();
        reads.retain(|&n| n > 0);
        assert!(
            (19..=21).contains(&reads.len()),
            "a read a round: {reads:?}"
        );
        let full = reads.iter().filter(|&&n| n > COUNT as usize).count();
        assert_eq!(
            alone, full,
            "renewals sent apart from a read of the members: {reads:?}"
        );
        let light = reads.iter().filter(|&&n| n == 4).count();
        assert_eq!(full + light, reads.len(), "{reads:?}");
        assert!(
            (3..=5).contains(&full),
            "a full read per half a lease: {reads:?}"
        );
        assert!(light >= 14, "{reads:?}");
        assert!(
            !state.has_changed().unwrap(),
            "a round that changed nothing published"
        );

        // A newcomer: every member reads the shards again, and the set balances.
        let newcomer = join("d");
        let mut waited = Duration::ZERO;
        while [&state, &others[0].1, &others[1].1, &newcomer.1]
            .iter()
            .map(|s| s.borrow().owned.len())
            .any(|n| !(7..=8).contains(&n))
        {
            assert!(
                waited <= TIMINGS.lease_duration + TIMINGS.retry_period * 2,
                "not balanced after a join"
            );
            sleep(TIMINGS.retry_period).await;
            waited += TIMINGS.retry_period;
        }
        assert!(state.has_changed().unwrap());
        shutdown.cancel();
        for task in [first, newcomer.2] {
            task.await.unwrap().unwrap();
        }
        for (_, _, task) in others {
            task.await.unwrap().unwrap();
        }
    }

    /// A member whose releases take longer than a lease (its shards' work is slow to stop)
    /// gives its surplus away once: the shards it is releasing, though their records still name
    /// it, are not counted as its own again, nor taken back once their lease runs out (while
    /// their work still runs), nor given twice.
    #[tokio::test]
    async fn slow_releases_give_the_surplus_away_once() {
        tokio::time::pause();
        const COUNT: u32 = 20;
        let store = MemoryStore::new();
        let shutdown = CancellationToken::new();
        let handed = Arc::new(Mutex::new(Vec::new()));
        let slow_stop = Arc::new(Mutex::new(Duration::ZERO));
        let join = |identity: &str, slow_stop: Arc<Mutex<Duration>>| {
            let store = store.clone();
            let locks = KeyedLocks::new(identity, "memory", move |key, identity| {
                // On the store's clock: an acquisition of a record that names this member
                // succeeds at once, as on Postgres.
                Arc::new(store.lock(key, identity).with_store_clock(true))
            });
            let handed = handed.clone();
            let shards = Shards::builder("jobs", COUNT, locks)
                .timings(TIMINGS)
                .stop_grace(TIMINGS.lease_duration * 2)
                .on_shard_started(move |_, term| {
                    // The work's last part stops `slow_stop` after its term ends.
                    let slow_stop = slow_stop.clone();
                    tokio::spawn(async move {
                        term.lost().await;
                        let wait = *slow_stop.lock().unwrap();
                        sleep(wait).await;
                        drop(term);
                    });
                })
                .on_shard_stopped(move |shard, stop| {
                    if stop.reason == StepDownReason::HandedOver {
                        handed.lock().unwrap().push(shard);
                    }
                })
                .build()
                .unwrap();
            let state = shards.subscribe();
            let task = tokio::spawn(
                shards.run_per_shard(shutdown.clone(), |_, _| std::future::pending::<()>()),
            );
            (state, task)
        };
        let (a, first) = join("a", slow_stop.clone());
        let mut waited = Duration::ZERO;
        while a.borrow().owned.len() != COUNT as usize {
            assert!(
                waited < Duration::from_secs(60),
                "a alone took not every shard"
            );
            sleep(TIMINGS.retry_period).await;
            waited += TIMINGS.retry_period;
        }
        // Each of a's releases now waits a lease and three rounds for its work to stop.
        *slow_stop.lock().unwrap() = TIMINGS.lease_duration + TIMINGS.retry_period * 3;
        let (b, second) = join("b", Arc::default());
        let mut waited = Duration::ZERO;
        while a.borrow().owned.len() != 10 || b.borrow().owned.len() != 10 {
            assert!(
                waited < TIMINGS.lease_duration * 3,
                "not balanced: a {}, b {}",
                a.borrow().owned.len(),
                b.borrow().owned.len()
            );
            sleep(TIMINGS.retry_period).await;
            waited += TIMINGS.retry_period;
        }
        sleep(TIMINGS.lease_duration).await;
        assert_eq!(
            handed.lock().unwrap().len(),
            10,
            "{:?}",
            handed.lock().unwrap()
        );
        assert_eq!((a.borrow().owned.len(), b.borrow().owned.len()), (10, 10));
        *slow_stop.lock().unwrap() = Duration::ZERO;
        shutdown.cancel();
        first.await.unwrap().unwrap();
        second.await.unwrap().unwrap();
    }
}
