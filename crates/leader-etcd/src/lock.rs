//! The lock: one election's key, its fence key and its waiting candidates on an [`EtcdStore`].
//! It drives the kept etcd leases (`lease.rs`), the watches (`watch.rs`) and the queue of
//! waiting candidates (`queue.rs`), and remembers what it learned of its keys (`seen.rs`).

use std::fmt;
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Compare, CompareOp, GetOptions, GetResponse, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
    TxnResponse,
};
use leader_core::{
    Acquisition, ChangeStream, Known, LeaderElectionRecord, LockError, Observed, ResourceLock,
    Version,
};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::error::{BACKEND, map};
use crate::lease::{KeptLease, ttl};
use crate::members::Members;
use crate::queue::{Prepared, Successor};
use crate::seen::{RecordSeen, Seen, Takeover};
use crate::shared::SetShared;
use crate::store::EtcdStore;
use crate::watch::{TermWatch, changes};

impl EtcdStore {
    /// A lock on election `name` for candidate `identity`.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> EtcdLock {
        let name = name.into();
        let identity = identity.into();
        let candidates = format!("{}{name}.candidates/", self.inner.prefix);
        EtcdLock {
            store: self.clone(),
            key: format!("{}{name}", self.inner.prefix),
            fence: format!("{}{name}.fence", self.inner.prefix),
            kept: format!("{}{name}.extensions", self.inner.prefix),
            candidate: format!("{candidates}{identity}"),
            candidates,
            name,
            identity,
            term: Arc::new(Mutex::new(None)),
            prepared: Arc::new(Mutex::new(None)),
            seen: Arc::new(SyncMutex::new(Seen::default())),
            shared: None,
        }
    }
}

/// A [`ResourceLock`] on one etcd key.
///
/// - The record is the key's value (JSON); its version is the key's `mod_revision`. `create`
///   is a transaction on `create_revision == 0`, `update` one on `mod_revision == version`.
/// - The holder's key is attached to an etcd lease with a TTL of the lease duration (whole
///   seconds, rounded up; etcd grants at least its minimum TTL, 2 s with its default election
///   timeout), kept alive by the holder: a dead holder's key disappears on etcd's clock, and
///   [`try_acquire`](ResourceLock::try_acquire) takes the lease once it has.
/// - A renewal is the lease's keep-alive alone, one message, while the key is as the holder
///   wrote it; the holder watches its key during its term to know that. After any other write
///   (a handover request, say), or while that watch is not running, a renewal is the keep-alive
///   and a transaction that rewrites the record only if its version and its lease are still this
///   term's. Followers never take over on their own clock: they wait for etcd to expire the key
///   or for a release ([`Acquisition::Held`]'s `renewed_in_store`).
/// - A follower grants its etcd lease in advance, keeps it alive, and registers on it as a
///   waiting candidate (`NAME.candidates/IDENTITY`). A release hands the lease straight to the
///   longest-waiting candidate (or to the one a handover request names) in the same
///   transaction, with the next fencing token: the candidate starts leading as soon as its watch
///   reports it, without a request ([`Acquisition::Handed`]: its term counts from its lease's
///   last keep-alive). Without a waiting candidate, a release frees the lease, and
///   a follower that saw it freed or expired takes it in one transaction. A candidate that stops
///   ([`ResourceLock::close`]) revokes its lease, and its registration goes with it; one that
///   dies leaves it until its lease runs out (as with etcd's own election service).
/// - The fencing token comes from etcd itself: every acquisition also writes the key
///   `NAME.fence`, and the token is that write's revision, a cluster-wide counter (or the value
///   the elector asked for, if higher), so it grows on every acquisition.
/// - Followers watch the key, so a release, an expiry or a handover to them wakes them at once.
/// - A handover request written for the holder keeps the key on the holder's etcd lease; if the
///   holder dies before it releases, the key (and the request) expires with it.
#[derive(Clone, Debug)]
pub struct EtcdLock {
    store: EtcdStore,
    name: String,
    identity: String,
    key: String,
    fence: String,
    /// The extensions key: the last record written that had extensions, on no etcd lease, so
    /// that they outlive a holder whose key expired with it.
    kept: String,
    /// The prefix of the waiting candidates' keys, and this candidate's own.
    candidates: String,
    candidate: String,
    /// This lock's current term: its etcd lease and keep-alive stream, and its fencing token.
    term: Arc<Mutex<Option<Term>>>,
    /// A follower's etcd lease, granted in advance for its next acquisition.
    prepared: Arc<Mutex<Option<Prepared>>>,
    /// The key and the fence key as last read or reported by a watch.
    seen: Arc<SyncMutex<Seen>>,
    /// For a record of a shard set: the etcd lease and the watch its member's records share
    /// (no lease per term, no term watch, no candidates waiting).
    shared: Option<Arc<SetShared>>,
}

/// The etcd lease a term's key is on.
enum TermLease {
    /// Its own, kept alive by the term.
    Own(KeptLease),
    /// Its shard set member's, kept alive once per round for all its records.
    Shared(i64),
}

impl TermLease {
    fn id(&self) -> i64 {
        match self {
            Self::Own(lease) => lease.id,
            Self::Shared(id) => *id,
        }
    }

    /// Revokes an own lease in the background; a shared one stays, for the other records.
    fn revoke_later(&self, store: &EtcdStore) {
        if let Self::Own(lease) = self {
            lease.revoke_later(store);
        }
    }

    /// One keep-alive for `lock`'s term: `true` if the lease (and so the key on it) is still
    /// alive.
    async fn keep_alive(&mut self, lock: &EtcdLock) -> Result<bool, LockError> {
        match (self, lock.shared.as_deref()) {
            (Self::Own(lease), _) => lease
                .keep_alive(&lock.store)
                .await
                .map_err(|err| map(&lock.context(), err)),
            (Self::Shared(id), Some(shared)) => shared.keep_alive(*id).await,
            (Self::Shared(_), None) => Ok(false),
        }
    }
}

struct Term {
    lease: TermLease,
    token: u64,
    /// The revision of this term's last write of the record.
    written: i64,
    /// The record of this term's last write whose outcome is unknown (its answer was lost):
    /// the next full renewal also succeeds if the key still holds exactly that, on this
    /// term's lease, which only that write can have left.
    unconfirmed: Option<Vec<u8>>,
    /// What the term's watch of the key has seen (none for a shard set's record: its
    /// member's set watch).
    watch: Option<TermWatch>,
}

impl fmt::Debug for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Term")
            .field("lease", &self.lease.id())
            .field("token", &self.token)
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

fn conflict() -> LockError {
    LockError::conflict(BACKEND)
}

fn revision_of(response: &TxnResponse) -> i64 {
    response.header().map_or(0, |h| h.revision())
}

/// What a follower does with the keys as read.
enum Decision {
    /// Take the key as this says.
    Take(Takeover),
    /// Someone else holds it, or it is reserved for someone else.
    Held(Acquisition),
}

impl EtcdLock {
    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The key that holds the record.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The etcd lease of this lock's current term, if it holds one: what `etcdctl lease revoke`
    /// takes.
    pub async fn lease_id(&self) -> Option<i64> {
        self.term.lock().await.as_ref().map(|t| t.lease.id())
    }

    /// This lock as a record of a shard set whose member's records share `shared`.
    pub(crate) fn in_set(mut self, shared: Arc<SetShared>) -> Self {
        self.shared = Some(shared);
        self
    }
}

#[async_trait]
impl ResourceLock for EtcdLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        Ok(self.read().await?.map(|(observed, _)| observed))
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let absent = Compare::create_revision(self.key.as_str(), CompareOp::Equal, 0);
        if record.is_free() {
            return self.put_if(absent, record, None).await;
        }
        self.acquire(absent, record).await
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let expected = parse_version(version)?;
        let unchanged = Compare::mod_revision(self.key.as_str(), CompareOp::Equal, expected);
        if record.is_free() {
            // A release: handed to a waiting candidate, or freed (the record stays, detached
            // from any lease); this term's lease goes.
            return self.release(expected, record).await;
        }
        if record.holder_identity != self.identity {
            // On the holder's behalf (a handover request): the key keeps the holder's etcd
            // lease, so it still expires with the holder.
            let keep_lease = PutOptions::new().with_ignore_lease();
            return self.put_if(unchanged, record, Some(keep_lease)).await;
        }
        if let Some(renewed) = self.renew_with_record(expected, record).await {
            return renewed;
        }
        // A new holder, or a new term of this one: an acquisition with the next token.
        self.acquire(unchanged, record).await
    }

    /// The lease's keep-alive alone (one message) while the key is as this term wrote it;
    /// otherwise a full renewal, which fails if anyone else wrote the key.
    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let expected = parse_version(version)?;
        // Both watches must have seen nothing newer: the term's own, and the change stream the
        // elector listens to, which may report a write (a handover request) first.
        let unchanged = matches!(
            self.seen().record,
            Some(RecordSeen::Present { mod_revision, .. }) if mod_revision <= expected
        );
        {
            let mut term = self.term.lock().await;
            if let Some(current) = term
                .as_mut()
                .filter(|t| t.token == record.leader_transitions)
                && unchanged
                && current.written == expected
                && self.clean(current, expected)
            {
                return match current.lease.keep_alive(self).await {
                    Ok(true) => Ok(Observed {
                        record: record.clone(),
                        version: version.clone(),
                    }),
                    // The lease is gone, and the key with it.
                    Ok(false) => Err(conflict()),
                    Err(err) => Err(err),
                };
            }
        }
        self.update(version, record).await
    }

    /// Without a request when a release handed the lease to this candidate (as its watch or a
    /// read reported); one transaction when the key was last seen released, expired or absent (by a
    /// read or the watch), on a lease granted in advance; otherwise a read first.
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        if let Some(shared) = &self.shared {
            return self.try_acquire_in_set(shared, desired).await;
        }
        let (mut prepared, due) = self.prepared_lease(desired).await?;
        if let Some(handed) = self.adopt(&mut prepared).await {
            return Ok(Some(handed));
        }
        let mut plan = self.takeover(desired);
        if plan.is_none() {
            // Not seen takeable: read (and keep the prepared lease alive in the same round
            // trip, when due).
            let keep = async {
                if let Some(p) = prepared.as_mut().filter(|_| due) {
                    let _ = p.lease.keep_alive(&self.store).await;
                }
            };
            let (current, ()) = tokio::join!(self.read(), keep);
            let current = current?;
            if let Some(handed) = self.adopt(&mut prepared).await {
                return Ok(Some(handed));
            }
            match self.decide(current, desired) {
                Decision::Take(takeover) => plan = Some(takeover),
                Decision::Held(held) => return Ok(Some(held)),
            }
        }
        for _ in 0..2 {
            let Some(takeover) = plan.take() else {
                break;
            };
            let Some(ready) = prepared.as_mut() else {
                return Err(conflict());
            };
            let (txn, record, wanted) = self.takeover_txn(takeover, desired, ready.lease.id);
            // The lease granted in advance is kept alive in the same round trip: its TTL then
            // runs from after this attempt began, so it outlasts the elector's renew deadline
            // as a fresh lease would (S3).
            let (kept, response) = tokio::join!(ready.lease.keep_alive(&self.store), self.txn(txn));
            let response = response?;
            if response.succeeded() {
                let Some(taken) = prepared.take() else {
                    return Err(conflict());
                };
                if !kept.unwrap_or(false) {
                    // Taken on a lease that may run out early: give it up (the key goes with
                    // it) rather than lead on it.
                    taken.lease.revoke_later(&self.store);
                    return Err(LockError::unavailable(
                        BACKEND,
                        "the lease granted in advance could not be kept alive".to_owned(),
                    ));
                }
                let observed = self
                    .begin_term(
                        TermLease::Own(taken.lease),
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
        // Changed under two attempts in a row: the elector comes back soon.
        Err(conflict())
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let key = self.key.as_str();
        let stream = self
            .members()
            .call(
                true,
                |mut client| async move { client.watch(key, None).await },
            )
            .await
            .map_err(|err| map(&self.context(), err))?;
        Ok(Some(changes(
            stream,
            self.seen.clone(),
            self.identity.clone(),
        )))
    }

    /// The holder's etcd lease's TTL, as etcd's `LeaseTimeToLive` tells it (whole seconds).
    async fn time_left(&self) -> Result<Option<Duration>, LockError> {
        let Some((observed, lease)) = self.read().await? else {
            return Ok(None);
        };
        if lease == 0 || observed.record.is_free() {
            return Ok(None);
        }
        let response = self
            .members()
            .call(true, |mut client| async move {
                client.lease_time_to_live(lease, None).await
            })
            .await
            .map_err(|err| map(&self.context(), err))?;
        Ok(u64::try_from(response.ttl()).ok().map(Duration::from_secs))
    }

    /// Revokes the lease granted in advance: its registration as a waiting candidate goes with
    /// it, so no release hands the lease to a candidate that stopped.
    async fn close(&self) {
        let prepared = self.prepared.lock().await.take();
        if let Some(prepared) = prepared {
            let lease = prepared.lease.id;
            let _ = self
                .members()
                .call(true, |mut client| async move {
                    client.lease_revoke(lease).await
                })
                .await;
        }
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("etcd:{}", self.key)
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }
}

impl EtcdLock {
    fn context(&self) -> String {
        format!("{} key {}", self.store.inner.endpoints, self.key)
    }

    fn members(&self) -> &Members {
        &self.store.inner.members
    }

    /// Whether nobody else wrote the key after this term's write at `written`, as the term's
    /// watch (or its shard set member's) reports.
    fn clean(&self, term: &Term, written: i64) -> bool {
        match (&term.watch, &self.shared) {
            (Some(watch), _) => watch.clean(written),
            (None, Some(shared)) => shared.clean(&self.key, written),
            (None, None) => false,
        }
    }

    /// An acquisition of a shard set's record on its member's shared lease: one transaction
    /// when the key was last seen takeable (released, expired or absent), else a read first.
    async fn try_acquire_in_set(
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

    /// Releases to `to` a record on this member's lease `lease` whose handover request names
    /// `to`: free, on no lease, reserved for `to`; reported held (reserved for another).
    async fn release_as_asked(
        &self,
        observed: &Observed,
        lease: i64,
        to: &str,
    ) -> Result<Acquisition, LockError> {
        let expected = parse_version(&observed.version)?;
        let now = chrono::Utc::now();
        let freed = LeaderElectionRecord {
            holder_identity: String::new(),
            acquire_time: now,
            renew_time: now,
            preferred_holder: Some(to.to_owned()),
            ..observed.record.clone()
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

    /// The transaction of `takeover` by `desired` on `lease`, with the record it writes and
    /// the token it asks for: the acquisition's writes if the keys are still as seen, else a
    /// read of them.
    fn takeover_txn(
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
    fn decide_after(
        &self,
        response: &TxnResponse,
        desired: &LeaderElectionRecord,
    ) -> Result<Decision, LockError> {
        let (record, fence, kept) = split_gets(response);
        let current = self.decode(record, fence, kept)?;
        Ok(self.decide(current, desired))
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

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A transaction that writes: sent once, to the member the store talks to (a write whose
    /// outcome is unknown is not repeated; the elector's next attempt goes to the next member
    /// if this one failed).
    async fn txn(&self, txn: Txn) -> Result<TxnResponse, LockError> {
        self.send(false, txn).await
    }

    /// A transaction that only reads: sent to the next member at once if this one fails.
    async fn read_txn(&self, txn: Txn) -> Result<TxnResponse, LockError> {
        self.send(true, txn).await
    }

    async fn send(&self, repeatable: bool, txn: Txn) -> Result<TxnResponse, LockError> {
        let response = self
            .members()
            .call(repeatable, |mut client| {
                let txn = txn.clone();
                async move { client.txn(txn).await }
            })
            .await
            .map_err(|err| map(&self.context(), err))?;
        // A set's reads from its watch wait for the watch to report this write.
        if let Some(shared) = &self.shared
            && !repeatable
            && response.succeeded()
        {
            shared.wrote(revision_of(&response));
        }
        Ok(response)
    }

    /// Writes `record` if `condition` holds (a conflict otherwise), without a term of its own.
    async fn put_if(
        &self,
        condition: Compare,
        record: &LeaderElectionRecord,
        options: Option<PutOptions>,
    ) -> Result<Observed, LockError> {
        let put = TxnOp::put(self.key.as_str(), record.to_json(), options);
        let response = self
            .txn(
                Txn::new()
                    .when([condition])
                    .and_then([put, self.extensions_op(record)]),
            )
            .await?;
        if !response.succeeded() {
            return Err(conflict());
        }
        Ok(Observed {
            record: record.clone(),
            version: Version::from(revision_of(&response)),
        })
    }

    fn gets(&self) -> [TxnOp; 3] {
        [
            TxnOp::get(self.key.as_str(), None),
            TxnOp::get(self.fence.as_str(), None),
            TxnOp::get(self.kept.as_str(), None),
        ]
    }

    /// The write of the extensions key that goes with every write of `record`: the record
    /// itself, on no lease, when it has extensions; the key deleted when it has none.
    fn extensions_op(&self, record: &LeaderElectionRecord) -> TxnOp {
        if record.extensions.is_empty() {
            TxnOp::delete(self.kept.as_str(), None)
        } else {
            TxnOp::put(self.kept.as_str(), record.to_json(), None)
        }
    }

    async fn read(&self) -> Result<Option<(Observed, i64)>, LockError> {
        let response = self.read_txn(Txn::new().and_then(self.gets())).await?;
        let (record, fence, kept) = split_gets(&response);
        self.decode(record, fence, kept)
    }

    /// The record and fence keys, as read together by a transaction's `get`s; remembers them.
    fn decode(
        &self,
        record: Option<GetResponse>,
        fence: Option<GetResponse>,
        kept: Option<GetResponse>,
    ) -> Result<Option<(Observed, i64)>, LockError> {
        let first = |r: &Option<GetResponse>| r.as_ref().and_then(|r| r.kvs().first()).cloned();
        self.decode_kvs(
            first(&record).as_ref(),
            first(&fence).as_ref(),
            first(&kept).as_ref(),
        )
    }

    /// The keys of this election (record, fence, extensions) as one read found them, for a
    /// shard set's read of many: the record, as [`get`](ResourceLock::get) answers it.
    pub(crate) fn absorb(
        &self,
        keys: &std::collections::HashMap<Vec<u8>, KeyValue>,
    ) -> Result<Option<Observed>, LockError> {
        let kv = |key: &str| keys.get(key.as_bytes());
        Ok(self
            .decode_kvs(kv(&self.key), kv(&self.fence), kv(&self.kept))?
            .map(|(observed, _)| observed))
    }

    /// Whether the keys of this election are as this lock last learned them and as a reader
    /// holding `known` holds the record: a shard set's read may answer it unchanged. A record
    /// renewed through its member's etcd lease keeps its revision, so most records of a set
    /// are, round after round.
    pub(crate) fn unchanged(
        &self,
        keys: &std::collections::HashMap<Vec<u8>, KeyValue>,
        known: &Known<'_>,
    ) -> bool {
        let revision = |key: &str| keys.get(key.as_bytes()).map_or(0, KeyValue::mod_revision);
        let seen = self.seen();
        if seen.fence.is_none_or(|(_, at)| at != revision(&self.fence))
            || seen
                .kept
                .as_ref()
                .is_none_or(|(_, at)| *at != revision(&self.kept))
        {
            return false;
        }
        match (known, keys.get(self.key.as_bytes()), &seen.record) {
            (Known::Absent, None, Some(RecordSeen::Absent)) => true,
            (Known::Version(version), Some(kv), Some(RecordSeen::Present { mod_revision, .. })) => {
                *mod_revision == kv.mod_revision()
                    && version.as_str().parse() == Ok(kv.mod_revision())
            }
            _ => false,
        }
    }

    fn decode_kvs(
        &self,
        record: Option<&KeyValue>,
        fence_kv: Option<&KeyValue>,
        kept_kv: Option<&KeyValue>,
    ) -> Result<Option<(Observed, i64)>, LockError> {
        let token = fence_kv.map_or(0, |kv| token_of(kv.value(), kv.mod_revision()));
        let mut seen = self.seen();
        seen.fence = Some((token, fence_kv.map_or(0, KeyValue::mod_revision)));
        // A value that is not a record keeps nothing (the record key's own value is checked).
        // A revision is one write: what was learned of it holds (a shard set reads its keys
        // every round, and most are as they were).
        let kept_revision = kept_kv.map_or(0, KeyValue::mod_revision);
        if seen
            .kept
            .as_ref()
            .is_none_or(|(_, at)| *at != kept_revision)
        {
            let extensions = kept_kv
                .and_then(|kv| LeaderElectionRecord::from_json(BACKEND, "", kv.value()).ok())
                .map(|r| r.extensions)
                .unwrap_or_default();
            seen.kept = Some((extensions, kept_revision));
        }
        let Some(kv) = record else {
            seen.record = Some(RecordSeen::Absent);
            return Ok(None);
        };
        let stored = match &seen.record {
            Some(RecordSeen::Present {
                mod_revision,
                record,
                decoded: true,
                ..
            }) if *mod_revision == kv.mod_revision() => record.clone(),
            _ => {
                seen.record = None;
                let stored = LeaderElectionRecord::from_json(BACKEND, &self.context(), kv.value())?;
                seen.record = Some(RecordSeen::Present {
                    mod_revision: kv.mod_revision(),
                    lease: kv.lease(),
                    record: stored.clone(),
                    decoded: true,
                });
                stored
            }
        };
        Ok(Some((
            Observed {
                record: LeaderElectionRecord {
                    leader_transitions: token,
                    ..stored
                },
                version: Version::from(kv.mod_revision()),
            },
            kv.lease(),
        )))
    }

    /// This follower's lease for its next acquisition, prepared once and then kept alive:
    /// `true` beside it when a keep-alive is due (a third of its TTL since the last), which the
    /// caller sends together with its own request.
    async fn prepared_lease(
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
    async fn adopt(&self, prepared: &mut Option<Prepared>) -> Option<Acquisition> {
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
    fn takeover(&self, desired: &LeaderElectionRecord) -> Option<Takeover> {
        self.seen()
            .takeover((&self.key, &self.fence, &self.kept), desired)
    }

    /// What to do with the key as read: take it when it was seen takeable (absent or free), or
    /// report it held, also when it is held by this identity (S13: another process may run
    /// with it; the elector takes a term of its own again with an update).
    fn decide(&self, current: Option<(Observed, i64)>, desired: &LeaderElectionRecord) -> Decision {
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
    fn acquisition_ops(
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
    async fn begin_term(
        &self,
        lease: TermLease,
        record: &LeaderElectionRecord,
        revision: i64,
        wanted: u64,
    ) -> Observed {
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
        let stored = LeaderElectionRecord {
            leader_transitions: wanted,
            ..record.clone()
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
            record: LeaderElectionRecord {
                leader_transitions: token,
                ..record.clone()
            },
            version: Version::from(revision),
        }
    }

    /// An acquisition with a new lease, if `condition` holds (the path of `create` and `update`).
    async fn acquire(
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

    /// A full renewal of this lock's current term: keep-alive and a transaction that rewrites the
    /// record only if its version and its lease are still this term's, sent together. `None`
    /// when this lock holds no matching term.
    async fn renew_with_record(
        &self,
        version: i64,
        record: &LeaderElectionRecord,
    ) -> Option<Result<Observed, LockError>> {
        self.renew_with_record_kept(version, record, None).await
    }

    /// [`renew_with_record`](Self::renew_with_record), with the lease's keep-alive of this
    /// round sent already when `kept` says how it went.
    async fn renew_with_record_kept(
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
    fn wrote(&self, record: &LeaderElectionRecord, revision: i64, lease: i64) {
        self.seen().wrote(record, revision, lease);
    }

    /// A release by this lock's term: hands the lease to a waiting candidate, or frees it.
    async fn release(
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
                    record: LeaderElectionRecord {
                        leader_transitions: token_of(wanted.to_string().as_bytes(), revision),
                        ..next_record
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
    async fn successor(&self, term: &Term, record: &LeaderElectionRecord) -> Option<Successor> {
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

/// The `get` responses of a transaction, in order.
fn split_gets(
    response: &TxnResponse,
) -> (
    Option<GetResponse>,
    Option<GetResponse>,
    Option<GetResponse>,
) {
    let mut gets = response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        });
    (gets.next(), gets.next(), gets.next())
}

/// The fencing token from the fence key: its revision, or the value the elector asked for if
/// higher.
fn token_of(value: &[u8], revision: i64) -> u64 {
    let asked = std::str::from_utf8(value)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    asked.max(u64::try_from(revision).unwrap_or(0))
}

fn parse_version(version: &Version) -> Result<i64, LockError> {
    version.as_str().parse().map_err(|_| conflict())
}
