//! Taking the lease: the decision on what the store holds, the etcd lease of the term made
//! ready beforehand, the transaction that takes the key (alone or in a shard set's batch), and
//! the start of the term.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnResponse};
use leader_core::{Acquisition, LeaderElectionRecord, LockError, Observed, Version};
use tokio::time::Instant;

use super::codec::{split_gets, token_of};
use super::{Decision, EtcdLock, Term, TermLease, conflict, revision_of};
use crate::error::map;
use crate::lease::{KeptLease, ttl};
use crate::queue::Prepared;
use crate::seen::{RecordSeen, Takeover};
use crate::shared::SetShared;
use crate::watch::TermWatch;

impl EtcdLock {
    /// An acquisition of a shard set's record on its member's shared lease: one transaction
    /// when the key was last seen takeable (released, expired or absent), else a read first.
    pub(super) async fn try_acquire_in_set(
        &self,
        shared: &SetShared,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let started = Instant::now();
        let mut plan = self.takeover(desired);
        if plan.is_none() {
            let current = self.read().await?;
            // A record of this member's on its own lease (a term its runner let lapse, whose
            // record that lease keeps alive with the others): no other process has that lease
            // (S13), so it takes the record again, with the next token.
            let mine = match &current {
                Some((observed, lease)) if shared.owns(*lease).await => {
                    // Unless a handover request names another candidate (which ended the term
                    // it was written under): released to that one, as the end of the lease
                    // would have let it take the shard.
                    if let Some(to) = observed
                        .record
                        .reserved_for_other_than(&self.identity)
                        .then(|| observed.record.handover_to())
                        .flatten()
                    {
                        return self.release_as_asked(observed, *lease, to).await.map(Some);
                    }
                    self.seen()
                        .retake((&self.key, &self.fence), *lease, desired)
                }
                _ => None,
            };
            match mine {
                Some(retake) => plan = Some(retake),
                None => match self.decide(current, desired) {
                    Decision::Take(takeover) => plan = Some(takeover),
                    Decision::Held(held) => return Ok(Some(held)),
                },
            }
        }
        for _ in 0..2 {
            let Some(takeover) = plan.take() else {
                break;
            };
            // Confirmed alive since this attempt began: the term's deadline, counted from
            // then, comes before the lease can run out (S3).
            let lease = shared.lease_since(desired.lease_duration, started).await?;
            let (txn, record, wanted) = self.takeover_txn(takeover, desired, lease);
            let response = self.txn(txn).await?;
            if response.succeeded() {
                let observed = self
                    .begin_term(
                        TermLease::Shared(lease),
                        &record,
                        revision_of(&response),
                        wanted,
                    )
                    .await;
                return Ok(Some(Acquisition::Acquired(observed)));
            }
            match self.decide_after(&response, desired)? {
                Decision::Take(takeover) => plan = Some(takeover),
                Decision::Held(held) => return Ok(Some(held)),
            }
        }
        Err(conflict())
    }

    /// The transaction of `takeover` by `desired` on `lease`, with the record it writes and
    /// the token it asks for: the acquisition's writes if the keys are still as seen, else a
    /// read of them.
    pub(super) fn takeover_txn(
        &self,
        takeover: Takeover,
        desired: &LeaderElectionRecord,
        lease: i64,
    ) -> (Txn, LeaderElectionRecord, u64) {
        let Takeover {
            conditions,
            wanted,
            extensions,
        } = takeover;
        let mut record = desired.clone();
        record.leader_transitions = wanted;
        record.extensions = extensions;
        let txn = Txn::new()
            .when(conditions)
            .and_then(self.acquisition_ops(&record, lease, wanted))
            .or_else(self.gets());
        (txn, record, wanted)
    }

    /// What to do after a takeover transaction lost: it read the keys instead; decide again
    /// from them.
    pub(super) fn decide_after(
        &self,
        response: &TxnResponse,
        desired: &LeaderElectionRecord,
    ) -> Result<Decision, LockError> {
        let (record, fence, kept) = split_gets(response);
        let current = self.decode(record, fence, kept)?;
        Ok(self.decide(current, desired))
    }

    /// This follower's lease for its next acquisition, prepared once and then kept alive:
    /// `true` beside it when a keep-alive is due (a third of its TTL since the last), which the
    /// caller sends together with its own request.
    pub(super) async fn prepared_lease(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<(tokio::sync::MutexGuard<'_, Option<Prepared>>, bool), LockError> {
        let mut prepared = self.prepared.lock().await;
        let ttl = ttl(desired.lease_duration);
        let period = Duration::from_secs(u64::try_from(ttl).unwrap_or(1));
        // A lease of another duration, or one that may have run out (the follower slept), is
        // replaced.
        let replace = prepared
            .as_ref()
            .is_some_and(|p| p.lease.ttl != ttl || p.lease.alive_since.elapsed() >= period);
        if replace && let Some(old) = prepared.take() {
            old.lease.revoke_later(&self.store);
        }
        if prepared.is_none() {
            let registered =
                Prepared::register(&self.store, &self.candidate, desired.lease_duration)
                    .await
                    .map_err(|err| map(&self.context(), err))?;
            *prepared = Some(registered);
        }
        let due = prepared
            .as_ref()
            .is_some_and(|p| p.lease.alive_since.elapsed() >= period / 3);
        Ok((prepared, due))
    }

    /// The lease handed to this candidate by a release, as last seen: the record names it and
    /// sits on its prepared lease. Starts the term without a request; the term counts from
    /// when etcd last confirmed that lease alive (the elector renews first if that leaves too
    /// little).
    pub(super) async fn adopt(&self, prepared: &mut Option<Prepared>) -> Option<Acquisition> {
        let Some(RecordSeen::Present {
            mod_revision,
            lease,
            record,
            ..
        }) = self.seen().record.clone()
        else {
            return None;
        };
        if record.holder_identity != self.identity
            || prepared.as_ref().is_none_or(|p| p.lease.id != lease)
        {
            return None;
        }
        let taken = prepared.take()?;
        let alive_since = taken.lease.alive_since;
        let wanted = record.leader_transitions;
        let observed = self
            .begin_term(TermLease::Own(taken.lease), &record, mod_revision, wanted)
            .await;
        Some(Acquisition::Handed {
            observed,
            alive_since,
        })
    }

    /// The conditions under which `desired` may take the key as last seen, with the token it
    /// should ask for; `None` when the key was not seen takeable.
    pub(super) fn takeover(&self, desired: &LeaderElectionRecord) -> Option<Takeover> {
        self.seen()
            .takeover((&self.key, &self.fence, &self.kept), desired)
    }

    /// What to do with the key as read: take it when it was seen takeable (absent or free), or
    /// report it held, also when it is held by this identity (S13: another process may run
    /// with it; the elector takes a term of its own again with an update).
    pub(super) fn decide(
        &self,
        current: Option<(Observed, i64)>,
        desired: &LeaderElectionRecord,
    ) -> Decision {
        if let Some(takeover) = self.takeover(desired) {
            return Decision::Take(takeover);
        }
        match current {
            Some((observed, key_lease)) => Decision::Held(Acquisition::Held {
                // etcd expires the key itself (its watch reports the deletion): no time to wait
                // for, and while the key is on a lease only etcd's expiry or a release frees it.
                renewed_in_store: key_lease != 0 && !observed.record.is_free(),
                observed,
                expires_in: None,
            }),
            // Absent keys are always takeable; this is not reached.
            None => Decision::Take(Takeover {
                conditions: vec![Compare::create_revision(
                    self.key.as_str(),
                    CompareOp::Equal,
                    0,
                )],
                wanted: desired.leader_transitions.max(1),
                extensions: Default::default(),
            }),
        }
    }

    /// The writes of an acquisition by this candidate on `lease`: the record, the fence key,
    /// and its registration as a waiting candidate gone (it leads now).
    pub(super) fn acquisition_ops(
        &self,
        record: &LeaderElectionRecord,
        lease: i64,
        wanted: u64,
    ) -> [TxnOp; 4] {
        [
            TxnOp::put(
                self.key.as_str(),
                record.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::put(self.fence.as_str(), wanted.to_string(), None),
            TxnOp::delete(self.candidate.as_str(), None),
            self.extensions_op(record),
        ]
    }

    /// Starts this term on `lease`: the acquisition wrote at `revision` with the token asked
    /// for, `wanted`. Watches the key from the next revision, so that renewals know whether
    /// anyone else wrote it.
    pub(super) async fn begin_term(
        &self,
        lease: TermLease,
        record: &LeaderElectionRecord,
        revision: i64,
        wanted: u64,
    ) -> Observed {
        self.store.check_release();
        let token = token_of(wanted.to_string().as_bytes(), revision);
        let watch = match &self.shared {
            Some(shared) => {
                shared.watch_from(revision);
                None
            }
            None => Some(TermWatch::start(
                self.store.clone(),
                self.key.clone(),
                self.candidates.clone(),
                revision,
            )),
        };
        let stored = {
            let mut record = record.clone();
            record.leader_transitions = wanted;
            record
        };
        {
            let mut seen = self.seen();
            seen.fence = Some((token, revision));
            seen.kept = Some(if stored.extensions.is_empty() {
                (Default::default(), 0)
            } else {
                (stored.extensions.clone(), revision)
            });
            seen.record = Some(RecordSeen::Present {
                mod_revision: revision,
                lease: lease.id(),
                record: stored,
                decoded: false,
            });
        }
        let previous = self.term.lock().await.replace(Term {
            lease,
            token,
            written: revision,
            unconfirmed: None,
            watch,
        });
        if let Some(previous) = previous {
            previous.lease.revoke_later(&self.store);
        }
        Observed {
            record: {
                let mut record = record.clone();
                record.leader_transitions = token;
                record
            },
            version: Version::from(revision),
        }
    }

    /// An acquisition with a new lease, if `condition` holds (the path of `create` and `update`).
    pub(super) async fn acquire(
        &self,
        condition: Compare,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let mut conditions = vec![condition];
        let mut record = record.clone();
        // A record gone with its holder's etcd lease left its extensions in the extensions
        // key: carried on, if that key is still as last read.
        if matches!(self.seen().record, Some(RecordSeen::Absent))
            && record.extensions.is_empty()
            && let Some((kept, kept_revision)) = self.seen().kept.clone()
        {
            record.extensions = kept;
            conditions.push(Compare::mod_revision(
                self.kept.as_str(),
                CompareOp::Equal,
                kept_revision,
            ));
        }
        let record = &record;
        let lease = match &self.shared {
            Some(shared) => TermLease::Shared(
                shared
                    .lease_since(record.lease_duration, Instant::now())
                    .await?,
            ),
            None => TermLease::Own(
                KeptLease::grant(&self.store, record.lease_duration)
                    .await
                    .map_err(|err| map(&self.context(), err))?,
            ),
        };
        let wanted = record.leader_transitions.max(1);
        let txn =
            Txn::new()
                .when(conditions)
                .and_then(self.acquisition_ops(record, lease.id(), wanted));
        match self.txn(txn).await {
            Ok(response) if response.succeeded() => Ok(self
                .begin_term(lease, record, revision_of(&response), wanted)
                .await),
            other => {
                lease.revoke_later(&self.store);
                Err(other.err().unwrap_or_else(conflict))
            }
        }
    }
}
