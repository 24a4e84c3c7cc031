//! The lock: one election's key, its fence key and its waiting candidates on an [`EtcdStore`].

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, GetResponse, KeyValue, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchOptions,
};
use futures_util::StreamExt;
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::error::{BACKEND, map};
use crate::store::EtcdStore;

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
            candidate: format!("{candidates}{identity}"),
            candidates,
            name,
            identity,
            term: Arc::new(Mutex::new(None)),
            prepared: Arc::new(Mutex::new(None)),
            seen: Arc::new(SyncMutex::new(Seen::default())),
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
    /// The prefix of the waiting candidates' keys, and this candidate's own.
    candidates: String,
    candidate: String,
    /// This lock's current term: its etcd lease and keep-alive stream, and its fencing token.
    term: Arc<Mutex<Option<Term>>>,
    /// A follower's etcd lease, granted in advance for its next acquisition.
    prepared: Arc<Mutex<Option<Prepared>>>,
    /// The key and the fence key as last read or reported by a watch.
    seen: Arc<SyncMutex<Seen>>,
}

/// An etcd lease with its keep-alive stream.
struct KeptLease {
    id: i64,
    ttl: i64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
    /// When etcd last confirmed it alive for its whole TTL: the sending of that request (etcd
    /// restarts the TTL when the request arrives, later).
    alive_since: Instant,
    /// Keep-alives sent whose answers were not read (their callers gave up waiting).
    unanswered: usize,
}

impl KeptLease {
    /// One keep-alive: `true` if the lease is still alive.
    ///
    /// Answers carry no request id, so the answers to keep-alives whose callers gave up (a
    /// timeout) are read and dropped first: an answer is never taken for a later request's.
    async fn keep_alive(&mut self) -> Result<bool, etcd_client::Error> {
        while self.unanswered > 0 {
            self.stream.message().await?;
            self.unanswered -= 1;
        }
        let sent = Instant::now();
        // A send that does not complete sends nothing (the channel's send is cancel-safe).
        self.keeper.keep_alive().await?;
        self.unanswered += 1;
        let answer = self.stream.message().await?;
        self.unanswered -= 1;
        let alive = answer.is_some_and(|r| r.ttl() > 0);
        if alive {
            self.alive_since = sent;
        }
        Ok(alive)
    }
}

struct Term {
    lease: KeptLease,
    token: u64,
    /// The revision of this term's last write of the record.
    written: i64,
    /// What the term's watch of the key has seen.
    watch: TermWatch,
}

/// The holder's watch of its own key and of the waiting candidates: the highest revision of
/// any event on the key, whether the watch runs, and the candidates as last reported. A renewal
/// may skip the record while nothing was written after the holder's last write, and a release
/// picks its successor without a read.
struct TermWatch {
    latest: Arc<AtomicI64>,
    healthy: Arc<AtomicBool>,
    /// The waiting candidates by identity; `None` until read, or once the watch stopped.
    waiting: Arc<SyncMutex<Option<HashMap<String, Successor>>>>,
    task: tokio::task::AbortHandle,
}

impl TermWatch {
    fn clean(&self, written: i64) -> bool {
        self.healthy.load(Ordering::Acquire) && self.latest.load(Ordering::Acquire) <= written
    }

    /// The waiting candidates as the watch knows them, `None` when it does not.
    fn waiting(&self) -> Option<Vec<Successor>> {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.as_ref().map(|w| w.values().cloned().collect())
    }
}

impl Drop for TermWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Prepared {
    lease: KeptLease,
}

/// What the lock last learned of its keys.
#[derive(Clone, Debug, Default)]
struct Seen {
    /// The record key, `None` when unknown.
    record: Option<RecordSeen>,
    /// The fence key's token and `mod_revision` (0 when absent), when read.
    fence: Option<(u64, i64)>,
}

#[derive(Clone, Debug)]
enum RecordSeen {
    Absent,
    /// The record as stored (its `leader_transitions` as written, not the fence's token), its
    /// `mod_revision` and its etcd lease (0: none).
    Present {
        mod_revision: i64,
        lease: i64,
        record: LeaderElectionRecord,
    },
}

/// A waiting candidate a release can hand the lease to.
#[derive(Clone, Debug)]
struct Successor {
    identity: String,
    lease: i64,
    lease_duration: Duration,
    /// When it registered (its key's create revision): the longest-waiting goes first.
    since: i64,
}

impl Successor {
    /// The candidate registered as `kv` under `prefix`, if it is one (on a lease, with a lease
    /// duration in milliseconds).
    fn registered(prefix: &str, kv: &KeyValue) -> Option<Self> {
        let identity = kv.key_str().ok()?.strip_prefix(prefix)?;
        let millis: u64 = kv.value_str().ok()?.parse().ok()?;
        (kv.lease() != 0).then(|| Self {
            identity: identity.to_owned(),
            lease: kv.lease(),
            lease_duration: Duration::from_millis(millis),
            since: kv.create_revision(),
        })
    }

    /// The candidates registered under `prefix`, as `read` found them.
    fn all_in<'a>(prefix: &'a str, read: &'a GetResponse) -> impl Iterator<Item = Self> + 'a {
        read.kvs()
            .iter()
            .filter_map(move |kv| Self::registered(prefix, kv))
    }
}

impl fmt::Debug for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Term")
            .field("lease", &self.lease.id)
            .field("token", &self.token)
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Prepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prepared")
            .field("lease", &self.lease.id)
            .finish_non_exhaustive()
    }
}

fn conflict() -> LockError {
    LockError::conflict(BACKEND)
}

/// The etcd lease TTL for a lease duration: whole seconds, rounded up, at least 1.
fn ttl(lease_duration: Duration) -> i64 {
    i64::try_from(lease_duration.as_millis().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

fn revision_of(response: &TxnResponse) -> i64 {
    response.header().map_or(0, |h| h.revision())
}

/// What a follower does with the keys as read.
enum Decision {
    /// Take the key under these conditions, asking for this token.
    Take(Vec<Compare>, u64),
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
        self.term.lock().await.as_ref().map(|t| t.lease.id)
    }

    fn context(&self) -> String {
        format!("{} key {}", self.store.inner.endpoints, self.key)
    }

    fn client(&self) -> Client {
        self.store.inner.client.clone()
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, LockError> {
        self.client()
            .txn(txn)
            .await
            .map_err(|err| map(&self.context(), err))
    }

    /// The record and fence keys, as read together by a transaction's `get`s; remembers them.
    fn decode(
        &self,
        record: Option<GetResponse>,
        fence: Option<GetResponse>,
    ) -> Result<Option<(Observed, i64)>, LockError> {
        let fence_kv = fence.as_ref().and_then(|f| f.kvs().first());
        let token = fence_kv.map_or(0, |kv| token_of(kv.value(), kv.mod_revision()));
        let mut seen = self.seen();
        seen.fence = Some((token, fence_kv.map_or(0, KeyValue::mod_revision)));
        let Some(kv) = record.as_ref().and_then(|r| r.kvs().first()) else {
            seen.record = Some(RecordSeen::Absent);
            return Ok(None);
        };
        seen.record = None;
        let stored = LeaderElectionRecord::from_json(BACKEND, &self.context(), kv.value())?;
        seen.record = Some(RecordSeen::Present {
            mod_revision: kv.mod_revision(),
            lease: kv.lease(),
            record: stored.clone(),
        });
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

    fn gets(&self) -> [TxnOp; 2] {
        [
            TxnOp::get(self.key.as_str(), None),
            TxnOp::get(self.fence.as_str(), None),
        ]
    }

    async fn read(&self) -> Result<Option<(Observed, i64)>, LockError> {
        let response = self.txn(Txn::new().and_then(self.gets())).await?;
        let (record, fence) = split_gets(&response);
        self.decode(record, fence)
    }

    /// Grants a lease for `lease_duration` and opens its keep-alive stream.
    async fn grant(&self, lease_duration: Duration) -> Result<KeptLease, LockError> {
        let mut client = self.client();
        let ttl = ttl(lease_duration);
        let sent = Instant::now();
        let granted = client
            .lease_grant(ttl, None)
            .await
            .map_err(|err| map(&self.context(), err))?;
        let (keeper, stream) = client
            .lease_keep_alive(granted.id())
            .await
            .map_err(|err| map(&self.context(), err))?;
        Ok(KeptLease {
            id: granted.id(),
            ttl,
            keeper,
            stream,
            alive_since: sent,
            unanswered: 0,
        })
    }

    /// A lease for this candidate's next acquisition, registered as a waiting candidate on it
    /// (the registration is best effort: without it, a release just frees the lease).
    async fn prepare(&self, lease_duration: Duration) -> Result<Prepared, LockError> {
        let lease = self.grant(lease_duration).await?;
        let millis = lease_duration.as_millis().to_string();
        let registration = self
            .client()
            .put(
                self.candidate.as_str(),
                millis,
                Some(PutOptions::new().with_lease(lease.id)),
            )
            .await;
        if let Err(err) = registration {
            tracing::debug!(error = %err, "could not register as a waiting candidate");
        }
        Ok(Prepared { lease })
    }

    fn revoke_later(&self, lease: i64) {
        let mut client = self.client();
        tokio::spawn(async move {
            let _ = client.lease_revoke(lease).await;
        });
    }

    /// The writes of an acquisition by this candidate on `lease`: the record, the fence key,
    /// and its registration as a waiting candidate gone (it leads now).
    fn acquisition_ops(
        &self,
        record: &LeaderElectionRecord,
        lease: i64,
        wanted: u64,
    ) -> [TxnOp; 3] {
        [
            TxnOp::put(
                self.key.as_str(),
                record.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::put(self.fence.as_str(), wanted.to_string(), None),
            TxnOp::delete(self.candidate.as_str(), None),
        ]
    }

    /// Starts this term on `lease`: the acquisition wrote at `revision` with the token asked
    /// for, `wanted`. Watches the key from the next revision, so that renewals know whether
    /// anyone else wrote it.
    async fn begin_term(
        &self,
        lease: KeptLease,
        record: &LeaderElectionRecord,
        revision: i64,
        wanted: u64,
    ) -> Observed {
        let token = token_of(wanted.to_string().as_bytes(), revision);
        let watch = self.watch_term(revision);
        let stored = LeaderElectionRecord {
            leader_transitions: wanted,
            ..record.clone()
        };
        {
            let mut seen = self.seen();
            seen.fence = Some((token, revision));
            seen.record = Some(RecordSeen::Present {
                mod_revision: revision,
                lease: lease.id,
                record: stored,
            });
        }
        let previous = self.term.lock().await.replace(Term {
            lease,
            token,
            written: revision,
            watch,
        });
        if let Some(previous) = previous {
            self.revoke_later(previous.lease.id);
        }
        Observed {
            record: LeaderElectionRecord {
                leader_transitions: token,
                ..record.clone()
            },
            version: Version::from(revision),
        }
    }

    /// The holder's watch of its key from `revision + 1`, and of the waiting candidates from a
    /// read of them, in the background, on one watch stream.
    fn watch_term(&self, revision: i64) -> TermWatch {
        let latest = Arc::new(AtomicI64::new(revision));
        let healthy = Arc::new(AtomicBool::new(false));
        let waiting = Arc::new(SyncMutex::new(None));
        let mut client = self.client();
        let (key, prefix) = (self.key.clone(), self.candidates.clone());
        let task = tokio::spawn({
            let (latest, healthy, waiting) = (latest.clone(), healthy.clone(), waiting.clone());
            async move {
                let options = WatchOptions::new().with_start_revision(revision + 1);
                let Ok(mut stream) = client.watch(key.as_str(), Some(options)).await else {
                    return;
                };
                healthy.store(true, Ordering::Release);
                let known = |read: &GetResponse| -> HashMap<String, Successor> {
                    Successor::all_in(&prefix, read)
                        .map(|c| (c.identity.clone(), c))
                        .collect()
                };
                // The candidates as read, then every change after that read.
                if let Ok(read) = client
                    .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                    .await
                {
                    let from = read.header().map_or(0, |h| h.revision()) + 1;
                    let options = WatchOptions::new().with_prefix().with_start_revision(from);
                    if stream.watch(prefix.as_str(), Some(options)).await.is_ok() {
                        *waiting.lock().unwrap_or_else(|e| e.into_inner()) = Some(known(&read));
                    }
                }
                while let Ok(Some(message)) = stream.message().await {
                    if message.canceled() || message.compact_revision() > 0 {
                        break;
                    }
                    for event in message.events() {
                        let Some(kv) = event.kv() else { continue };
                        if kv.key() == key.as_bytes() {
                            latest.fetch_max(kv.mod_revision(), Ordering::AcqRel);
                            continue;
                        }
                        let mut waiting = waiting.lock().unwrap_or_else(|e| e.into_inner());
                        let (Some(waiting), Some(identity)) = (
                            waiting.as_mut(),
                            kv.key_str().ok().and_then(|k| k.strip_prefix(&prefix)),
                        ) else {
                            continue;
                        };
                        match Successor::registered(&prefix, kv) {
                            Some(candidate) if event.event_type() == EventType::Put => {
                                waiting.insert(identity.to_owned(), candidate);
                            }
                            _ => {
                                waiting.remove(identity);
                            }
                        }
                    }
                }
                healthy.store(false, Ordering::Release);
                *waiting.lock().unwrap_or_else(|e| e.into_inner()) = None;
            }
        })
        .abort_handle();
        TermWatch {
            latest,
            healthy,
            waiting,
            task,
        }
    }

    /// An acquisition with a new lease, if `condition` holds (the path of `create` and `update`).
    async fn acquire(
        &self,
        condition: Compare,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let lease = self.grant(record.lease_duration).await?;
        let wanted = record.leader_transitions.max(1);
        let txn = Txn::new()
            .when([condition])
            .and_then(self.acquisition_ops(record, lease.id, wanted));
        match self.txn(txn).await {
            Ok(response) if response.succeeded() => Ok(self
                .begin_term(lease, record, revision_of(&response), wanted)
                .await),
            other => {
                self.revoke_later(lease.id);
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
        let mut term = self.term.lock().await;
        let current = term
            .as_mut()
            .filter(|t| t.token == record.leader_transitions)?;
        let lease = current.lease.id;
        let txn = Txn::new()
            .when([
                Compare::mod_revision(self.key.as_str(), CompareOp::Equal, version),
                Compare::lease(self.key.as_str(), CompareOp::Equal, lease),
            ])
            .and_then([TxnOp::put(
                self.key.as_str(),
                record.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let (kept, written) = tokio::join!(current.lease.keep_alive(), self.txn(txn));
        let result = match (kept, written) {
            (_, Err(err)) => Err(err),
            (Ok(true), Ok(written)) if written.succeeded() => {
                current.written = revision_of(&written);
                Ok(Observed {
                    record: record.clone(),
                    version: Version::from(current.written),
                })
            }
            (Err(err), Ok(_)) => Err(map(&self.context(), err)),
            _ => Err(conflict()),
        };
        Some(result)
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
            self.revoke_later(old.lease.id);
        }
        if prepared.is_none() {
            *prepared = Some(self.prepare(desired.lease_duration).await?);
        }
        let due = prepared
            .as_ref()
            .is_some_and(|p| p.lease.alive_since.elapsed() >= period / 3);
        Ok((prepared, due))
    }

    /// Remembers this lock's own write of `record` at `revision` on `lease` (the fence is
    /// unchanged).
    fn wrote(&self, record: &LeaderElectionRecord, revision: i64, lease: i64) {
        let mut seen = self.seen();
        if let Some(RecordSeen::Present { mod_revision, .. }) = &seen.record
            && *mod_revision > revision
        {
            return;
        }
        seen.record = Some(RecordSeen::Present {
            mod_revision: revision,
            lease,
            record: record.clone(),
        });
    }

    /// The conditions under which `desired` may take the key as last seen, with the token it
    /// should ask for; `None` when the key was not seen takeable.
    fn takeover(&self, desired: &LeaderElectionRecord) -> Option<(Vec<Compare>, u64)> {
        let seen = self.seen().clone();
        let (fence_token, fence_revision) = seen.fence?;
        let record = match seen.record? {
            RecordSeen::Absent => Compare::create_revision(self.key.as_str(), CompareOp::Equal, 0),
            RecordSeen::Present {
                mod_revision,
                record,
                ..
            } => {
                if !record.is_free() || record.reserved_for_other_than(&desired.holder_identity) {
                    return None;
                }
                Compare::mod_revision(self.key.as_str(), CompareOp::Equal, mod_revision)
            }
        };
        // The fence must be as read too: an acquisition since then raised it.
        let fence = Compare::mod_revision(self.fence.as_str(), CompareOp::Equal, fence_revision);
        Some((vec![record, fence], fence_token + 1))
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
            .begin_term(taken.lease, &record, mod_revision, wanted)
            .await;
        Some(Acquisition::Handed {
            observed,
            alive_since,
        })
    }

    /// The candidate a release by `term` hands the lease to: the one a pending handover
    /// request names if it waits, else the longest-waiting one, never this one. From the term's
    /// watch when it knows of any, else from a read: a candidate that registered moments ago
    /// may not have reached the watch yet, and registrations arrive in order, so a watch that
    /// knows of one knows of every earlier one.
    async fn successor(&self, term: &Term, record: &LeaderElectionRecord) -> Option<Successor> {
        let known = term
            .watch
            .waiting()
            .filter(|w| w.iter().any(|c| c.identity != self.identity));
        let waiting = match known {
            Some(waiting) => waiting,
            // A serializable read, answered by the member without a round of consensus. A
            // stale answer, as a late watch event, is harmless: the release's transaction
            // checks that the candidate still waits on that lease, and frees the lease
            // otherwise.
            None => {
                let options = GetOptions::new().with_prefix().with_serializable();
                let read = self
                    .client()
                    .get(self.candidates.as_str(), Some(options))
                    .await
                    .ok()?;
                Successor::all_in(&self.candidates, &read).collect()
            }
        };
        let mut waiting = waiting.into_iter().filter(|c| c.identity != self.identity);
        match record.handover_to() {
            // Only the named one; if it is not waiting, the release frees the lease with the
            // request kept, and the others stand back.
            Some(to) => waiting.find(|c| c.identity == to),
            None => waiting.min_by_key(|c| c.since),
        }
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
            let now = Utc::now();
            let wanted = term.as_ref().map_or(1, |t| t.token) + 1;
            let next_record = LeaderElectionRecord {
                holder_identity: next.identity.clone(),
                lease_duration: next.lease_duration,
                acquire_time: now,
                renew_time: now,
                leader_transitions: wanted,
                strategy: record.strategy.clone(),
                preferred_holder: None,
            };
            (next, next_record, wanted)
        });
        let txn = match &handed {
            // Handed over in one write if the candidate still waits on that lease; freed
            // otherwise.
            Some((next, next_record, wanted)) => {
                let next_key = format!("{}{}", self.candidates, next.identity);
                let inner = Txn::new()
                    .when([Compare::lease(
                        next_key.as_str(),
                        CompareOp::Equal,
                        next.lease,
                    )])
                    .and_then([
                        TxnOp::put(
                            self.key.as_str(),
                            next_record.to_json(),
                            Some(PutOptions::new().with_lease(next.lease)),
                        ),
                        TxnOp::put(self.fence.as_str(), wanted.to_string(), None),
                        TxnOp::delete(next_key.as_str(), None),
                    ])
                    .or_else([free]);
                Txn::new().when([unchanged]).and_then([TxnOp::txn(inner)])
            }
            None => Txn::new().when([unchanged]).and_then([free]),
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
            self.revoke_later(term.lease.id);
        }
        let inner_handed = response.op_responses().into_iter().any(|op| match op {
            TxnOpResponse::Txn(inner) => inner.succeeded(),
            _ => false,
        });
        match handed {
            Some((next, next_record, wanted)) if inner_handed => {
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

    fn decide(&self, current: Option<(Observed, i64)>, desired: &LeaderElectionRecord) -> Decision {
        if let Some((observed, _)) = &current
            && observed.record.holder_identity == desired.holder_identity
            && !observed
                .record
                .reserved_for_other_than(&desired.holder_identity)
            && let Ok(version) = parse_version(&observed.version)
        {
            // Held by this identity (a process of it that restarted): take it over.
            let unchanged = Compare::mod_revision(self.key.as_str(), CompareOp::Equal, version);
            return Decision::Take(vec![unchanged], observed.record.leader_transitions + 1);
        }
        if let Some((conditions, wanted)) = self.takeover(desired) {
            return Decision::Take(conditions, wanted);
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
            None => Decision::Take(
                vec![Compare::create_revision(
                    self.key.as_str(),
                    CompareOp::Equal,
                    0,
                )],
                1,
            ),
        }
    }
}

/// The `get` responses of a transaction, in order.
fn split_gets(response: &TxnResponse) -> (Option<GetResponse>, Option<GetResponse>) {
    let mut gets = response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        });
    (gets.next(), gets.next())
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

/// A watch event the candidate `identity` acts on: a deletion, or a record that is free, asks
/// for a handover, names `identity` (a release handed it the lease), or cannot be read (which
/// the next read reports).
fn acts_on(event: &etcd_client::Event, identity: &str) -> bool {
    match (event.event_type(), event.kv()) {
        (etcd_client::EventType::Put, Some(kv)) => {
            LeaderElectionRecord::from_json(BACKEND, "", kv.value()).map_or(true, |r| {
                r.is_free() || r.handover_to().is_some() || r.holder_identity == identity
            })
        }
        _ => true,
    }
}

fn parse_version(version: &Version) -> Result<i64, LockError> {
    version.as_str().parse().map_err(|_| conflict())
}

#[async_trait]
impl ResourceLock for EtcdLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        Ok(self.read().await?.map(|(observed, _)| observed))
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let absent = Compare::create_revision(self.key.as_str(), CompareOp::Equal, 0);
        if record.is_free() {
            let txn = Txn::new().when([absent]).and_then([TxnOp::put(
                self.key.as_str(),
                record.to_json(),
                None,
            )]);
            let response = self.txn(txn).await?;
            if !response.succeeded() {
                return Err(conflict());
            }
            return Ok(Observed {
                record: record.clone(),
                version: Version::from(revision_of(&response)),
            });
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
            let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(
                self.key.as_str(),
                record.to_json(),
                Some(PutOptions::new().with_ignore_lease()),
            )]);
            let response = self.txn(txn).await?;
            if !response.succeeded() {
                return Err(conflict());
            }
            return Ok(Observed {
                record: record.clone(),
                version: Version::from(revision_of(&response)),
            });
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
                && current.watch.clean(expected)
            {
                return match current.lease.keep_alive().await {
                    Ok(true) => Ok(Observed {
                        record: record.clone(),
                        version: version.clone(),
                    }),
                    // The lease is gone, and the key with it.
                    Ok(false) => Err(conflict()),
                    Err(err) => Err(map(&self.context(), err)),
                };
            }
        }
        self.update(version, record).await
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
            .client()
            .lease_time_to_live(lease, None)
            .await
            .map_err(|err| map(&self.context(), err))?;
        Ok(u64::try_from(response.ttl()).ok().map(Duration::from_secs))
    }

    /// Revokes the lease granted in advance: its registration as a waiting candidate goes with
    /// it, so no release hands the lease to a candidate that stopped.
    async fn close(&self) {
        if let Some(prepared) = self.prepared.lock().await.take() {
            let _ = self.client().lease_revoke(prepared.lease.id).await;
        }
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("etcd:{}", self.key)
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let stream = self
            .client()
            .watch(self.key.as_str(), None)
            .await
            .map_err(|err| map(&self.context(), err))?;
        let seen = self.seen.clone();
        let identity = self.identity.clone();
        // Only what a candidate acts on: the key deleted (released, or expired on etcd's clock),
        // a free record, a handover request, or the lease handed to this candidate. Renewals
        // wake nobody. What the watch reports is remembered, so that a takeover is one
        // transaction (or none).
        let changes = stream
            .take_while(|message| std::future::ready(message.is_ok()))
            .filter(move |message| {
                let fire = message.as_ref().is_ok_and(|m| {
                    let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                    for event in m.events() {
                        seen.record = match (event.event_type(), event.kv()) {
                            (etcd_client::EventType::Put, Some(kv)) => {
                                LeaderElectionRecord::from_json(BACKEND, "", kv.value())
                                    .ok()
                                    .map(|record| RecordSeen::Present {
                                        mod_revision: kv.mod_revision(),
                                        lease: kv.lease(),
                                        record,
                                    })
                            }
                            (etcd_client::EventType::Delete, _) => Some(RecordSeen::Absent),
                            _ => None,
                        };
                    }
                    m.events().iter().any(|e| acts_on(e, &identity))
                });
                std::future::ready(fire)
            })
            .map(|_| ());
        Ok(Some(Box::pin(changes)))
    }

    /// Without a request when a release handed the lease to this candidate (as its watch or a
    /// read reported); one transaction when the key was last seen released, expired or absent (by a
    /// read or the watch), on a lease granted in advance; otherwise a read first.
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
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
                    let _ = p.lease.keep_alive().await;
                }
            };
            let (current, ()) = tokio::join!(self.read(), keep);
            let current = current?;
            if let Some(handed) = self.adopt(&mut prepared).await {
                return Ok(Some(handed));
            }
            match self.decide(current, desired) {
                Decision::Take(conditions, wanted) => plan = Some((conditions, wanted)),
                Decision::Held(held) => return Ok(Some(held)),
            }
        }
        for _ in 0..2 {
            let Some((conditions, wanted)) = plan.take() else {
                break;
            };
            let Some(ready) = prepared.as_mut() else {
                return Err(conflict());
            };
            let mut record = desired.clone();
            record.leader_transitions = wanted;
            let txn = Txn::new()
                .when(conditions)
                .and_then(self.acquisition_ops(&record, ready.lease.id, wanted))
                .or_else(self.gets());
            // The lease granted in advance is kept alive in the same round trip: its TTL then
            // runs from after this attempt began, so it outlasts the elector's renew deadline
            // as a fresh lease would (S3).
            let (kept, response) = tokio::join!(ready.lease.keep_alive(), self.txn(txn));
            let response = response?;
            if response.succeeded() {
                let Some(taken) = prepared.take() else {
                    return Err(conflict());
                };
                if !kept.unwrap_or(false) {
                    // Taken on a lease that may run out early: give it up (the key goes with
                    // it) rather than lead on it.
                    self.revoke_later(taken.lease.id);
                    return Err(LockError::unavailable(
                        BACKEND,
                        "the lease granted in advance could not be kept alive".to_owned(),
                    ));
                }
                let observed = self
                    .begin_term(taken.lease, &record, revision_of(&response), wanted)
                    .await;
                return Ok(Some(Acquisition::Acquired(observed)));
            }
            // Lost: the transaction read both keys instead; decide again from them.
            let (record, fence) = split_gets(&response);
            let current = self.decode(record, fence)?;
            match self.decide(current, desired) {
                Decision::Take(conditions, wanted) => plan = Some((conditions, wanted)),
                Decision::Held(held) => return Ok(Some(held)),
            }
        }
        // Changed under two attempts in a row: the elector comes back soon.
        Err(conflict())
    }
}
