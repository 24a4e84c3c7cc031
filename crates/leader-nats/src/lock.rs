//! The lock: one election's record under one key of the bucket.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use async_nats::jetstream::kv::{self, Operation, UpdateErrorKind};
use async_trait::async_trait;
use futures_util::StreamExt;
use leader_core::backend::KeyedLocks;
use leader_core::{ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version};

use crate::error::{BACKEND, lost_race, map, stream_not_found};
use crate::store::{NatsStore, Opened, is_timeout};

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
            known: Arc::default(),
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
/// every revision the bucket has written (so they outlive a deletion of the key) and above
/// every token this lock object has seen (so they outlive a deletion of the bucket), and a KV
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
    /// What this lock object (and its clones) learned of the key.
    known: Arc<Mutex<Known>>,
}

/// What a lock object learned of its key from what it read and wrote.
#[derive(Debug, Default)]
struct Known {
    /// The highest fencing token it read or wrote: the floor of its acquisitions. A bucket
    /// deleted and created again starts its revisions over, and with them the tokens of records
    /// created in it; this floor does not.
    highest_token: u64,
    /// The last revisions of the key it read or wrote, newest last.
    revisions: VecDeque<Stored>,
}

/// A record at one revision of the key, as far as an update needs to know it.
#[derive(Debug)]
struct Stored {
    /// When the bucket's stream was created: revisions of a bucket created again are not
    /// those of the one deleted.
    bucket_created: i128,
    revision: u64,
    held_by_this_identity: bool,
    token: u64,
}

/// How many revisions a lock remembers: the elector's last read and write, and reads made
/// between them (a watch's).
const REMEMBERED: usize = 8;

/// The version of revision `revision` of the bucket whose stream was created at `created`
/// (nanoseconds since the epoch): a bucket deleted and created again counts its revisions
/// from 1 again, and a version read from the old one must not match a record of the new one.
fn version_of(revision: u64, created: i128) -> Version {
    Version::new(format!("{revision}@{created}"))
}

/// The revision and the stream's creation a version names; `None` for one this lock never
/// gives out.
fn parse_version(version: &Version) -> Option<(u64, i128)> {
    let (revision, created) = version.as_str().split_once('@')?;
    Some((revision.parse().ok()?, created.parse().ok()?))
}

impl Known {
    fn note(
        &mut self,
        bucket_created: i128,
        revision: u64,
        record: &LeaderElectionRecord,
        identity: &str,
    ) {
        self.highest_token = self.highest_token.max(record.leader_transitions);
        self.revisions
            .retain(|r| r.revision != revision || r.bucket_created != bucket_created);
        self.revisions.push_back(Stored {
            bucket_created,
            revision,
            held_by_this_identity: record.is_held_by(identity),
            token: record.leader_transitions,
        });
        while self.revisions.len() > REMEMBERED {
            self.revisions.pop_front();
        }
    }
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

    fn known(&self) -> MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key's last entry, if any (a deletion or purge marker included), remembered when it
    /// holds a record, and the bucket's handle it was read through.
    async fn entry(&self) -> Result<(Opened, Option<kv::Entry>), LockError> {
        let opened = self.store.opened().await?;
        match opened.store.entry(self.key.as_str()).await {
            Ok(entry) => {
                if let Some(entry) = &entry
                    && entry.operation == Operation::Put
                    && let Ok(record) = LeaderElectionRecord::from_json(BACKEND, "", &entry.value)
                {
                    self.known()
                        .note(opened.created, entry.revision, &record, &self.identity);
                }
                Ok((opened, entry))
            }
            Err(err) => {
                // A deleted stream leaves a read unanswered (no stream serves its direct gets):
                // it times out, and the next request looks the bucket up.
                if is_timeout(&err) || stream_not_found(&err) {
                    self.store.forget(opened.generation);
                }
                Err(self.map(err))
            }
        }
    }

    fn decode(&self, opened: &Opened, entry: &kv::Entry) -> Result<Observed, LockError> {
        let record = LeaderElectionRecord::from_json(BACKEND, self.context(), &entry.value)?;
        Ok(Observed {
            record,
            version: version_of(entry.revision, opened.created),
        })
    }

    /// `record` with a fencing token above every one this lock object has seen, for an
    /// acquisition.
    fn floored(&self, record: &LeaderElectionRecord) -> LeaderElectionRecord {
        let highest = self.known().highest_token;
        let mut record = record.clone();
        if record.leader_transitions <= highest {
            record.leader_transitions = highest.saturating_add(1);
        }
        record
    }

    /// Whether writing `record` at revision `expected` renews this identity's term: this lock
    /// read or wrote that revision (of the bucket as looked up now, not of one deleted before)
    /// holding this identity's record with the same token.
    fn renews(&self, opened: &Opened, expected: u64, record: &LeaderElectionRecord) -> bool {
        self.known().revisions.iter().any(|stored| {
            stored.bucket_created == opened.created
                && stored.revision == expected
                && stored.held_by_this_identity
                && stored.token == record.leader_transitions
        })
    }

    /// Writes `record` if the key's last revision is still `expected` (0: no entry at all).
    async fn write(
        &self,
        opened: &Opened,
        expected: u64,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        match opened
            .store
            .update(self.key.as_str(), record.to_json().into(), expected)
            .await
        {
            Ok(revision) => {
                self.known()
                    .note(opened.created, revision, record, &self.identity);
                Ok(Observed {
                    record: record.clone(),
                    version: version_of(revision, opened.created),
                })
            }
            Err(err) if err.kind() == UpdateErrorKind::WrongLastRevision || lost_race(&err) => {
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
            Err(err) => {
                // No stream takes the bucket's subjects: it was deleted.
                if stream_not_found(&err) {
                    self.store.forget(opened.generation);
                }
                Err(self.map(err))
            }
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
    /// What `entry` shows, and the fencing token of the record it holds, if any.
    fn of(entry: &kv::Entry) -> (Self, Option<u64>) {
        if entry.operation != Operation::Put {
            return (Self::Free, None);
        }
        match LeaderElectionRecord::from_json(BACKEND, "watch", &entry.value) {
            Ok(record) if record.is_free() => (Self::Free, Some(record.leader_transitions)),
            Ok(record) => (
                Self::Held {
                    holder: record.holder_identity,
                    preferred: record.preferred_holder,
                    transitions: record.leader_transitions,
                },
                Some(record.leader_transitions),
            ),
            Err(_) => (Self::Invalid, None),
        }
    }
}

#[async_trait]
impl ResourceLock for NatsLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let (opened, entry) = self.entry().await?;
        match entry {
            Some(entry) if entry.operation == Operation::Put => {
                self.decode(&opened, &entry).map(Some)
            }
            // Deleted or purged: no record.
            _ => Ok(None),
        }
    }

    /// Creates the record where the key has none (never written, deleted or purged). Its
    /// fencing token is at least one more than the bucket's last sequence number (above every
    /// revision written so far, and so above every token this key ever had, since a key's
    /// tokens grow by one per takeover, each its own write), and above every token this lock
    /// object has seen (a bucket created again starts its sequence over). The bucket's
    /// settings are checked again first, as when a term starts by update.
    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let (opened, entry) = self.entry().await?;
        let expected = match entry {
            Some(entry) if entry.operation == Operation::Put => {
                return Err(LockError::conflict(BACKEND));
            }
            Some(marker) => marker.revision,
            None => 0,
        };
        let floor = self.store.term_start(&opened, expected).await?;
        let record = self.floored(&{
            let mut record = record.clone();
            record.leader_transitions = record.leader_transitions.max(floor);
            record
        });
        self.write(&opened, expected, &record).await
    }

    /// Writes `record` over revision `version`. An acquisition (a record naming this identity
    /// that does not renew its term) first checks the bucket again (its settings, and that its
    /// stream is still the one `version` was read from), and gets a token above every one this
    /// lock object has seen and above the stream's last sequence, as a creation does: the
    /// bucket may have been deleted and created again, and the record created in it with a
    /// token from its new sequence, or the record written by another with a lower token.
    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        // A version this lock never gave out names no revision: it cannot match.
        let Some((expected, created)) = parse_version(version) else {
            return Err(LockError::conflict(BACKEND));
        };
        if expected == 0 {
            return Err(LockError::conflict(BACKEND));
        }
        let opened = self.store.opened().await?;
        // A revision of another bucket's stream (deleted since, or created after the read)
        // may be the number of an unrelated record of this one.
        if created != opened.created {
            return Err(LockError::conflict(BACKEND));
        }
        if record.is_held_by(&self.identity) && !self.renews(&opened, expected, record) {
            // Above the stream's last sequence too, as a creation is: the token read may be
            // lower than one given out before (a record freed by hand with token 0, another
            // client's), and a process that never saw the higher one cannot know it.
            let floor = self.store.term_start(&opened, expected).await?;
            let mut record = self.floored(record);
            record.leader_transitions = record.leader_transitions.max(floor);
            return self.write(&opened, expected, &record).await;
        }
        self.write(&opened, expected, record).await
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("nats:{}/{}", self.store.bucket(), self.key)
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }

    /// A KV watch of the key (an ordered consumer on the server), filtered here: it fires when
    /// the holder, its token or a handover request changes, or the record is freed, deleted or
    /// purged, and not for renewals, though every renewal reaches every follower.
    ///
    /// While the client is not connected (a server down, a network cut), the stream waits for
    /// it to connect again, then watches and fires once: a follower that backs off during an
    /// outage tries again as soon as the client is back, instead of at the end of its back-off
    /// (which, with the client's own reconnect delay, could cost it a whole back-off more).
    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let client = self.store.inner.client.clone();
        if client.connection_state() == async_nats::connection::State::Connected {
            return self.watch_now().await.map(Some);
        }
        let lock = self.clone();
        let back = async move {
            // A check of the client's own state, no request: the client reconnects by itself.
            while client.connection_state() != async_nats::connection::State::Connected {
                tokio::time::sleep(RECONNECT_POLL).await;
            }
            let woken = futures_util::stream::once(std::future::ready(()));
            match lock.watch_now().await {
                Ok(watching) => woken.chain(watching).boxed(),
                // Woken all the same: the elector subscribes again at its next attempt.
                Err(_) => woken.boxed(),
            }
        };
        Ok(Some(futures_util::stream::once(back).flatten().boxed()))
    }
}

/// How often a change stream opened during an outage looks whether the client is connected.
const RECONNECT_POLL: std::time::Duration = std::time::Duration::from_millis(50);

impl NatsLock {
    /// The KV watch of [`watch`](ResourceLock::watch), opened now.
    async fn watch_now(&self) -> Result<ChangeStream, LockError> {
        // Two requests: the consumer, and a read of the key.
        let opened = self.store.opened().await?;
        let watch = match opened.store.watch(self.key.as_str()).await {
            Ok(watch) => watch,
            Err(err) => {
                if is_timeout(&err) || stream_not_found(&err) {
                    self.store.forget(opened.generation);
                }
                return Err(self.map(err));
            }
        };
        // What the key holds now, read after the watch began: a write the watch delivers is
        // compared with it, so that the first renewal after subscribing wakes nobody.
        let now = self
            .entry()
            .await?
            .1
            .as_ref()
            .map(|entry| Seen::of(entry).0);
        let known = Arc::clone(&self.known);
        let stream = futures_util::stream::unfold((watch, now), move |(mut watch, mut seen)| {
            let known = Arc::clone(&known);
            async move {
                loop {
                    let entry = match watch.next().await {
                        Some(Ok(entry)) => entry,
                        // The subscription is lost: the elector subscribes again.
                        Some(Err(_)) | None => return None,
                    };
                    let (now, token) = Seen::of(&entry);
                    if let Some(token) = token {
                        let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
                        known.highest_token = known.highest_token.max(token);
                    }
                    let changed = seen.as_ref() != Some(&now) || now == Seen::Free;
                    seen = Some(now);
                    if changed {
                        return Some(((), (watch, seen)));
                    }
                }
            }
        });
        Ok(Box::pin(stream))
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
