//! The lock: one election's key and fence key on an [`EtcdStore`].

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, GetResponse, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn,
    TxnOp, TxnOpResponse, TxnResponse,
};
use futures_util::StreamExt;
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};
use tokio::sync::Mutex;

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
        }
    }
}

/// A [`ResourceLock`] on one etcd key.
///
/// - The record is the key's value (JSON); its version is the key's `mod_revision`. `create`
///   is a transaction on `create_revision == 0`, `update` one on `mod_revision == version`.
/// - The holder's key is attached to an etcd lease with a TTL of the lease duration (whole
///   seconds, rounded up), kept alive by the holder: a dead holder's key disappears on the
///   server's clock, and [`try_acquire`](ResourceLock::try_acquire) takes the lease once it has.
/// - The fencing token comes from etcd itself: every acquisition also writes the key
///   `NAME.fence`, and the token is that write's revision, a cluster-wide counter (or the value
///   the elector asked for, if higher), so it grows on every acquisition.
/// - A renewal sends a keep-alive on the lease and a transaction that rewrites the record only
///   if its version and its lease are still this term's, concurrently: two requests, one round
///   trip.
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
}

struct Term {
    lease: i64,
    token: u64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
}

impl fmt::Debug for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Term")
            .field("lease", &self.lease)
            .field("token", &self.token)
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
        self.term.lock().await.as_ref().map(|t| t.lease)
    }

    fn context(&self) -> String {
        format!("{} key {}", self.store.inner.endpoints, self.key)
    }

    fn client(&self) -> Client {
        self.store.inner.client.clone()
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, LockError> {
        self.client()
            .txn(txn)
            .await
            .map_err(|err| map(&self.context(), err))
    }

    /// The record and fence keys, as read together by a transaction's `get`s.
    fn decode(
        &self,
        record: Option<GetResponse>,
        fence: Option<GetResponse>,
    ) -> Result<Option<Observed>, LockError> {
        let Some(kv) = record.as_ref().and_then(|r| r.kvs().first()) else {
            return Ok(None);
        };
        let mut decoded = LeaderElectionRecord::from_json(BACKEND, &self.context(), kv.value())?;
        decoded.leader_transitions = fence
            .as_ref()
            .and_then(|f| f.kvs().first())
            .map_or(0, |kv| token_of(kv.value(), kv.mod_revision()));
        Ok(Some(Observed {
            record: decoded,
            version: Version::from(kv.mod_revision()),
        }))
    }

    fn gets(&self) -> [TxnOp; 2] {
        [
            TxnOp::get(self.key.as_str(), None),
            TxnOp::get(self.fence.as_str(), None),
        ]
    }

    async fn read(&self) -> Result<Option<Observed>, LockError> {
        let response = self.txn(Txn::new().and_then(self.gets())).await?;
        let (record, fence) = split_gets(&response);
        self.decode(record, fence)
    }

    /// Grants a lease for a new term and opens its keep-alive stream.
    async fn grant(
        &self,
        record: &LeaderElectionRecord,
    ) -> Result<(i64, LeaseKeeper, LeaseKeepAliveStream), LockError> {
        let mut client = self.client();
        let granted = client
            .lease_grant(ttl(record), None)
            .await
            .map_err(|err| map(&self.context(), err))?;
        let (keeper, stream) = client
            .lease_keep_alive(granted.id())
            .await
            .map_err(|err| map(&self.context(), err))?;
        Ok((granted.id(), keeper, stream))
    }

    fn revoke_later(&self, lease: i64) {
        let mut client = self.client();
        tokio::spawn(async move {
            let _ = client.lease_revoke(lease).await;
        });
    }

    /// An acquisition: a new lease, and one transaction that writes the record on it and the
    /// fence key, if `condition` holds. The token is the transaction's revision, or the token
    /// asked for if higher.
    async fn acquire(
        &self,
        condition: Compare,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let (lease, keeper, stream) = self.grant(record).await?;
        let wanted = record.leader_transitions.max(1);
        let txn = Txn::new().when([condition]).and_then([
            TxnOp::put(
                self.key.as_str(),
                record.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::put(self.fence.as_str(), wanted.to_string(), None),
        ]);
        let response = match self.txn(txn).await {
            Ok(response) if response.succeeded() => response,
            other => {
                self.revoke_later(lease);
                return Err(other.err().unwrap_or_else(conflict));
            }
        };
        let revision = response.header().map_or(0, |h| h.revision());
        let token = token_of(wanted.to_string().as_bytes(), revision);
        let previous = self.term.lock().await.replace(Term {
            lease,
            token,
            keeper,
            stream,
        });
        if let Some(previous) = previous {
            self.revoke_later(previous.lease);
        }
        Ok(Observed {
            record: LeaderElectionRecord {
                leader_transitions: token,
                ..record.clone()
            },
            version: Version::from(revision),
        })
    }

    /// A renewal of this lock's current term: keep-alive and a transaction that rewrites the
    /// record only if its version and its lease are still this term's, sent together. `None`
    /// when this lock holds no matching term.
    async fn renew(
        &self,
        version: i64,
        record: &LeaderElectionRecord,
    ) -> Option<Result<Observed, LockError>> {
        let mut term = self.term.lock().await;
        let current = term
            .as_mut()
            .filter(|t| t.token == record.leader_transitions)?;
        let lease = current.lease;
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
        let keep_alive = async {
            current.keeper.keep_alive().await?;
            current.stream.message().await
        };
        let (kept, written) = tokio::join!(keep_alive, self.txn(txn));
        let result = match (kept, written) {
            (_, Err(err)) => Err(err),
            (Ok(Some(response)), Ok(written)) if response.ttl() > 0 && written.succeeded() => {
                Ok(Observed {
                    record: record.clone(),
                    version: Version::from(written.header().map_or(0, |h| h.revision())),
                })
            }
            (Err(err), Ok(_)) => Err(map(&self.context(), err)),
            _ => Err(conflict()),
        };
        Some(result)
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

#[async_trait]
impl ResourceLock for EtcdLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        self.read().await
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
                version: Version::from(response.header().map_or(0, |h| h.revision())),
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
                self.revoke_later(term.lease);
            }
            return Ok(Observed {
                record: record.clone(),
                version: Version::from(response.header().map_or(0, |h| h.revision())),
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
                version: Version::from(response.header().map_or(0, |h| h.revision())),
            });
        }
        if let Some(renewed) = self.renew(expected, record).await {
            return renewed;
        }
        // A new holder, or a new term of this one: an acquisition with the next token.
        self.acquire(unchanged, record).await
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
        // Only what a follower acts on: the key deleted (released, or expired on etcd's clock) or
        // a free record written. Renewals, one per retry period, wake nobody.
        let changes = stream
            .take_while(|message| std::future::ready(message.is_ok()))
            .filter(|message| {
                std::future::ready(
                    message
                        .as_ref()
                        .is_ok_and(|m| m.events().iter().any(may_be_free)),
                )
            })
            .map(|_| ());
        Ok(Some(Box::pin(changes)))
    }

    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let current = self.read().await?;
        let condition = match &current {
            // Absent: never taken, released and deleted, or expired on the server's clock.
            None => Compare::create_revision(self.key.as_str(), CompareOp::Equal, 0),
            Some(observed)
                if (observed.record.is_free()
                    || observed.record.holder_identity == desired.holder_identity)
                    && !observed
                        .record
                        .reserved_for_other_than(&desired.holder_identity) =>
            {
                Compare::mod_revision(
                    self.key.as_str(),
                    CompareOp::Equal,
                    parse_version(&observed.version)?,
                )
            }
            // etcd expires the key itself (its watch reports the deletion): no time to wait for.
            Some(observed) => {
                return Ok(Some(Acquisition::Held {
                    observed: observed.clone(),
                    expires_in: None,
                }));
            }
        };
        let mut record = desired.clone();
        record.leader_transitions = current
            .as_ref()
            .map_or(1, |o| o.record.leader_transitions + 1);
        self.acquire(condition, &record)
            .await
            .map(|o| Some(Acquisition::Acquired(o)))
    }
}
