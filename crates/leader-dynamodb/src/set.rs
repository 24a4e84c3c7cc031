//! A shard set's records in the lock table: read with `BatchGetItem`, renewed with
//! `TransactWriteItems`, up to 100 records a request.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use aws_sdk_dynamodb::types::{KeysAndAttributes, TransactWriteItem};
use leader_core::backend::{Backoff, Jitter, KeyedLocks, LockErrorExt, Renewal};
use leader_core::{LockError, LockSet, Observed, ResourceLock, Version, async_trait};

use crate::error::{BACKEND, map};
use crate::lock::{FLOOR_PREFIX, cancellation_reasons, decode, key, same_term_put};
use crate::store::{DynamoStore, KEY_ATTRIBUTE};

/// The most keys one `BatchGetItem` reads, and the most items one `TransactWriteItems` writes.
pub const BATCH_LIMIT: usize = 100;

/// The wait before a read asks again for the keys DynamoDB left unprocessed, doubling with each
/// answer that leaves some, up to [`UNPROCESSED_LONGEST_WAIT`]: DynamoDB leaves keys unread when
/// the table is throttled, and asking again at once adds to the load that throttles it.
const UNPROCESSED_FIRST_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// The longest wait between two reads of the keys DynamoDB left unprocessed: short enough that
/// a read the table serves a part at a time still ends within the request timeout (ten
/// answers take under four seconds of waits).
const UNPROCESSED_LONGEST_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// The records of a shard set, items of one lock table ([`DynamoStore::lock_set`]).
/// [`get_many`](LockSet::get_many) is one strongly consistent `BatchGetItem` per 100 records
/// (again for the keys DynamoDB left unprocessed, after a wait that doubles each time; a read
/// whose next wait would pass the request timeout fails at once, as unavailable),
/// [`renew_many`](LockSet::renew_many) one `TransactWriteItems` per 100 renewals, each renewal
/// conditioned on its version as a [`DynamoLock`](crate::DynamoLock)'s renewal is. A transaction is all or nothing: when one
/// renewal's condition fails, DynamoDB says which, that one is a conflict and the others are
/// sent again. Each renewal in a transaction costs two write units instead of one.
#[derive(Clone, Debug)]
pub struct DynamoLockSet {
    store: DynamoStore,
    locks: KeyedLocks,
}

impl DynamoStore {
    /// The records of a shard set, as member `identity`: a [`DynamoLock`](crate::DynamoLock)
    /// per key, read and renewed in batches.
    pub fn lock_set(&self, identity: impl Into<String>) -> DynamoLockSet {
        let store = self.clone();
        let describe = format!("dynamodb:{}", self.inner.table);
        DynamoLockSet {
            store: self.clone(),
            locks: KeyedLocks::new(identity, describe, move |key, identity| {
                Arc::new(store.lock(key, identity))
            }),
        }
    }
}

impl DynamoLockSet {
    /// Reads `keys` (distinct, at most [`BATCH_LIMIT`]): each key's item, if any.
    async fn read_batch(
        &self,
        keys: &[&str],
    ) -> Result<HashMap<String, HashMap<String, aws_sdk_dynamodb::types::AttributeValue>>, LockError>
    {
        let table = &self.store.inner.table;
        let context = self.store.context(self.describe());
        let mut pending: Vec<_> = keys.iter().map(|name| key(name)).collect();
        let mut found = HashMap::new();
        let deadline = tokio::time::Instant::now() + self.store.inner.timeout;
        let mut backoff = Backoff::new(UNPROCESSED_FIRST_WAIT, UNPROCESSED_LONGEST_WAIT)
            .jitter(Jitter::Longer(0.2));
        while !pending.is_empty() {
            let request = KeysAndAttributes::builder()
                .set_keys(Some(std::mem::take(&mut pending)))
                .consistent_read(true)
                .build()
                .map_err(|err| LockError::other(BACKEND, err))?;
            let answer = self
                .store
                .inner
                .client
                .batch_get_item()
                .request_items(table, request)
                .send()
                .await
                .map_err(|err| map(&context, "get", "dynamodb:BatchGetItem", err))?;
            for item in answer
                .responses
                .unwrap_or_default()
                .remove(table)
                .unwrap_or_default()
            {
                if let Some(aws_sdk_dynamodb::types::AttributeValue::S(name)) =
                    item.get(KEY_ATTRIBUTE)
                {
                    found.insert(name.clone(), item);
                }
            }
            // Keys DynamoDB did not read (throughput, size): asked again after a wait that
            // doubles, as DynamoDB asks of a client it throttles, within the timeout.
            pending = answer
                .unprocessed_keys
                .unwrap_or_default()
                .remove(table)
                .map(|unread| unread.keys)
                .unwrap_or_default();
            if !pending.is_empty() {
                let wait = backoff.failed();
                if tokio::time::Instant::now() + wait >= deadline {
                    return Err(LockError::unavailable(
                        BACKEND,
                        format!(
                            "{}: {} keys were left unprocessed (throttled) within {:?}",
                            context.what,
                            pending.len(),
                            context.timeout
                        ),
                    ));
                }
                tokio::time::sleep(wait).await;
            }
        }
        Ok(found)
    }

    /// Renews `renewals` (at most [`BATCH_LIMIT`], distinct keys) in transactions: one, and
    /// again without the ones whose condition failed, as long as nothing else cancelled it.
    async fn renew_batch(&self, renewals: &[&Renewal]) -> Vec<Result<Observed, LockError>> {
        let table = &self.store.inner.table;
        let context = self.store.context(self.describe());
        let mut answers: Vec<Option<Result<Observed, LockError>>> =
            renewals.iter().map(|_| None).collect();
        loop {
            let mut sent = Vec::new();
            let mut items = Vec::new();
            for (i, renewal) in renewals.iter().enumerate() {
                if answers[i].is_some() {
                    continue;
                }
                match same_term_put(table, &renewal.key, &renewal.version, &renewal.record) {
                    Ok((put, version)) => {
                        sent.push((i, version));
                        items.push(TransactWriteItem::builder().put(put).build());
                    }
                    Err(err) => answers[i] = Some(Err(err)),
                }
            }
            if items.is_empty() {
                break;
            }
            let answer = self
                .store
                .inner
                .client
                .transact_write_items()
                .set_transact_items(Some(items))
                .send()
                .await;
            match answer {
                Ok(_) => {
                    for (i, version) in sent {
                        answers[i] = Some(Ok(Observed {
                            record: renewals[i].record.clone(),
                            version: Version::new(version.to_string()),
                        }));
                    }
                    break;
                }
                Err(err) => {
                    let reasons = cancellation_reasons(&err);
                    let failed: Vec<(usize, &str)> = sent
                        .iter()
                        .zip(&reasons)
                        .filter_map(|((i, _), reason)| reason.map(|code| (*i, code)))
                        .collect();
                    if reasons.len() != sent.len() || failed.is_empty() {
                        let err = map(
                            &context,
                            "renew",
                            "dynamodb:PutItem (in TransactWriteItems)",
                            err,
                        );
                        for (i, _) in sent {
                            answers[i] = Some(Err(err.duplicate()));
                        }
                        break;
                    }
                    // Sent again at once only when every failure was a lost condition: a
                    // throttled or conflicting item would likely cancel the next one too, so
                    // then the rest are unavailable, and the elector's back-off applies.
                    let other = failed
                        .iter()
                        .find(|(_, code)| *code != "ConditionalCheckFailed")
                        .map(|(_, code)| *code);
                    for (i, code) in failed {
                        answers[i] = Some(Err(if code == "ConditionalCheckFailed" {
                            LockError::conflict(BACKEND)
                        } else {
                            LockError::unavailable(
                                BACKEND,
                                format!(
                                    "{}: renewal of {} cancelled ({code})",
                                    context.what, renewals[i].key
                                ),
                            )
                        }));
                    }
                    if let Some(code) = other {
                        for (i, _) in sent {
                            answers[i].get_or_insert_with(|| {
                                Err(LockError::unavailable(
                                    BACKEND,
                                    format!(
                                        "{}: renewal of {} cancelled with another item's ({code})",
                                        context.what, renewals[i].key
                                    ),
                                ))
                            });
                        }
                        break;
                    }
                }
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| Err(LockError::conflict(BACKEND))))
            .collect()
    }
}

/// Whether `key` may name a record (not empty, not a floor item).
fn check_key(key: &str, describe: &str) -> Result<(), LockError> {
    if key.is_empty() || key.starts_with(FLOOR_PREFIX) {
        return Err(LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{describe}: a record's name is not empty and does not start with {FLOOR_PREFIX}"
            ),
        });
    }
    Ok(())
}

#[async_trait]
impl LockSet for DynamoLockSet {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.locks.lock(key)
    }

    fn identity(&self) -> &str {
        self.locks.identity()
    }

    fn describe(&self) -> String {
        self.locks.describe()
    }

    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        let describe = self.describe();
        let mut distinct: Vec<&str> = Vec::new();
        let mut seen = HashSet::new();
        for key in keys {
            if check_key(key, &describe).is_ok() && seen.insert(key.as_str()) {
                distinct.push(key);
            }
        }
        let mut found = HashMap::new();
        for chunk in distinct.chunks(BATCH_LIMIT) {
            match self.read_batch(chunk).await {
                Ok(items) => found.extend(items),
                Err(err) => return err.for_each(keys.len()),
            }
        }
        keys.iter()
            .map(|key| {
                check_key(key, &describe)?;
                match found.get(key) {
                    None => Ok(None),
                    Some(item) => decode(&format!("{describe}/{key}"), item).map(Some),
                }
            })
            .collect()
    }

    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        if let Err(err) = self.store.check_table().await {
            return err.for_each(renewals.len());
        }
        let describe = self.describe();
        let mut answers: Vec<Option<Result<Observed, LockError>>> =
            renewals.iter().map(|_| None).collect();
        // A transaction writes an item once: a key named twice goes to a later round.
        let mut left: Vec<usize> = Vec::new();
        for (i, renewal) in renewals.iter().enumerate() {
            match check_key(&renewal.key, &describe) {
                Ok(()) => left.push(i),
                Err(err) => answers[i] = Some(Err(err)),
            }
        }
        while !left.is_empty() {
            let mut keys = HashSet::new();
            let (round, later): (Vec<usize>, Vec<usize>) = left
                .iter()
                .partition(|&&i| keys.len() < BATCH_LIMIT && keys.insert(&renewals[i].key));
            let batch: Vec<&Renewal> = round.iter().map(|&i| &renewals[i]).collect();
            for (i, answer) in round.iter().zip(self.renew_batch(&batch).await) {
                answers[*i] = Some(answer);
            }
            left = later;
        }
        answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| Err(LockError::conflict(BACKEND))))
            .collect()
    }
}
