//! Taking shards: what a member may claim, the claim (a create or a compare-and-swap on the
//! record as read), the start of a shard's term, and the pass of a round that takes the
//! shards this member should own.

use std::sync::Arc;

use futures_util::future::join_all;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{CLAIMS_AT_ONCE, Claim, Plan, Runner, Term, end_at_deadline};
use crate::error::LockError;
use crate::leadership::{Leadership, TermDeadline};
use crate::lock::{Acquisition, ResourceLock};
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed};
use crate::rules::{self, Sighting, Unanswered};
use crate::shards::assign::affinity;

impl Runner {
    /// Whether the store keeps leases alive itself: it deletes the records whose lease ends
    /// ([`LockSet::reads_show_expiry`]), or renews them without a new version, as this
    /// member's own renewals showed.
    ///
    /// [`LockSet::reads_show_expiry`]: crate::shards::LockSet::reads_show_expiry
    pub(super) fn store_keeps_leases(&self) -> bool {
        self.cx.set.reads_show_expiry() || self.learned.renews_in_store == Some(true)
    }

    /// True when `observed` has stayed unchanged for its lease since this member first saw it.
    pub(super) fn expired(&self, key: &str, observed: &Observed) -> bool {
        self.table
            .sighting(key)
            .is_some_and(|seen| seen.expired(observed, Instant::now()))
            || self.wrote_unanswered(key, &observed.record)
    }

    /// True when `record` is what a claim of `key` whose answer did not come wrote: this
    /// member's own, taken again at once (with the next token) rather than waited out as a
    /// term another process started (S13).
    pub(super) fn wrote_unanswered(&self, key: &str, record: &LeaderElectionRecord) -> bool {
        self.table
            .unanswered
            .get(key)
            .is_some_and(|sent| sent.wrote(record, &self.cx.me))
    }

    /// True while a handover request names another member and this one stands back from it
    /// (a request naming another candidate than the one seen is new: it is stood back from).
    pub(super) fn standing_back(&self, key: &str, record: &LeaderElectionRecord) -> bool {
        Sighting::standing_back(
            self.table.sighting(key),
            record,
            &self.cx.me,
            Instant::now(),
        )
    }

    /// The record of a claim by this member with `token` ([`rules::acquisition`]).
    pub(super) fn desired(
        &self,
        token: u64,
        base: Option<&LeaderElectionRecord>,
    ) -> LeaderElectionRecord {
        rules::acquisition(&self.cx.me, &self.cx.config.lease, token, base)
    }

    /// One acquisition attempt of `key`, whose last read is `current`: the store's clock where
    /// it has one, else the follower's (S2). Many run at once (each on its own record), so it
    /// changes nothing here: [`Runner::note_claim`] notes what it learnt.
    pub(super) async fn claim(&self, key: &str, mut current: Option<Observed>) -> Claim {
        let mut claim = Claim {
            result: Ok(None),
            held: None,
            no_try_acquire: false,
            seen: None,
            unanswered: None,
        };
        let lock = self.cx.lock(key);
        let started = Instant::now();
        // S2 for a record that may be gone: while the record last seen is another's (S13: or
        // another process's of this identity), it is read first ([`rules::reads_first`]), and
        // a record found gone is not created (the round waits it out). Not where the store keeps
        // leases itself: it deletes a record whose lease ended, and an unchanged version says
        // nothing of the holder's renewals.
        let check = lock.holder_check();
        let counted = !self.store_keeps_leases()
            && self
                .table
                .sighting(key)
                .is_some_and(|seen| seen.counted_holder().is_some());
        if counted && (!self.learned.try_acquire || rules::reads_first(check)) {
            match self.request("get", key, lock.get()).await {
                Err(err) => {
                    claim.result = Err(err);
                    return claim;
                }
                // Found gone: not created here. A shard's is waited out from the round's next
                // read of every shard, which finds it so; a member record's is taken after the
                // round's next read of the members, which forgets the sighting.
                Ok(None) => return claim,
                // Found: claimed as from any read, where the store's clock judges the lease
                // if it has one (`try_acquire`), else this member's (`claim_by_update`).
                // Settled, a member reads every shard once per half a lease, so its own count
                // of a lease may start that much after the write: the store's judgement is
                // not held back for it (unlike an elector's, [`rules::waits_after_read`]).
                // A deletion between this read and the acquisition is created anew: a window
                // of one round trip, as an elector's after an outage.
                Ok(Some(read)) => {
                    claim.seen = Some(read.clone());
                    current = Some(read);
                }
            }
        }
        if self.learned.try_acquire {
            // The store gives the next token, at least the one asked for: above every token
            // seen (S5), the one just read too, should the record have been deleted and
            // written anew.
            let mut tokens = self.table.tokens(key);
            if let Some(current) = &current {
                tokens.see(&current.record);
            }
            let desired = self.desired(tokens.floor(), current.as_ref().map(|o| &o.record));
            let answer = self
                .request("try_acquire", key, lock.try_acquire(&desired))
                .await;
            match Unanswered::note(&mut claim.unanswered, &desired, answer) {
                Err(err) => claim.result = Err(err),
                Ok(Some(Acquisition::Acquired(observed))) => {
                    claim.result = Ok(Some((observed, started)));
                }
                Ok(Some(Acquisition::Handed {
                    observed,
                    alive_since,
                })) => {
                    // S3: the term counts from when the store last confirmed the lease alive;
                    // with too little of it left, a renewal confirms it first.
                    claim.result = if rules::handed_term_left(
                        &self.cx.config.lease,
                        alive_since,
                        Instant::now(),
                    ) {
                        Ok(Some((observed, alive_since.min(started))))
                    } else {
                        let confirming = Instant::now();
                        let record = rules::renewal(&observed.record, &self.cx.config.lease);
                        let renewal = lock.renew(&observed.version, &record);
                        let confirmed = self.request("renew", key, renewal).await;
                        if confirmed.is_err() {
                            claim.seen = Some(observed);
                        }
                        confirmed.map(|stored| Some((stored, confirming)))
                    };
                }
                Ok(Some(Acquisition::Held {
                    observed,
                    renewed_in_store,
                    ..
                })) => {
                    claim.held = Some((observed.clone(), renewed_in_store));
                    // A lease the store kept alive until now is counted from now (S2): the
                    // clock as it stands started with the term, not with this answer.
                    let stopped_keeping = self
                        .table
                        .sighting(key)
                        .is_some_and(|seen| seen.kept_by_store(&observed.version));
                    let ours = self.wrote_unanswered(key, &observed.record);
                    if (!renewed_in_store && !stopped_keeping) || ours {
                        current = Some(observed);
                        claim.result = self
                            .claim_by_update(key, &lock, current, started, &mut claim.unanswered)
                            .await;
                    }
                }
                Ok(Some(Acquisition::Unassigned(observed))) => claim.seen = observed,
                Ok(None) => {
                    claim.no_try_acquire = true;
                    claim.result = self
                        .claim_by_update(key, &lock, current, started, &mut claim.unanswered)
                        .await;
                }
            }
            return claim;
        }
        claim.result = self
            .claim_by_update(key, &lock, current, started, &mut claim.unanswered)
            .await;
        claim
    }

    /// An acquisition by compare-and-swap on the record as read: taken only when free or seen
    /// unchanged for its lease by this member's clock (S2), with the next token (S5). What the
    /// store showed of `key` in this attempt is already in `current` (a version this member
    /// had not seen is not expired, as it would not be once noted). A claim sent without its
    /// answer coming is noted in `unanswered`.
    pub(super) async fn claim_by_update(
        &self,
        key: &str,
        lock: &Arc<dyn ResourceLock>,
        current: Option<Observed>,
        started: Instant,
        unanswered: &mut Option<Unanswered>,
    ) -> Result<Option<(Observed, Instant)>, LockError> {
        let tokens = self.table.tokens(key);
        let Some(current) = current else {
            // S5: above every token seen, should the record have been deleted.
            let desired = self.desired(tokens.floor(), None);
            let answer = self.request("create", key, lock.create(&desired)).await;
            let created = Unanswered::note(unanswered, &desired, answer)?;
            return Ok(Some((created, started)));
        };
        let record = &current.record;
        if (!record.is_free() && !self.expired(key, &current)) || self.standing_back(key, record) {
            return Ok(None);
        }
        // S5: every acquisition gets the next token.
        let desired = self.desired(tokens.next(record)?, Some(record));
        let answer = self
            .request("update", key, lock.update(&current.version, &desired))
            .await;
        let stored = Unanswered::note(unanswered, &desired, answer)?;
        Ok(Some((stored, started)))
    }

    /// Notes what an acquisition attempt of `key` learnt: the record the store showed, whether
    /// the store has a one-request acquisition, and the record taken. Returns the attempt's
    /// result.
    pub(super) fn note_claim(
        &mut self,
        key: &str,
        claim: Claim,
    ) -> Result<Option<(Observed, Instant)>, LockError> {
        if claim.no_try_acquire {
            self.learned.try_acquire = false;
        }
        // Oldest first: what a read showed, then what the store answered.
        if let Some(seen) = &claim.seen {
            self.table.observe(key, Some(seen));
        }
        if let Some((held, kept)) = &claim.held {
            self.table.observe(key, Some(held));
            self.table.store_keeps(key, *kept);
        }
        if let Ok(Some((observed, _))) = &claim.result {
            self.table.observe(key, Some(observed));
            self.table.unanswered.remove(key);
        }
        if let Some(sent) = claim.unanswered {
            self.table.unanswered.insert(key.to_owned(), sent);
        }
        claim.result
    }

    /// A term that starts now: its timer, and for a shard its leadership.
    pub(super) fn start_term(
        &self,
        key: String,
        shard: Option<u32>,
        observed: Observed,
        started: Instant,
    ) -> Term {
        let cancel = CancellationToken::new();
        let (deadline, until) = watch::channel(started + self.cx.config.lease.renew_deadline);
        let shared_deadline =
            TermDeadline::new((started + self.cx.config.lease.renew_deadline).into_std());
        end_at_deadline(cancel.clone(), until);
        let (leadership, requests, alive) = match shard {
            Some(shard) => {
                let (leadership, requests, alive) = Leadership::new(
                    format!("{}/{shard}", self.cx.config.name),
                    self.cx.me.clone(),
                    observed.record.leader_transitions,
                    cancel.clone(),
                    observed.record.extensions.clone(),
                    shared_deadline.clone(),
                    self.cx.config.lease.wall_clock.now(),
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

    /// Takes up to `room` shards of `open` (those no live member owns: handed to this member
    /// first, then those it likes best), and one more when a shard has stayed free for a
    /// lease whatever the shares say (members whose view is stale leave no shard unowned for
    /// long), unless this member is `drained`. The `lapsed` shards are taken again whatever
    /// the room, unless this member is `drained`: then each is only made free (its record
    /// taken back as any claim takes it, S2 and S13, and released at once, with no term and
    /// no work), for the members that should own it. This round makes the claims its budget
    /// allows; the plan keeps the rest for the rounds that follow
    /// ([`claim_planned`](Self::claim_planned)).
    pub(super) async fn take(
        &mut self,
        room: usize,
        lapsed: &[u32],
        open: &[u32],
        shards: &[Option<Observed>],
        drained: bool,
    ) {
        let mut candidates: Vec<(bool, u64, u32)> = Vec::new();
        let mut stuck = None;
        for &shard in open {
            let observed = &shards[shard as usize];
            let key = &self.table.keys[shard as usize];
            let handed_to_me = observed
                .as_ref()
                .is_some_and(|o| o.record.handover_to() == Some(self.cx.me.as_str()));
            if observed
                .as_ref()
                .is_some_and(|o| self.standing_back(key, &o.record))
            {
                continue;
            }
            let free_for_long = observed
                .as_ref()
                .is_some_and(|o| o.record.is_free() && self.expired(key, o));
            if free_for_long && stuck.is_none() && !drained {
                stuck = Some(shard);
            }
            // Without room only the stuck shard is wanted: no need to rank every shard.
            if room > 0 {
                candidates.push((handed_to_me, affinity(&self.cx.me, shard), shard));
            }
        }
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        // Lapsed shards first, then candidates until `room` are taken; without either, the
        // stuck shard.
        let mut plan = Plan {
            lapsed: lapsed.iter().copied().collect(),
            candidates: candidates.iter().map(|&(_, _, s)| s).collect(),
            room,
            drained,
        };
        if plan.lapsed.is_empty() && plan.candidates.is_empty() {
            plan.candidates.extend(stuck);
            plan.room = plan.candidates.len();
        }
        self.plan = Some(plan);
        self.claim_planned(shards).await;
    }

    /// Makes the claims of the plan (see [`Plan`]) that this round's budget allows: half a
    /// retry period less what its renewals took (a tenth of one at least, so that a slow
    /// store still sees claims), a request per shard, up to `CLAIMS_AT_ONCE` at a time, each
    /// on its own record. What is left waits for the next rounds. `shards` holds each shard's
    /// record as last read.
    pub(super) async fn claim_planned(&mut self, shards: &[Option<Observed>]) {
        let Some(mut plan) = self.plan.take() else {
            return;
        };
        let retry = self.cx.config.lease.retry_period;
        let budget = Instant::now()
            + (retry / 2)
                .saturating_sub(self.renewals_took)
                .max(retry / 10);
        while !plan.done() && Instant::now() < budget {
            // A batch never mixes lapsed shards and candidates, nor takes more than the room.
            let retaking = !plan.lapsed.is_empty();
            let mut batch: Vec<u32> = if retaking {
                let n = plan.lapsed.len().min(CLAIMS_AT_ONCE);
                plan.lapsed.drain(..n).collect()
            } else {
                let n = plan.room.min(plan.candidates.len()).min(CLAIMS_AT_ONCE);
                plan.candidates.drain(..n).collect()
            };
            // Rounds after the read: a shard since taken here, or past a new count, is not.
            batch.retain(|shard| {
                (*shard as usize) < self.table.keys.len()
                    && !self.terms.owned().contains_key(shard)
                    && !self.releases.contains(*shard)
            });
            // Claims sent are waited for past the budget (each no longer than its request
            // may take), since the store may apply a claim it answers late: dropped, it would
            // leave a record naming this member without a term, idle for a lease and a token
            // spent. Never past the point where the next round's renewals would be late: a
            // retry period before the first deadline of the terms held.
            let last = self
                .terms
                .first_deadline()
                .map(|first| first - self.cx.config.lease.retry_period);
            let claims = {
                let claims = join_all(batch.iter().map(|&shard| {
                    let current = shards.get(shard as usize).cloned().flatten();
                    self.claim(&self.table.keys[shard as usize], current)
                }));
                let mut claims = std::pin::pin!(claims);
                match tokio::time::timeout_at(budget, &mut claims).await {
                    Ok(claims) => Some(claims),
                    // The budget is spent: this batch is the round's last.
                    Err(_) => match last {
                        Some(last) => tokio::time::timeout_at(last, claims).await.ok(),
                        None => Some(claims.await),
                    },
                }
            };
            let Some(claims) = claims else {
                tracing::debug!(
                    shards = self.cx.config.name,
                    "claims outlasted what the terms held allow: the rest waits for the next \
                     rounds"
                );
                break;
            };
            let mut failed = false;
            for (&shard, claim) in batch.iter().zip(claims) {
                let key = self.table.keys[shard as usize].clone();
                match self.note_claim(&key, claim) {
                    Ok(Some((observed, _))) if retaking && plan.drained => {
                        self.free(shard, observed);
                    }
                    Ok(Some((observed, started))) => {
                        let token = observed.record.leader_transitions;
                        let term = self.start_term(key, Some(shard), observed, started);
                        tracing::info!(
                            shards = self.cx.config.name,
                            shard,
                            fencing_token = token,
                            "took the shard"
                        );
                        m::shard_moved(&self.cx.config.name, "acquired");
                        let counted = term.leadership.clone();
                        self.terms.insert(shard, term);
                        if !retaking {
                            plan.room = plan.room.saturating_sub(1);
                        }
                        if let (Some(started), Some(leadership)) =
                            (&self.cx.callbacks.started, counted)
                        {
                            started(shard, leadership);
                        }
                    }
                    Ok(None) => {}
                    Err(err) if err.is_conflict() => {}
                    Err(err) => {
                        if !failed {
                            self.cx.report("acquire", &err);
                        }
                        failed = true;
                    }
                }
            }
            if failed {
                break;
            }
        }
        if !plan.done() {
            self.plan = Some(plan);
        }
    }
}
