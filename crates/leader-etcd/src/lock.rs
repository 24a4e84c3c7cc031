//! The lock: one election's key and fence key on an [`EtcdStore`].

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, GetResponse, KeyValue, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchOptions,
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
        EtcdLock {
            store: self.clone(),
            key: format!("{}{name}", self.inner.prefix),
            fence: format!("{}{name}.fence", self.inner.prefix),
            name,
            identity: identity.into(),
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
///   seconds, rounded up), kept alive by the holder: a dead holder's key disappears on etcd's
///   clock, and [`try_acquire`](ResourceLock::try_acquire) takes the lease once it has.
/// - A renewal is the lease's keep-alive alone, one message, while the key is as the holder
///   wrote it; the holder watches its key during its term to know that. After any other write
///   (a handover request, say), or while that watch is not running, a renewal is the keep-alive
///   and a transaction that rewrites the record only if its version and its lease are still this
///   term's. Followers never take over on their own clock: they wait for etcd to expire the key
///   or for a release ([`Acquisition::Held`]'s `renewed_in_store`).
/// - A follower grants its etcd lease in advance and keeps it alive, and remembers what its
///   watch and reads saw, so that taking over a released or expired key is one transaction.
/// - The fencing token comes from etcd itself: every acquisition also writes the key
///   `NAME.fence`, and the token is that write's revision, a cluster-wide counter (or the value
///   the elector asked for, if higher), so it grows on every acquisition.
/// - Followers watch the key, so a release or an expiry wakes them at once.
/// - A handover request written for the holder keeps the key on the holder's etcd lease; if the
///   holder dies before it releases, the key (and the request) expires with it.
#[derive(Clone, Debug)]
pub struct EtcdLock {
    store: EtcdStore,
    name: String,
    identity: String,
    key: String,
    fence: String,
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
}

impl KeptLease {
    /// One keep-alive: `true` if the lease is still alive.
    async fn keep_alive(&mut self) -> Result<bool, etcd_client::Error> {
        self.keeper.keep_alive().await?;
        Ok(self.stream.message().await?.is_some_and(|r| r.ttl() > 0))
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

/// The holder's watch of its own key: the highest revision of any event seen, and whether the
/// watch runs. A renewal may skip the record while nothing was written after the holder's last
/// write.
struct TermWatch {
    latest: Arc<AtomicI64>,
    healthy: Arc<AtomicBool>,
    task: tokio::task::AbortHandle,
}

impl TermWatch {
    fn clean(&self, written: i64) -> bool {
        self.healthy.load(Ordering::Acquire) && self.latest.load(Ordering::Acquire) <= written
    }
}

impl Drop for TermWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Prepared {
    lease: KeptLease,
    kept_at: Instant,
}

/// What the lock last learned of its keys.
#[derive(Clone, Debug, Default)]
struct Seen {
    /// The record key: absent, or present with its `mod_revision` and whether it can be taken
    /// without waiting (free, and reserved for no other candidate), for whom (the reservation),
    /// `None` when unknown.
    record: Option<RecordSeen>,
    /// The fence key's value and `mod_revision` (0 when absent), when read.
    fence: Option<(u64, i64)>,
}

#[derive(Clone, Debug)]
enum RecordSeen {
    Absent,
    Present {
        mod_revision: i64,
        free: bool,
        reserved_for: Option<String>,
    },
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
fn ttl(record: &LeaderElectionRecord) -> i64 {
    let millis = record.lease_duration.as_millis();
    i64::try_from(millis.div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

fn revision_of(response: &TxnResponse) -> i64 {
    response.header().map_or(0, |h| h.revision())
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
        let mut decoded = LeaderElectionRecord::from_json(BACKEND, &self.context(), kv.value())?;
        seen.record = Some(record_seen(kv, &decoded));
        decoded.leader_transitions = token;
        Ok(Some((
            Observed {
                record: decoded,
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

    /// Grants a lease for `record`'s duration and opens its keep-alive stream.
    async fn grant(&self, record: &LeaderElectionRecord) -> Result<KeptLease, LockError> {
        let mut client = self.client();
        let ttl = ttl(record);
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
        })
    }

    fn revoke_later(&self, lease: i64) {
        let mut client = self.client();
        tokio::spawn(async move {
            let _ = client.lease_revoke(lease).await;
        });
    }

    /// The transaction of an acquisition on `lease`: the record and the fence key, if
    /// `conditions` hold; otherwise it reads both keys.
    fn acquisition(
        &self,
        conditions: Vec<Compare>,
        record: &LeaderElectionRecord,
        lease: i64,
        wanted: u64,
    ) -> Txn {
        Txn::new().when(conditions).and_then([
            TxnOp::put(
                self.key.as_str(),
                record.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::put(self.fence.as_str(), wanted.to_string(), None),
        ])
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
        let previous = self.term.lock().await.replace(Term {
            lease,
            token,
            written: revision,
            watch,
        });
        if let Some(previous) = previous {
            self.revoke_later(previous.lease.id);
        }
        {
            let mut seen = self.seen();
            seen.fence = Some((token, revision));
            seen.record = Some(RecordSeen::Present {
                mod_revision: revision,
                free: record.is_free(),
                reserved_for: None,
            });
        }
        Observed {
            record: LeaderElectionRecord {
                leader_transitions: token,
                ..record.clone()
            },
            version: Version::from(revision),
        }
    }

    /// The holder's watch of its key from `revision + 1`, in the background.
    fn watch_term(&self, revision: i64) -> TermWatch {
        let latest = Arc::new(AtomicI64::new(revision));
        let healthy = Arc::new(AtomicBool::new(false));
        let mut client = self.client();
        let key = self.key.clone();
        let task = tokio::spawn({
            let (latest, healthy) = (latest.clone(), healthy.clone());
            async move {
                let options = WatchOptions::new().with_start_revision(revision + 1);
                let Ok(mut stream) = client.watch(key, Some(options)).await else {
                    return;
                };
                healthy.store(true, Ordering::Release);
                while let Ok(Some(message)) = stream.message().await {
                    if message.canceled() || message.compact_revision() > 0 {
                        break;
                    }
                    for event in message.events() {
                        if let Some(kv) = event.kv() {
                            latest.fetch_max(kv.mod_revision(), Ordering::AcqRel);
                        }
                    }
                }
                healthy.store(false, Ordering::Release);
            }
        })
        .abort_handle();
        TermWatch {
            latest,
            healthy,
            task,
        }
    }

    /// An acquisition with a new lease, if `condition` holds (the path of `create` and `update`).
    async fn acquire(
        &self,
        condition: Compare,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let lease = self.grant(record).await?;
        let wanted = record.leader_transitions.max(1);
        let txn = self.acquisition(vec![condition], record, lease.id, wanted);
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

    /// This follower's lease for its next acquisition, granted once and then kept alive: `true`
    /// beside it when a keep-alive is due (a third of its TTL since the last), which the caller
    /// sends together with its own request.
    async fn prepared_lease(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<(tokio::sync::MutexGuard<'_, Option<Prepared>>, bool), LockError> {
        let mut prepared = self.prepared.lock().await;
        let ttl = ttl(desired);
        let period = Duration::from_secs(u64::try_from(ttl).unwrap_or(1));
        // A lease of another duration, or one that may have run out (the follower slept), is
        // replaced.
        let replace = prepared
            .as_ref()
            .is_some_and(|p| p.lease.ttl != ttl || p.kept_at.elapsed() >= period * 2 / 3);
        if replace && let Some(old) = prepared.take() {
            self.revoke_later(old.lease.id);
        }
        if prepared.is_none() {
            *prepared = Some(Prepared {
                lease: self.grant(desired).await?,
                kept_at: Instant::now(),
            });
        }
        let due = prepared
            .as_ref()
            .is_some_and(|p| p.kept_at.elapsed() >= period / 3);
        Ok((prepared, due))
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
                free,
                reserved_for,
            } => {
                let ours = reserved_for
                    .as_deref()
                    .is_none_or(|r| r == desired.holder_identity);
                if !free || !ours {
                    return None;
                }
                Compare::mod_revision(self.key.as_str(), CompareOp::Equal, mod_revision)
            }
        };
        // The fence must be as read too: an acquisition since then raised it.
        let fence = Compare::mod_revision(self.fence.as_str(), CompareOp::Equal, fence_revision);
        Some((vec![record, fence], fence_token + 1))
    }
}

/// What a record's key says about taking it.
fn record_seen(kv: &KeyValue, record: &LeaderElectionRecord) -> RecordSeen {
    RecordSeen::Present {
        mod_revision: kv.mod_revision(),
        free: record.is_free(),
        reserved_for: record.handover_to().map(str::to_owned),
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

/// A watch event a candidate acts on: a deletion, or a record that is free, asks for a
/// handover, or cannot be read (which the next read reports).
fn may_be_free(event: &etcd_client::Event) -> bool {
    match (event.event_type(), event.kv()) {
        (etcd_client::EventType::Put, Some(kv)) => {
            LeaderElectionRecord::from_json(BACKEND, "", kv.value())
                .map_or(true, |r| r.is_free() || r.handover_to().is_some())
        }
        _ => true,
    }
}

fn parse_version(version: &Version) -> Result<i64, LockError> {
    version.as_str().parse().map_err(|_| conflict())
}

/// What a follower does with the keys as read.
enum Decision {
    /// Take the key under these conditions, asking for this token.
    Take(Vec<Compare>, u64),
    /// Someone else holds it, or it is reserved for someone else.
    Held(Acquisition),
}

impl EtcdLock {
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
            // A release: the record stays, detached from any lease; this term's lease goes.
            let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(
                self.key.as_str(),
                record.to_json(),
                None,
            )]);
            let response = self.txn(txn).await?;
            if !response.succeeded() {
                return Err(conflict());
            }
            if let Some(term) = self.term.lock().await.take() {
                self.revoke_later(term.lease.id);
            }
            return Ok(Observed {
                record: record.clone(),
                version: Version::from(revision_of(&response)),
            });
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
        {
            let mut term = self.term.lock().await;
            if let Some(current) = term
                .as_mut()
                .filter(|t| t.token == record.leader_transitions)
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
        // Only what a candidate acts on: the key deleted (released, or expired on etcd's clock)
        // or a free record or a handover request written. Renewals wake nobody. What the watch
        // reports is remembered, so that a takeover is one transaction.
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
                                    .map(|r| record_seen(kv, &r))
                            }
                            (etcd_client::EventType::Delete, _) => Some(RecordSeen::Absent),
                            _ => None,
                        };
                    }
                    m.events().iter().any(may_be_free)
                });
                std::future::ready(fire)
            })
            .map(|_| ());
        Ok(Some(Box::pin(changes)))
    }

    /// One transaction when the key was last seen released, expired or absent (by a read or
    /// the watch), on a lease granted in advance; otherwise a read first.
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let (mut prepared, due) = self.prepared_lease(desired).await?;
        let mut plan = self.takeover(desired);
        if plan.is_none() {
            // Not seen takeable: read (and keep the prepared lease alive in the same round
            // trip, when due).
            let keep = async {
                if let Some(p) = prepared.as_mut().filter(|_| due)
                    && p.lease.keep_alive().await.unwrap_or(false)
                {
                    p.kept_at = Instant::now();
                }
            };
            let (current, ()) = tokio::join!(self.read(), keep);
            match self.decide(current?, desired) {
                Decision::Take(conditions, wanted) => plan = Some((conditions, wanted)),
                Decision::Held(held) => return Ok(Some(held)),
            }
        }
        let lease = prepared.as_ref().map_or(0, |p| p.lease.id);
        for _ in 0..2 {
            let Some((conditions, wanted)) = plan.take() else {
                break;
            };
            let mut record = desired.clone();
            record.leader_transitions = wanted;
            let txn = self
                .acquisition(conditions, &record, lease, wanted)
                .or_else(self.gets());
            let response = self.txn(txn).await?;
            if response.succeeded() {
                let Some(taken) = prepared.take() else {
                    return Err(conflict());
                };
                let observed = self
                    .begin_term(taken.lease, &record, revision_of(&response), wanted)
                    .await;
                return Ok(Some(Acquisition::Acquired(observed)));
            }
            // Lost: the transaction read both keys instead; decide again from them.
            let (record, fence) = split_gets(&response);
            match self.decide(self.decode(record, fence)?, desired) {
                Decision::Take(conditions, wanted) => plan = Some((conditions, wanted)),
                Decision::Held(held) => return Ok(Some(held)),
            }
        }
        // Changed under two attempts in a row: the elector comes back soon.
        Err(conflict())
    }
}
