//! The lock: one object per election, written only with preconditions.

use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use leader_core::{LeaderElectionRecord, LockError, Observed, ResourceLock, Version};
use object_store::path::Path;
use object_store::{GetOptions, PutMode, PutOptions, PutPayload, PutResult, UpdateVersion};

use crate::error::{BACKEND, Kind, Op, is_lost_precondition, map};
use crate::store::BucketStore;

impl BucketStore {
    /// A lock on election `name` (the object `PREFIX` + `name`) for candidate `identity`.
    pub fn lock(&self, name: impl AsRef<str>, identity: impl Into<String>) -> BucketLock {
        let name = name.as_ref().to_owned();
        let key = format!("{}{name}", self.inner.prefix);
        BucketLock {
            context: format!("{} object {key}", self.inner.name),
            path: Path::from(key.as_str()),
            key,
            name,
            store: self.clone(),
            identity: identity.into(),
            last: Arc::default(),
        }
    }
}

/// A [`ResourceLock`] on one object in a bucket:
///
/// - The record is the object's JSON content (as the file, Redis and etcd locks store it).
/// - `create` writes with `If-None-Match: *` (object_store's `PutMode::Create`), `update` and
///   renewals with `If-Match` on the ETag read or written last (`PutMode::Update`; Cloud
///   Storage compares the generation instead). A failed precondition is
///   [`LockError::Conflict`]. Nothing is ever written without a precondition, and before its
///   first write every lock makes sure the store keeps them
///   ([`BucketStore::check_conditional_writes`]).
/// - A renewal is one request: the conditional write of the record with its new `renew_time`.
/// - An object store cannot compare its own clock with a lease inside a write, so there is no
///   store-clock acquisition: followers wait out the holder's lease on their own monotonic
///   clock from when they first read its version (S2), as with the file lock.
/// - No notifications: followers read at every retry period with `If-None-Match` on the ETag
///   they hold, which the store answers with `304 Not Modified` and no body while the record
///   is unchanged.
/// - Fencing tokens are the record's `leaderTransitions`, raised by one under the
///   precondition at every acquisition. The lock never deletes its object; whoever deletes it
///   by hand starts the count again (see the README).
#[derive(Clone)]
pub struct BucketLock {
    store: BucketStore,
    key: String,
    /// The election's name: the object's key without the store's prefix, unless
    /// [`with_election_name`](Self::with_election_name) said otherwise.
    name: String,
    path: Path,
    context: String,
    identity: String,
    /// The record this lock read or wrote last, with its ETag, for conditional reads.
    last: Arc<Mutex<Option<Last>>>,
}

#[derive(Clone)]
struct Last {
    e_tag: String,
    observed: Observed,
}

impl fmt::Debug for BucketLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BucketLock")
            .field("store", &self.store)
            .field("key", &self.key)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// The separator of the ETag and the object version in a [`Version`]; neither holds it.
const SEPARATOR: char = '\n';

fn encode(e_tag: Option<&str>, version: Option<&str>) -> Version {
    Version::new(format!(
        "{}{SEPARATOR}{}",
        e_tag.unwrap_or_default(),
        version.unwrap_or_default()
    ))
}

fn decode(version: &Version) -> UpdateVersion {
    let (e_tag, object_version) = version
        .as_str()
        .split_once(SEPARATOR)
        .unwrap_or((version.as_str(), ""));
    let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    UpdateVersion {
        e_tag: some(e_tag),
        version: some(object_version),
    }
}

impl BucketLock {
    /// The part of `version` the store's precondition on a write compares: Cloud Storage's
    /// generation, the ETag of the others that say which (S3, Azure, memory), both for a store
    /// built elsewhere.
    fn compared(&self, version: &Version) -> Version {
        let UpdateVersion {
            e_tag,
            version: generation,
        } = decode(version);
        match self.store.inner.kind {
            Kind::Gcs => Version::new(generation.unwrap_or_default()),
            Kind::S3 | Kind::Azure | Kind::Memory => Version::new(e_tag.unwrap_or_default()),
            Kind::Other => version.clone(),
        }
    }

    /// The object's key in the bucket.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Names the election `name` (default: the name the lock was made for), for a lock whose
    /// object is not named after its election, such as the one object a URL names.
    #[must_use]
    pub fn with_election_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    fn last(&self) -> Option<Last> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn remember(&self, last: Option<Last>) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = last;
    }

    fn map(&self, op: Op, err: object_store::Error) -> LockError {
        map(
            &self.context,
            self.store.inner.kind,
            &self.store.resource(),
            op,
            err,
        )
    }

    /// The stored record after a successful write of `record`.
    fn written(
        &self,
        record: &LeaderElectionRecord,
        result: &PutResult,
    ) -> Result<Observed, LockError> {
        if result.e_tag.is_none() && result.version.is_none() {
            return Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "{}: the store gave neither an ETag nor a version for a write, so the \
                     next write could not be conditional",
                    self.context
                ),
            });
        }
        let observed = Observed {
            record: record.clone(),
            version: encode(result.e_tag.as_deref(), result.version.as_deref()),
        };
        self.remember(result.e_tag.clone().map(|e_tag| Last {
            e_tag,
            observed: observed.clone(),
        }));
        Ok(observed)
    }

    async fn put(
        &self,
        record: &LeaderElectionRecord,
        mode: PutMode,
    ) -> Result<Observed, LockError> {
        self.store.check_conditional_writes().await?;
        let options = PutOptions {
            mode,
            ..PutOptions::default()
        };
        let payload = PutPayload::from(record.to_json());
        match self
            .store
            .inner
            .store
            .put_opts(&self.path, payload, options)
            .await
        {
            Ok(result) => self.written(record, &result),
            // A lost precondition: the object exists (create), or moved on or is gone (update;
            // S3 answers 404 for If-Match on an absent object, Azurite 409). Not a missing
            // bucket, nor a blob whose state refuses every write.
            Err(
                err @ (object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. }
                | object_store::Error::NotFound { .. }),
            ) if is_lost_precondition(&err) => Err(LockError::conflict(BACKEND)),
            Err(err) => Err(self.map(Op::Write, err)),
        }
    }
}

#[async_trait]
impl ResourceLock for BucketLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let last = self.last();
        let options = GetOptions {
            if_none_match: last.as_ref().map(|l| l.e_tag.clone()),
            ..GetOptions::default()
        };
        match self.store.inner.store.get_opts(&self.path, options).await {
            Ok(result) => {
                let meta = result.meta.clone();
                let bytes = result.bytes().await.map_err(|e| self.map(Op::Read, e))?;
                let record = LeaderElectionRecord::from_json(BACKEND, &self.context, &bytes)?;
                if meta.e_tag.is_none() && meta.version.is_none() {
                    return Err(LockError::Misconfigured {
                        backend: BACKEND,
                        message: format!(
                            "{}: the store gave neither an ETag nor a version for the object",
                            self.context
                        ),
                    });
                }
                let observed = Observed {
                    record,
                    version: encode(meta.e_tag.as_deref(), meta.version.as_deref()),
                };
                self.remember(meta.e_tag.map(|e_tag| Last {
                    e_tag,
                    observed: observed.clone(),
                }));
                Ok(Some(observed))
            }
            Err(object_store::Error::NotModified { .. }) => match last {
                Some(last) => Ok(Some(last.observed)),
                // Not asked conditionally: a store that answers 304 anyway is broken.
                None => Err(LockError::other(
                    BACKEND,
                    format!(
                        "{}: 304 Not Modified to an unconditional read",
                        self.context
                    ),
                )),
            },
            Err(err @ object_store::Error::NotFound { .. }) => {
                let mapped = self.map(Op::Read, err);
                if matches!(mapped, LockError::Misconfigured { .. }) {
                    return Err(mapped);
                }
                self.remember(None);
                Ok(None)
            }
            Err(err) => Err(self.map(Op::Read, err)),
        }
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        self.put(record, PutMode::Create).await
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let written = self.put(record, PutMode::Update(decode(version))).await?;
        // S3's ETag is a digest of the bytes: a write of the bytes stored keeps it, so a
        // follower's conditional write on it would still succeed (S14), even where a
        // versioned bucket gave the write a version of its own.
        let compared = Observed {
            record: written.record.clone(),
            version: self.compared(&written.version),
        };
        leader_core::backend::unless_moved(BACKEND, "update", &self.compared(version), compared)?;
        Ok(written)
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("{}/{}", self.store.inner.name, self.key)
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_round_trip() {
        for (e_tag, version) in [
            (Some("\"abc\""), None),
            (Some("\"abc\""), Some("1700000000000000")),
            (None, Some("17")),
        ] {
            let decoded = decode(&encode(e_tag, version));
            assert_eq!(decoded.e_tag.as_deref(), e_tag);
            assert_eq!(decoded.version.as_deref(), version);
        }
    }
}
