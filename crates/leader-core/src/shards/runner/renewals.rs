//! A member's renewals: every owned shard's record (and its member record) renewed in one
//! batch where the store allows it, a batch that timed out re-read before anything is called
//! lost, and the terms that end by their deadline.

use std::sync::Arc;

use tokio::time::Instant;

use super::{Runner, Term};
use crate::error::LockError;
use crate::leadership::StepDownReason;
use crate::metrics as m;
use crate::record::Observed;
use crate::rules;
use crate::shards::Renewal;

impl Runner {
    /// Renews the member record and every shard in one batch (see [`renewed`](Self::renewed)).
    pub(super) async fn renew(&mut self) {
        let (renewals, whose) = self.renewals();
        if renewals.is_empty() {
            return;
        }
        let started = Instant::now();
        match tokio::time::timeout(
            self.cx.config.lease.request_timeout,
            self.cx.set.renew_many(&renewals),
        )
        .await
        {
            Ok(results) => self.renewed(whose, results, started).await,
            Err(_) => self.renew_timed_out(started),
        }
    }

    /// Notes renewals sent at `started` that got no answer in time.
    pub(super) fn renew_timed_out(&mut self, started: Instant) {
        self.renewals_took = started.elapsed();
        let err = LockError::Timeout {
            lock: self.cx.set.describe(),
            operation: "renew",
            after: started.elapsed(),
        };
        self.cx.report("renew", &err);
    }

    /// This round's renewals of the member record and every shard, and whose each is (`None`:
    /// the member record's), once the terms past their deadline have ended.
    pub(super) fn renewals(&mut self) -> (Vec<Renewal>, Vec<Option<u32>>) {
        self.drop_expired();
        let mut renewals = Vec::new();
        let mut whose = Vec::new();
        for (shard, term) in self.terms.iter() {
            whose.push(shard);
            renewals.push(self.renewal_of(term));
        }
        (renewals, whose)
    }

    /// The renewal of `term` from the record it last saw.
    pub(super) fn renewal_of(&self, term: &Term) -> Renewal {
        let record = rules::renewal(&term.observed.record, &self.cx.config.lease);
        Renewal {
            key: term.key.clone(),
            version: term.observed.version.clone(),
            record,
        }
    }

    /// Takes the answers of the renewals sent at `started`; one whose deadline passed
    /// meanwhile is not extended (S3). The terms whose renewal conflicted are read again and,
    /// when still this member's, renewed at once (see [`reread`](Self::reread)).
    pub(super) async fn renewed(
        &mut self,
        whose: Vec<Option<u32>>,
        results: Vec<Result<Observed, LockError>>,
        started: Instant,
    ) {
        self.renewals_took = started.elapsed();
        let conflicts = self.take_renewals(whose, results, started);
        if !conflicts.is_empty() {
            let again = self.reread(conflicts).await.again;
            if !again.is_empty() {
                let (whose, renewals): (Vec<_>, Vec<_>) = again.into_iter().unzip();
                let started = Instant::now();
                match tokio::time::timeout_at(
                    self.request_deadline(),
                    self.cx.set.renew_many(&renewals),
                )
                .await
                {
                    Ok(results) => {
                        for whose in self.take_renewals(whose, results, started) {
                            self.lose(whose);
                        }
                    }
                    Err(_) => self.renew_timed_out(started),
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
    pub(super) async fn reread(&mut self, conflicts: Vec<Option<u32>>) -> ReadBack {
        let mut back = ReadBack::default();
        m::slow_path(&self.cx.config.name);
        let mut terms = Vec::with_capacity(conflicts.len());
        for whose in conflicts {
            if let Some(term) = self.terms.get_mut(whose).filter(|t| !t.past_deadline()) {
                let key = term.key.clone();
                terms.push((whose, key));
            }
        }
        let keys: Vec<String> = terms.iter().map(|(_, key)| key.clone()).collect();
        let started = Instant::now();
        let read = tokio::time::timeout_at(self.request_deadline(), self.cx.set.get_many(&keys));
        let answers = match read.await {
            Ok(answers) if answers.len() == keys.len() => answers,
            failed => {
                let err = match failed {
                    Ok(_) => self.cx.miscounted(),
                    // Cut at the request deadline, which the round's renewals used up in part.
                    Err(_) => LockError::Timeout {
                        lock: self.cx.set.describe(),
                        operation: "get",
                        after: started.elapsed(),
                    },
                };
                self.cx.report("get", &err);
                let err = Arc::new(err);
                back.unread = terms
                    .into_iter()
                    .map(|(whose, _)| (whose, err.clone()))
                    .collect();
                return back;
            }
        };
        for ((whose, key), answer) in terms.into_iter().zip(answers) {
            let current = match answer {
                Ok(current) => current,
                Err(err) => {
                    self.cx.report("get", &err);
                    back.unread.push((whose, Arc::new(err)));
                    continue;
                }
            };
            self.table.observe(&key, current.as_ref());
            let me = self.cx.me.clone();
            let Some(term) = self.terms.get_mut(whose) else {
                continue;
            };
            let Some(current) = current.filter(|c| rules::is_term(&c.record, &me, term.token()))
            else {
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
                    if let Some(term) = self.terms.get(whose) {
                        back.again.push((whose, self.renewal_of(term)));
                    }
                }
            }
        }
        back
    }

    /// Ends the term of `whose` (a shard's, or the member record's): its record is another's.
    pub(super) fn lose(&mut self, whose: Option<u32>) {
        let Some(term) = self.terms.get(whose) else {
            return;
        };
        term.cancel.cancel();
        tracing::warn!(
            shards = self.cx.config.name,
            key = term.key,
            "lost: the record is no longer this member's"
        );
        match whose {
            Some(shard) => self.end(shard, StepDownReason::Lost),
            None => self.terms.member = None,
        }
    }

    /// Takes the answers of the renewals sent at `started`: a term renewed is extended unless
    /// its deadline passed meanwhile (S3). Returns the terms whose renewal conflicted.
    pub(super) fn take_renewals(
        &mut self,
        whose: Vec<Option<u32>>,
        results: Vec<Result<Observed, LockError>>,
        started: Instant,
    ) -> Vec<Option<u32>> {
        let took = started.elapsed();
        let mut failed = None;
        let mut renewed = 0usize;
        let mut conflicts = Vec::new();
        let renew_deadline = self.cx.config.lease.renew_deadline;
        for (shard, result) in whose.into_iter().zip(results) {
            let learn = shard.is_none() && self.learned.renews_in_store.is_none();
            let Some(term) = self.terms.get_mut(shard) else {
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
                        self.learned.renews_in_store = Some(kept_version);
                    }
                }
                Err(err) if err.is_conflict() => conflicts.push(shard),
                Err(err) => failed = Some(err),
            }
        }
        if renewed > 0 {
            m::renewed(&self.cx.config.name, took);
        }
        if let Some(err) = failed {
            self.cx.report("renew", &err);
        }
        conflicts
    }

    /// Ends the terms whose deadline passed (their timers have cancelled them already, or do
    /// so now).
    pub(super) fn drop_expired(&mut self) {
        let expired: Vec<u32> = self
            .terms
            .owned()
            .iter()
            .filter(|(_, t)| t.past_deadline())
            .map(|(&s, _)| s)
            .collect();
        for shard in expired {
            tracing::warn!(
                shards = self.cx.config.name,
                shard,
                "renew deadline passed: the shard's term ends"
            );
            self.end(shard, StepDownReason::RenewDeadlineExceeded);
        }
        if self.terms.member.as_ref().is_some_and(Term::past_deadline) {
            self.terms.member = None;
        }
    }
}

/// What [`Runner::reread`] found of the terms whose write conflicted.
#[derive(Default)]
pub(super) struct ReadBack {
    /// The terms still this member's, each with its renewal from the version read.
    pub(super) again: Vec<(Option<u32>, Renewal)>,
    /// The terms whose record could not be read, and why: they go on as they were.
    pub(super) unread: Vec<(Option<u32>, Arc<LockError>)>,
}
