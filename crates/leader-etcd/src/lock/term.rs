//! A term after its start: renewals (with the record, or with the etcd lease kept alive alone),
//! the release, the successor a release wakes, and what a term leaves clean.

use etcd_client::{
    Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use leader_core::backend::LockErrorExt;
use leader_core::{Acquisition, LeaderElectionRecord, LockError, Observed, ResourceLock, Version};

use super::codec::{parse_version, token_of};
use super::{EtcdLock, Term, conflict, revision_of};
use crate::queue::Successor;
use crate::seen::RecordSeen;

impl EtcdLock {
    /// Whether nobody else wrote the key after this term's write at `written`, as the term's
    /// watch (or its shard set member's) reports.
    pub(super) fn clean(&self, term: &Term, written: i64) -> bool {
        match (&term.watch, &self.shared) {
            (Some(watch), _) => watch.clean(written),
            (None, Some(shared)) => shared.clean(&self.key, written),
            (None, None) => false,
        }
    }

    /// Releases to `to` a record on this member's lease `lease` whose handover request names
    /// `to`: free, on no lease, reserved for `to`; reported held (reserved for another).
    pub(super) async fn release_as_asked(
        &self,
        observed: &Observed,
        lease: i64,
        to: &str,
    ) -> Result<Acquisition, LockError> {
        let expected = parse_version(&observed.version)?;
        let now = chrono::Utc::now();
        let freed = {
            let mut record = observed.record.clone();
            record.holder_identity = String::new();
            record.acquire_time = now;
            record.renew_time = now;
            record.preferred_holder = Some(to.to_owned());
            record
        };
        let key = self.key.as_str();
        let txn = Txn::new()
            .when([
                Compare::mod_revision(key, CompareOp::Equal, expected),
                Compare::lease(key, CompareOp::Equal, lease),
            ])
            .and_then([
                TxnOp::put(key, freed.to_json(), None),
                self.extensions_op(&freed),
            ]);
        let response = self.txn(txn).await?;
        if !response.succeeded() {
            return Err(conflict());
        }
        let revision = revision_of(&response);
        self.wrote(&freed, revision, 0);
        tracing::debug!(
            to,
            "released a shard to the candidate its handover request names"
        );
        Ok(Acquisition::Held {
            observed: Observed {
                record: freed,
                version: Version::from(revision),
            },
            renewed_in_store: false,
            expires_in: None,
        })
    }

    /// A shard set's renewal of this record after its member's leases were kept alive once
    /// for the round (`kept`, by lease): no request while the key is as this term wrote it,
    /// a transaction that rewrites it otherwise, an acquisition for a term this lock does not
    /// hold (as [`renew`](ResourceLock::renew)).
    pub(crate) async fn renew_kept(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
        kept: &std::collections::HashMap<i64, Result<bool, LockError>>,
    ) -> Result<Observed, LockError> {
        let expected = parse_version(version)?;
        let unchanged = matches!(
            self.seen().record,
            Some(RecordSeen::Present { mod_revision, .. }) if mod_revision <= expected
        );
        let held = {
            let term = self.term.lock().await;
            term.as_ref()
                .filter(|t| t.token == record.leader_transitions)
                .map(|t| {
                    let clean = unchanged && t.written == expected && self.clean(t, expected);
                    (t.lease.id(), clean)
                })
        };
        let Some((lease, clean)) = held else {
            return self.update(version, record).await;
        };
        let Some(alive) = kept.get(&lease) else {
            // Not a lease kept alive this round (replaced since): the renewal of one record.
            return self.renew(version, record).await;
        };
        match alive {
            Err(err) => Err(err.duplicate()),
            // The lease is gone, and the key with it.
            Ok(false) => Err(conflict()),
            Ok(true) if clean => Ok(Observed {
                record: record.clone(),
                version: version.clone(),
            }),
            Ok(true) => match self
                .renew_with_record_kept(expected, record, Some(Ok(true)))
                .await
            {
                Some(renewed) => renewed,
                None => self.update(version, record).await,
            },
        }
    }

    /// A full renewal of this lock's current term: keep-alive and a transaction that rewrites the
    /// record only if its version and its lease are still this term's, sent together. `None`
    /// when this lock holds no matching term.
    pub(super) async fn renew_with_record(
        &self,
        version: i64,
        record: &LeaderElectionRecord,
    ) -> Option<Result<Observed, LockError>> {
        self.renew_with_record_kept(version, record, None).await
    }

    /// [`renew_with_record`](Self::renew_with_record), with the lease's keep-alive of this
    /// round sent already when `kept` says how it went.
    pub(super) async fn renew_with_record_kept(
        &self,
        version: i64,
        record: &LeaderElectionRecord,
        kept: Option<Result<bool, LockError>>,
    ) -> Option<Result<Observed, LockError>> {
        let mut term = self.term.lock().await;
        let current = term
            .as_mut()
            .filter(|t| t.token == record.leader_transitions)?;
        let lease = current.lease.id();
        let json = record.to_json();
        let put = || {
            TxnOp::put(
                self.key.as_str(),
                json.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )
        };
        let mut txn = Txn::new()
            .when([
                Compare::mod_revision(self.key.as_str(), CompareOp::Equal, version),
                Compare::lease(self.key.as_str(), CompareOp::Equal, lease),
            ])
            .and_then([put(), self.extensions_op(record)]);
        if let Some(unconfirmed) = current.unconfirmed.take() {
            // The last write's answer was lost (its member failed) but it may have been
            // applied: then the key holds exactly it, on this term's lease.
            let applied = Txn::new()
                .when([
                    Compare::lease(self.key.as_str(), CompareOp::Equal, lease),
                    Compare::value(self.key.as_str(), CompareOp::Equal, unconfirmed),
                ])
                .and_then([put(), self.extensions_op(record)]);
            txn = txn.or_else([TxnOp::txn(applied)]);
        }
        let keep = async {
            match kept {
                Some(kept) => kept,
                None => current.lease.keep_alive(self).await,
            }
        };
        let (kept, written) = tokio::join!(keep, self.txn(txn));
        let succeeded = |response: &TxnResponse| {
            response.succeeded()
                || response.op_responses().into_iter().any(|op| match op {
                    TxnOpResponse::Txn(inner) => inner.succeeded(),
                    _ => false,
                })
        };
        let result = match (kept, written) {
            (_, Err(err)) => {
                if matches!(err, LockError::Unavailable { .. }) {
                    current.unconfirmed = Some(json);
                }
                Err(err)
            }
            (Ok(true), Ok(written)) if succeeded(&written) => {
                current.written = revision_of(&written);
                self.wrote(record, current.written, lease);
                Ok(Observed {
                    record: record.clone(),
                    version: Version::from(current.written),
                })
            }
            (Err(err), Ok(_)) => Err(err),
            _ => Err(conflict()),
        };
        Some(result)
    }

    /// Remembers this lock's own write of `record` at `revision` on `lease` (the fence is
    /// unchanged).
    pub(super) fn wrote(&self, record: &LeaderElectionRecord, revision: i64, lease: i64) {
        self.seen().wrote(record, revision, lease);
    }

    /// A release by this lock's term: hands the lease to a waiting candidate, or frees it.
    pub(super) async fn release(
        &self,
        expected: i64,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let unchanged = Compare::mod_revision(self.key.as_str(), CompareOp::Equal, expected);
        let free = TxnOp::put(self.key.as_str(), record.to_json(), None);
        let term = self.term.lock().await.take();
        let successor = match &term {
            Some(term) => self.successor(term, record).await,
            None => None,
        };
        let handed = successor.map(|next| {
            let wanted = term.as_ref().map_or(1, |t| t.token) + 1;
            (next.record(record, wanted), wanted, next)
        });
        let txn = match &handed {
            // Handed over in one write if the candidate still waits on that lease; freed
            // otherwise.
            Some((next_record, wanted, next)) => {
                let inner = next.hand_over(
                    &self.candidates,
                    (&self.key, &self.fence),
                    (next_record, *wanted),
                    free,
                );
                Txn::new()
                    .when([unchanged])
                    .and_then([TxnOp::txn(inner), self.extensions_op(record)])
            }
            None => Txn::new()
                .when([unchanged])
                .and_then([free, self.extensions_op(record)]),
        };
        let response = match self.txn(txn).await {
            Ok(response) => response,
            Err(err) => {
                // Unknown outcome: keep the term, whose lease expires if nobody renews it.
                *self.term.lock().await = term;
                return Err(err);
            }
        };
        if !response.succeeded() {
            *self.term.lock().await = term;
            return Err(conflict());
        }
        let revision = revision_of(&response);
        if let Some(term) = term {
            term.lease.revoke_later(&self.store);
        }
        let inner_handed = response.op_responses().into_iter().any(|op| match op {
            TxnOpResponse::Txn(inner) => inner.succeeded(),
            _ => false,
        });
        match handed {
            Some((next_record, wanted, next)) if inner_handed => {
                self.wrote(&next_record, revision, next.lease);
                tracing::debug!(to = %next.identity, "released the lease to the longest-waiting candidate");
                Ok(Observed {
                    record: {
                        let mut record = next_record;
                        record.leader_transitions =
                            token_of(wanted.to_string().as_bytes(), revision);
                        record
                    },
                    version: Version::from(revision),
                })
            }
            _ => {
                self.wrote(record, revision, 0);
                Ok(Observed {
                    record: record.clone(),
                    version: Version::from(revision),
                })
            }
        }
    }

    /// The candidate a release by `term` hands the lease to: the one a pending handover
    /// request names if it waits, else the longest-waiting one, never this one. From the term's
    /// watch when it knows of any, else from a read: a candidate that registered moments ago
    /// may not have reached the watch yet, and registrations arrive in order, so a watch that
    /// knows of one knows of every earlier one.
    pub(super) async fn successor(
        &self,
        term: &Term,
        record: &LeaderElectionRecord,
    ) -> Option<Successor> {
        // A shard set's members take what is released by reading the set.
        let watch = term.watch.as_ref()?;
        let known = watch
            .waiting()
            .filter(|w| w.iter().any(|c| c.identity != self.identity));
        let waiting = match known {
            Some(waiting) => waiting,
            // A serializable read, answered by the member without a round of consensus. A
            // stale answer, as a late watch event, is harmless: the release's transaction
            // checks that the candidate still waits on that lease, and frees the lease
            // otherwise.
            None => {
                let prefix = self.candidates.as_str();
                let read = self
                    .members()
                    .call(true, |mut client| async move {
                        let options = GetOptions::new().with_prefix().with_serializable();
                        client.get(prefix, Some(options)).await
                    })
                    .await
                    .ok()?;
                Successor::all_in(&self.candidates, &read).collect()
            }
        };
        Successor::next_in_line(waiting, &self.identity, record)
    }
}
