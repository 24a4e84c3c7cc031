//! The lock: one election's key, its fence key and its waiting candidates on an [`EtcdStore`].
//! It drives the kept etcd leases (`lease.rs`), the watches (`watch.rs`) and the queue of
//! waiting candidates (`queue.rs`), and remembers what it learned of its keys (`seen.rs`).
//! Taking the lease is in `lock/acquire.rs`, a term's renewals and release in `lock/term.rs`,
//! the keys' reads and decoding in `lock/codec.rs`; this file holds the lock itself and its
//! `ResourceLock` face.

use std::fmt;
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnResponse};
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};
use tokio::sync::Mutex;

use crate::error::{BACKEND, map};
use crate::lease::KeptLease;
use crate::members::Members;
use crate::queue::Prepared;
use crate::seen::{RecordSeen, Seen, Takeover};
use crate::shared::SetShared;
use crate::store::EtcdStore;
use crate::watch::{TermWatch, changes};

mod acquire;
mod codec;
mod term;

use codec::parse_version;

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

/// Refuses an election name that is a key the lock keeps for another election
/// (`NAME.fence`, `NAME.extensions`, `NAME.candidates/IDENTITY`): its writes would overwrite
/// that election's fencing counter, extensions or queue (S8), and that election's writes its
/// record.
fn check_name(name: &str) -> Result<(), LockError> {
    let kept = [".fence", ".extensions"]
        .into_iter()
        .find(|suffix| name.ends_with(suffix))
        .or_else(|| name.contains(".candidates/").then_some(".candidates/"));
    match kept {
        None => Ok(()),
        Some(part) => Err(LockError::Misconfigured {
            backend: crate::error::BACKEND,
            message: format!(
                "election {name:?}: a name with {part} is a key the lock keeps for another election (NAME.fence, NAME.extensions, NAME.candidates/); choose another name"
            ),
        }),
    }
}

#[async_trait]
impl ResourceLock for EtcdLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        check_name(&self.name)?;
        Ok(self.read().await?.map(|(observed, _)| observed))
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        check_name(&self.name)?;
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
        check_name(&self.name)?;
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
        check_name(&self.name)?;
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
            .call(true, |client| async move {
                crate::watch::watch_client(&client).watch(key, None).await
            })
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
}
