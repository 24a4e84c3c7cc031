//! A shard set's records on one Redis server: one script renews all of a member's and then reads
//! them all (sending only those whose version changed, when the reader says which it holds).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use leader_core::backend::{KeyedLocks, Known, LockErrorExt, Renewal, RenewedAndRead, Reread};
use leader_core::{LockError, LockSet, Observed, ResourceLock, async_trait};
use redis::Value;

use crate::error::{BACKEND, is_cross_slot};
use crate::lock::{decode, eval, first_keys};
use crate::scripts;
use crate::store::{Lane, RedisStore};

/// The records of a shard set on one Redis server ([`RedisStore::lock_set`]).
/// [`get_many`](LockSet::get_many), [`renew_many`](LockSet::renew_many) and a round of both
/// ([`renew_and_read`](LockSet::renew_and_read)) are one script each, whatever the number of
/// records, each record kept as the [`RedisLock`](crate::RedisLock)
/// keeps it. A read of many records goes on a connection of its own, so that renewals never
/// wait in line behind its large answer. A Redis Cluster refuses scripts over keys of several slots: there the set falls
/// back to a request per record, once it has seen the refusal.
#[derive(Clone, Debug)]
pub struct RedisLockSet {
    store: RedisStore,
    locks: KeyedLocks,
    per_key: Arc<AtomicBool>,
}

impl RedisStore {
    /// The records of a shard set, as member `identity`: a [`RedisLock`](crate::RedisLock) per
    /// key, read and renewed in batches.
    pub fn lock_set(&self, identity: impl Into<String>) -> RedisLockSet {
        let store = self.clone();
        RedisLockSet {
            store: self.clone(),
            locks: KeyedLocks::new(
                identity,
                format!("redis:{}", self.inner.redacted),
                move |key, identity| Arc::new(store.lock(key, identity)),
            ),
            per_key: Arc::default(),
        }
    }
}

impl RedisLockSet {
    fn context(&self) -> String {
        format!("{} shard set", self.store.inner.redacted)
    }

    /// Runs the round script: `renewals`, then a read of the elections `names` with what is
    /// held of each (`known`, one per name). One answer per renewal (renewed or not) and per
    /// election, or the error of the whole batch.
    async fn round(
        &self,
        renewals: &[Renewal],
        names: &[String],
        known: &[Known<'_>],
    ) -> Result<(Vec<bool>, Vec<Result<Reread, LockError>>), LockError> {
        let prefix = &self.store.inner.prefix;
        let renewed_keys: Vec<[String; 1]> = renewals
            .iter()
            .map(|r| first_keys(prefix, &r.key))
            .collect();
        // The hash, the fence counter and the extensions of each election read.
        let read_keys: Vec<[String; 3]> = names.iter().map(|n| first_keys(prefix, n)).collect();
        let batch: Vec<&str> = renewed_keys
            .iter()
            .flatten()
            .chain(read_keys.iter().flatten())
            .map(String::as_str)
            .collect();
        let mut args: Vec<Vec<u8>> = vec![renewals.len().to_string().into_bytes()];
        for renewal in renewals {
            let lease_ms = u64::try_from(renewal.record.lease_duration.as_millis())
                .unwrap_or(u64::MAX)
                .max(1);
            args.push(renewal.version.as_str().as_bytes().to_vec());
            args.push(lease_ms.to_string().into_bytes());
        }
        // Versions are decimal numbers: `-` cannot be one.
        args.extend(known.iter().map(|k| match k {
            Known::Nothing => Vec::new(),
            Known::Absent => b"-".to_vec(),
            Known::Version(v) => v.as_str().as_bytes().to_vec(),
        }));
        let args: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        // A read of many records alone goes on the bulk connection; renewals, with a read of
        // the few records a round reads beside them or without, on the main one.
        let lane = if renewals.is_empty() && names.len() > BULK_READ {
            Lane::Bulk
        } else {
            Lane::Main
        };
        let (renewed, entries): (Vec<i64>, Vec<Vec<Value>>) = eval(
            &self.store,
            lane,
            &scripts::RENEW_AND_READ,
            &batch,
            &args,
            || self.context(),
        )
        .await?;
        if renewed.len() != renewals.len() || entries.len() != names.len() {
            return Err(LockError::unavailable(
                BACKEND,
                "a batch answer of the wrong length",
            ));
        }
        let entries = entries
            .into_iter()
            .zip(&read_keys)
            .map(|(entry, keys)| self.entry(entry, &keys[0]))
            .collect();
        Ok((renewed.into_iter().map(|done| done == 1).collect(), entries))
    }

    /// Decodes one entry of a read script's answer for the election whose hash is `key` (its
    /// context formatted only for an error: a read of every shard decodes thousands).
    fn entry(&self, entry: Vec<Value>, key: &str) -> Result<Reread, LockError> {
        let context = KeyContext {
            url: &self.store.inner.redacted,
            key,
        };
        let bad = |what: &str| LockError::invalid_record(BACKEND, format!("{context}: {what}"));
        let text = |v: Value| redis::from_redis_value::<String>(v).map_err(|_| bad("not text"));
        let len = entry.len();
        let mut fields = entry.into_iter();
        match fields.next().map(redis::from_redis_value::<i64>) {
            Some(Ok(0)) => Ok(Reread::Now(None)),
            Some(Ok(1)) if len == 5 => {
                let (Some(version), Some(holder), Some(transitions), Some(json)) =
                    (fields.next(), fields.next(), fields.next(), fields.next())
                else {
                    return Err(bad("an answer this version does not know"));
                };
                let transitions = redis::from_redis_value::<i64>(transitions)
                    .map_err(|_| bad("a fencing token that is not a number"))?;
                decode(
                    context,
                    text(version)?,
                    text(holder)?,
                    transitions,
                    &text(json)?,
                )
                .map(|observed| Reread::Now(Some(observed)))
            }
            Some(Ok(2)) if len == 2 => {
                let message = fields.next().map(text).transpose()?.unwrap_or_default();
                Err(bad(message.trim_start_matches("LEADER_INVALID ")))
            }
            Some(Ok(3)) if len == 1 => Ok(Reread::Same),
            _ => Err(bad("an answer this version does not know")),
        }
    }

    /// Whether `err` is a cluster's refusal of keys in several slots: then batches stop.
    fn refused_by_cluster(&self, err: &LockError) -> bool {
        let refused = is_cross_slot(err);
        if refused {
            tracing::warn!(
                "the Redis server refuses scripts over several slots: a request per record from now on"
            );
            self.per_key.store(true, Ordering::Relaxed);
        }
        refused
    }
}

/// How many records a read may name and still go on the main connection.
const BULK_READ: usize = 64;

/// The context of a record's errors: the server and the record's key.
#[derive(Clone, Copy)]
struct KeyContext<'a> {
    url: &'a str,
    key: &'a str,
}

impl std::fmt::Display for KeyContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} key {}", self.url, self.key)
    }
}

#[async_trait]
impl LockSet for RedisLockSet {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.locks.lock(key)
    }

    /// A record's hash expires (`PEXPIRE`) a lease after its holder's last write: a member that
    /// died is gone from the next read.
    fn reads_show_expiry(&self) -> bool {
        true
    }

    fn identity(&self) -> &str {
        self.locks.identity()
    }

    fn describe(&self) -> String {
        self.locks.describe()
    }

    async fn get_many(&self, names: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        if self.per_key.load(Ordering::Relaxed) {
            return self.locks.get_many(names).await;
        }
        // The changed-records read, holding nothing: every record is sent.
        self.get_changed(names, &vec![Known::Nothing; names.len()])
            .await
            .into_iter()
            .map(|entry| match entry {
                Ok(Reread::Now(observed)) => Ok(observed),
                Ok(Reread::Same) => Err(LockError::invalid_record(
                    BACKEND,
                    format!("{}: unchanged, though no version was given", self.context()),
                )),
                Err(err) => Err(err),
            })
            .collect()
    }

    /// One script: a record still at the version given is answered after a single `HGET` on
    /// the server (one still absent after an `EXISTS`), and neither sent nor decoded.
    async fn get_changed(
        &self,
        names: &[String],
        known: &[Known<'_>],
    ) -> Vec<Result<Reread, LockError>> {
        self.renew_and_read(&[], names, known).await.read
    }

    /// One script, whatever the number of records.
    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        self.renew_and_read(renewals, &[], &[]).await.renewed
    }

    /// One script: the renewals, then the read.
    async fn renew_and_read(
        &self,
        renewals: &[Renewal],
        names: &[String],
        known: &[Known<'_>],
    ) -> RenewedAndRead {
        if self.per_key.load(Ordering::Relaxed) || names.len() != known.len() {
            return self.locks.renew_and_read(renewals, names, known).await;
        }
        let (renewed, read) = match self.round(renewals, names, known).await {
            Ok(answer) => answer,
            Err(err) if self.refused_by_cluster(&err) => {
                return self.locks.renew_and_read(renewals, names, known).await;
            }
            Err(err) => {
                return RenewedAndRead {
                    renewed: err.for_each(renewals.len()),
                    read: err.for_each(names.len()),
                };
            }
        };
        let renewed = renewals
            .iter()
            .zip(renewed)
            .map(|(renewal, done)| {
                if done {
                    // Renewed in the store: the record and its version stay as they were.
                    Ok(Observed {
                        record: renewal.record.clone(),
                        version: renewal.version.clone(),
                    })
                } else {
                    Err(LockError::conflict(BACKEND))
                }
            })
            .collect();
        RenewedAndRead { renewed, read }
    }
}
