//! The lock: one election's record under one key of the bucket.

use std::sync::Arc;

use async_nats::jetstream::kv::{self, Operation, UpdateErrorKind};
use async_trait::async_trait;
use futures_util::StreamExt;
use leader_core::{
    ChangeStream, KeyedLocks, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};

use crate::error::{BACKEND, map};
use crate::store::{NatsStore, is_timeout};

/// The bucket key of election `name`: letters, digits, `-`, `_` and `/` as they are, every
/// other byte (`.` and `=` included) as `=` and two hex digits, so that any name is a valid key
/// and no two names share one. The empty name is `=`.
pub fn key_of(name: &str) -> String {
    if name.is_empty() {
        return "=".to_owned();
    }
    let mut key = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'/') {
            key.push(char::from(byte));
        } else {
            key.push_str(&format!("={byte:02X}"));
        }
    }
    key
}

impl NatsStore {
    /// A lock on election `name` for candidate `identity`.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> NatsLock {
        let name = name.into();
        NatsLock {
            store: self.clone(),
            key: key_of(&name),
            name,
            identity: identity.into(),
        }
    }

    /// The locks of a shard set for member `identity`: a key per record in the bucket, on this
    /// store's connection. A JetStream key-value bucket (as of server 2.9) reads and writes one
    /// key per request, so a member makes one request per record it reads or renews.
    pub fn lock_set(&self, identity: impl Into<String>) -> KeyedLocks {
        let store = self.clone();
        KeyedLocks::new(
            identity,
            format!("nats:{}", self.bucket()),
            move |key, identity| Arc::new(store.lock(key, identity)),
        )
    }
}

/// A [`ResourceLock`] on one key of a JetStream key-value bucket: the record as JSON, a
/// compare-and-swap on the key's revision for every write, fencing tokens that start above
/// every revision the bucket has written (so they outlive a deletion of the key), and a KV
/// watch that wakes followers when the holder changes, releases or is asked to hand over.
///
/// The bucket keeps no lease clock of its own (per-key expiry needs a newer server than 2.9):
/// candidates wait out a holder's lease on their own monotonic clock, from when they saw its
/// last renewal, as Kubernetes' Lease election does.
#[derive(Clone, Debug)]
pub struct NatsLock {
    store: NatsStore,
    name: String,
    key: String,
    identity: String,
}

impl NatsLock {
    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The record's key in the bucket.
    pub fn key(&self) -> &str {
        &self.key
    }

    fn context(&self) -> String {
        format!("{} key {}", self.store.context(), self.key)
    }

    fn map(&self, err: impl std::error::Error + Send + Sync + 'static) -> LockError {
        let timed_out = is_timeout(&err);
        map(&self.context(), self.store.refusals(), timed_out, err)
    }

    /// The key's last entry, if any (a deletion or purge marker included).
    async fn entry(&self) -> Result<Option<kv::Entry>, LockError> {
        let kv = self.store.kv().await?;
        kv.entry(self.key.as_str())
            .await
            .map_err(|err| self.map(err))
    }

    fn decode(&self, entry: &kv::Entry) -> Result<Observed, LockError> {
        let record = LeaderElectionRecord::from_json(BACKEND, &self.context(), &entry.value)?;
        Ok(Observed {
            record,
            version: Version::new(entry.revision.to_string()),
        })
    }

    /// Writes `record` if the key's last revision is still `expected` (0: no entry at all).
    async fn write(
        &self,
        expected: u64,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let kv = self.store.kv().await?;
        match kv
            .update(self.key.as_str(), record.to_json().into(), expected)
            .await
        {
            Ok(revision) => Ok(Observed {
                record: record.clone(),
                version: Version::new(revision.to_string()),
            }),
            Err(err) if err.kind() == UpdateErrorKind::WrongLastRevision => {
                Err(LockError::conflict(BACKEND))
            }
            Err(err) if err.kind() == UpdateErrorKind::InvalidKey => {
                Err(LockError::Misconfigured {
                    backend: BACKEND,
                    message: format!("{}: not a valid key", self.context()),
                })
            }
            Err(err) if err.kind() == UpdateErrorKind::TimedOut => {
                Err(map(&self.context(), self.store.refusals(), true, err))
            }
            Err(err) => Err(self.map(err)),
        }
    }
}

/// What a follower's watch compares between two entries: a renewal changes none of it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Held {
        holder: String,
        preferred: Option<String>,
        transitions: u64,
    },
    /// Free, deleted or purged.
    Free,
    /// A value that is not a record.
    Invalid,
}

impl Seen {
    fn of(entry: &kv::Entry) -> Self {
        if entry.operation != Operation::Put {
            return Self::Free;
        }
        match LeaderElectionRecord::from_json(BACKEND, "watch", &entry.value) {
            Ok(record) if record.is_free() => Self::Free,
            Ok(record) => Self::Held {
                holder: record.holder_identity,
                preferred: record.preferred_holder,
                transitions: record.leader_transitions,
            },
            Err(_) => Self::Invalid,
        }
    }
}

#[async_trait]
impl ResourceLock for NatsLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        match self.entry().await? {
            Some(entry) if entry.operation == Operation::Put => self.decode(&entry).map(Some),
            // Deleted or purged: no record.
            _ => Ok(None),
        }
    }

    /// Creates the record where the key has none (never written, deleted or purged). Its
    /// fencing token is at least one more than the bucket's last sequence number: above every
    /// revision written so far, and so above every token this key ever had, since a key's
    /// tokens grow by one per takeover, each its own write.
    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let expected = match self.entry().await? {
            Some(entry) if entry.operation == Operation::Put => {
                return Err(LockError::conflict(BACKEND));
            }
            Some(marker) => marker.revision,
            None => 0,
        };
        let floor = self.store.last_sequence().await?.saturating_add(1);
        let record = LeaderElectionRecord {
            leader_transitions: record.leader_transitions.max(floor),
            ..record.clone()
        };
        self.write(expected, &record).await
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        // A version this lock never gave out names no revision: it cannot match.
        let Ok(expected) = version.as_str().parse::<u64>() else {
            return Err(LockError::conflict(BACKEND));
        };
        if expected == 0 {
            return Err(LockError::conflict(BACKEND));
        }
        self.write(expected, record).await
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("nats:{}/{}", self.store.bucket(), self.key)
    }

    /// A KV watch of the key (an ordered consumer on the server), filtered here: it fires when
    /// the holder, its token or a handover request changes, or the record is freed, deleted or
    /// purged, and not for renewals, though every renewal reaches every follower.
    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        // Two requests: the consumer, and a read of the key.
        let kv = self.store.kv().await?;
        let watch = kv
            .watch(self.key.as_str())
            .await
            .map_err(|err| self.map(err))?;
        // What the key holds now, read after the watch began: a write the watch delivers is
        // compared with it, so that the first renewal after subscribing wakes nobody.
        let now = self.entry().await?.as_ref().map(Seen::of);
        let stream =
            futures_util::stream::unfold((watch, now), |(mut watch, mut seen)| async move {
                loop {
                    let entry = match watch.next().await {
                        Some(Ok(entry)) => entry,
                        // The subscription is lost: the elector subscribes again.
                        Some(Err(_)) | None => return None,
                    };
                    let now = Seen::of(&entry);
                    let changed = seen.as_ref() != Some(&now) || now == Seen::Free;
                    seen = Some(now);
                    if changed {
                        return Some(((), (watch, seen)));
                    }
                }
            });
        Ok(Some(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_valid_and_distinct() {
        let names = [
            "app",
            "app.v1",
            "app=2Ev1",
            "a b",
            "",
            "=",
            "jobs-shard-7",
            "ü",
            "a/b",
        ];
        let keys: Vec<String> = names.iter().map(|name| key_of(name)).collect();
        for (name, key) in names.iter().zip(&keys) {
            assert!(!key.is_empty(), "{name:?}");
            assert!(
                key.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'/' | b'=')),
                "{name:?} -> {key:?}"
            );
        }
        let distinct: std::collections::HashSet<&String> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len(), "{keys:?}");
        assert_eq!(key_of("app.v1"), "app=2Ev1");
        assert_eq!(key_of("jobs-shard-7"), "jobs-shard-7");
    }
}
