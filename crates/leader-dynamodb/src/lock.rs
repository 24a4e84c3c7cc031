//! The lock: one item per election, written only with conditions, and a floor item per
//! election that keeps the highest fencing token issued.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem, Update};
use leader_core::{LeaderElectionRecord, LockError, Observed, ResourceLock, Version};

use crate::error::{BACKEND, Context, map};
use crate::store::{DynamoStore, KEY_ATTRIBUTE};

/// The record, as JSON (a string attribute).
pub(crate) const RECORD: &str = "record";
/// The version: a new random number at every write, which every write is conditioned on.
pub(crate) const VERSION: &str = "version";
/// The record's fencing token (`leaderTransitions`), for the conditions of writes.
pub(crate) const TOKEN: &str = "token";
/// The floor item's attribute: the highest fencing token ever issued for the election.
pub(crate) const FENCE: &str = "fence";
/// The key prefix of the floor items; election names never start with it.
pub const FLOOR_PREFIX: &str = ".leader-fence/";

/// How often a write that starts a term tries again with a raised token after the floor
/// showed a higher one (another writer may raise the floor in between).
const FLOOR_ATTEMPTS: usize = 3;

impl DynamoStore {
    /// A lock on election `name` (the item whose key is `name`) for candidate `identity`.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> DynamoLock {
        let name = name.into();
        DynamoLock {
            store: self.clone(),
            describe: format!("dynamodb:{}/{name}", self.inner.table),
            name,
            identity: identity.into(),
            last: Arc::default(),
        }
    }
}

/// A [`ResourceLock`] on one item of a DynamoDB table:
///
/// - The item's key is the election's name; the record is its `record` attribute (the
///   record's JSON), beside `version` and `token` (the record's `leaderTransitions`).
/// - Every write is conditional: `create` on `attribute_not_exists(name)`, `update` on
///   `version` being the one read. Every write stores a new random `version` (S14), so a stale
///   writer's condition fails even when the record it writes is the one stored, and even after
///   the item was deleted and made again.
/// - Every read is strongly consistent (`ConsistentRead`).
/// - Fencing tokens are the record's `leaderTransitions`, raised by the elector at every
///   acquisition. A write that stores a token other than the stored one (a new term, or a new
///   item) is a transaction (`TransactWriteItems`) that also raises the election's floor item
///   (key `.leader-fence/NAME`, never deleted by the lock) on the condition that the floor is
///   below the new token; when it is not, the token is raised above the floor. So tokens keep
///   growing after the record's item is deleted (by hand, or by a TTL someone set).
/// - Renewals (same token) are one conditional `PutItem`.
/// - No store-clock acquisition (a condition cannot read DynamoDB's clock): followers wait out
///   the holder's lease on their own monotonic clock (S2). TTL never decides a lease.
#[derive(Clone)]
pub struct DynamoLock {
    store: DynamoStore,
    name: String,
    describe: String,
    identity: String,
    /// The version this lock read or wrote last, with the token stored there.
    last: Arc<Mutex<Option<(Version, u64)>>>,
}

impl fmt::Debug for DynamoLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoLock")
            .field("lock", &self.describe)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// A fresh version, unlike `previous`: a random number in `[2^62, 2^63)`, so that a version
/// never repeats by chance and, read as a time (a TTL someone set on it), lies centuries
/// ahead.
pub(crate) fn new_version(previous: Option<&Version>) -> u64 {
    loop {
        let version = fastrand::u64((1 << 62)..(1 << 63));
        if previous.is_none_or(|p| p.as_str() != version.to_string()) {
            return version;
        }
    }
}

/// The key of an item.
pub(crate) fn key(name: &str) -> HashMap<String, AttributeValue> {
    HashMap::from([(KEY_ATTRIBUTE.to_owned(), AttributeValue::S(name.to_owned()))])
}

/// The item that stores `record` under `name` at `version`.
pub(crate) fn item(
    name: &str,
    record: &LeaderElectionRecord,
    version: u64,
) -> Result<HashMap<String, AttributeValue>, LockError> {
    let json = String::from_utf8(record.to_json())
        .map_err(|err| LockError::other(BACKEND, format!("a record's JSON: {err}")))?;
    Ok(HashMap::from([
        (KEY_ATTRIBUTE.to_owned(), AttributeValue::S(name.to_owned())),
        (RECORD.to_owned(), AttributeValue::S(json)),
        (VERSION.to_owned(), AttributeValue::N(version.to_string())),
        (
            TOKEN.to_owned(),
            AttributeValue::N(record.leader_transitions.to_string()),
        ),
    ]))
}

/// The record and version an item holds.
pub(crate) fn decode(
    context: &str,
    item: &HashMap<String, AttributeValue>,
) -> Result<Observed, LockError> {
    let record = match item.get(RECORD) {
        Some(AttributeValue::S(json)) => {
            LeaderElectionRecord::from_json(BACKEND, context, json.as_bytes())?
        }
        Some(other) => {
            return Err(LockError::invalid_record(
                BACKEND,
                format!("{context}: the attribute `{RECORD}` is not a string: {other:?}"),
            ));
        }
        None => {
            return Err(LockError::invalid_record(
                BACKEND,
                format!("{context}: the item has no attribute `{RECORD}`"),
            ));
        }
    };
    let version = match item.get(VERSION) {
        Some(AttributeValue::N(number)) if number.parse::<u64>().is_ok() => number.clone(),
        _ => {
            return Err(LockError::invalid_record(
                BACKEND,
                format!("{context}: the item has no numeric attribute `{VERSION}`"),
            ));
        }
    };
    Ok(Observed {
        record,
        version: Version::new(version),
    })
}

/// The conditional `Put` of a renewal (or any write of the stored token): the version read, and
/// the token stored there.
pub(crate) fn same_term_put(
    table: &str,
    name: &str,
    expected: &Version,
    record: &LeaderElectionRecord,
) -> Result<(Put, u64), LockError> {
    let version = new_version(Some(expected));
    let put = Put::builder()
        .table_name(table)
        .set_item(Some(item(name, record, version)?))
        .condition_expression("#v = :v AND #t = :t")
        .expression_attribute_names("#v", VERSION)
        .expression_attribute_names("#t", TOKEN)
        .expression_attribute_values(":v", AttributeValue::N(expected.as_str().to_owned()))
        .expression_attribute_values(
            ":t",
            AttributeValue::N(record.leader_transitions.to_string()),
        )
        .build()
        .map_err(|err| LockError::other(BACKEND, err))?;
    Ok((put, version))
}

/// Whether `version` is one this lock could have issued (a number), else a write on it can
/// only fail.
fn usable(version: &Version) -> bool {
    version.as_str().parse::<u64>().is_ok()
}

impl DynamoLock {
    /// The election's name: the item's key.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn context(&self) -> Context {
        self.store.context(self.describe.clone())
    }

    fn remember(&self, observed: Option<&Observed>) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) =
            observed.map(|o| (o.version.clone(), o.record.leader_transitions));
    }

    /// The token this lock knows is stored at `version`.
    fn known_token(&self, version: &Version) -> Option<u64> {
        self.last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|(v, _)| v == version)
            .map(|(_, token)| *token)
    }

    fn check_name(&self) -> Result<(), LockError> {
        if self.name.starts_with(FLOOR_PREFIX) || self.name.is_empty() {
            return Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "{}: an election's name is not empty and does not start with \
                     {FLOOR_PREFIX} (the lock's floor items)",
                    self.describe
                ),
            });
        }
        Ok(())
    }

    /// A write of the token stored at `expected`: one conditional `PutItem`.
    async fn write_same_term(
        &self,
        expected: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let (put, version) = same_term_put(&self.store.inner.table, &self.name, expected, record)?;
        let answer = self
            .store
            .inner
            .client
            .put_item()
            .table_name(put.table_name)
            .set_item(Some(put.item))
            .set_condition_expression(put.condition_expression)
            .set_expression_attribute_names(put.expression_attribute_names)
            .set_expression_attribute_values(put.expression_attribute_values)
            .send()
            .await;
        match answer {
            Ok(_) => {
                let observed = Observed {
                    record: record.clone(),
                    version: Version::new(version.to_string()),
                };
                self.remember(Some(&observed));
                Ok(observed)
            }
            Err(err) if err.code() == Some("ConditionalCheckFailedException") => {
                Err(LockError::conflict(BACKEND))
            }
            Err(err) => Err(map(&self.context(), "update", "dynamodb:PutItem", err)),
        }
    }

    /// A write that starts a term (a new item, or a token other than the stored one): one
    /// transaction of the record's conditional `Put` and the floor's conditional raise. The
    /// table's settings are checked again first (S15: replicas can be added to a running
    /// table).
    async fn write_new_term(
        &self,
        expected: Option<&Version>,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        self.store.check_table_for_term().await?;
        let mut record = record.clone();
        for _ in 0..FLOOR_ATTEMPTS {
            match self.transact(expected, &record).await? {
                Ok(version) => {
                    let observed = Observed {
                        record,
                        version: Version::new(version.to_string()),
                    };
                    self.remember(Some(&observed));
                    return Ok(observed);
                }
                Err(floor) => {
                    tracing::debug!(
                        lock = %self.describe,
                        floor,
                        asked = record.leader_transitions,
                        "raising the fencing token above the floor"
                    );
                    record.leader_transitions = floor.saturating_add(1);
                }
            }
        }
        Err(LockError::unavailable(
            BACKEND,
            format!(
                "{}: the fencing-token floor kept moving during {FLOOR_ATTEMPTS} attempts",
                self.describe
            ),
        ))
    }

    /// One attempt of [`write_new_term`](Self::write_new_term): the version written, or the
    /// floor that is not below the record's token.
    async fn transact(
        &self,
        expected: Option<&Version>,
        record: &LeaderElectionRecord,
    ) -> Result<Result<u64, u64>, LockError> {
        let table = &self.store.inner.table;
        let version = new_version(expected);
        let mut put = Put::builder()
            .table_name(table)
            .set_item(Some(item(&self.name, record, version)?));
        put = match expected {
            None => put
                .condition_expression("attribute_not_exists(#k)")
                .expression_attribute_names("#k", KEY_ATTRIBUTE),
            Some(expected) => put
                .condition_expression("#v = :v")
                .expression_attribute_names("#v", VERSION)
                .expression_attribute_values(":v", AttributeValue::N(expected.as_str().to_owned())),
        };
        let put = put.build().map_err(|err| LockError::other(BACKEND, err))?;
        let token = AttributeValue::N(record.leader_transitions.to_string());
        let floor = Update::builder()
            .table_name(table)
            .set_key(Some(key(&self.floor_key())))
            .update_expression("SET #f = :t")
            .condition_expression("attribute_not_exists(#f) OR #f < :t")
            .expression_attribute_names("#f", FENCE)
            .expression_attribute_values(":t", token)
            .build()
            .map_err(|err| LockError::other(BACKEND, err))?;
        let answer = self
            .store
            .inner
            .client
            .transact_write_items()
            .transact_items(TransactWriteItem::builder().put(put).build())
            .transact_items(TransactWriteItem::builder().update(floor).build())
            .send()
            .await;
        let err = match answer {
            Ok(_) => return Ok(Ok(version)),
            Err(err) => err,
        };
        let operation = if expected.is_some() {
            "update"
        } else {
            "create"
        };
        let reasons = cancellation_reasons(&err);
        match reasons.as_slice() {
            [Some("ConditionalCheckFailed"), ..] => Err(LockError::conflict(BACKEND)),
            [_, Some("ConditionalCheckFailed")] => Ok(Err(self.read_floor().await?)),
            [] => Err(map(
                &self.context(),
                operation,
                "dynamodb:PutItem and dynamodb:UpdateItem (a transaction)",
                err,
            )),
            reasons => Err(LockError::unavailable(
                BACKEND,
                format!(
                    "{}: the transaction was cancelled ({}); retried at the retry period",
                    self.describe,
                    reasons
                        .iter()
                        .map(|r| r.unwrap_or("None"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    fn floor_key(&self) -> String {
        format!("{FLOOR_PREFIX}{}", self.name)
    }

    /// The item named `name`, read strongly consistent.
    async fn read_item(
        &self,
        name: &str,
    ) -> Result<Option<HashMap<String, AttributeValue>>, LockError> {
        let answer = self
            .store
            .inner
            .client
            .get_item()
            .table_name(&self.store.inner.table)
            .set_key(Some(key(name)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|err| map(&self.context(), "get", "dynamodb:GetItem", err))?;
        Ok(answer.item)
    }

    /// The election's floor: the highest token issued (0 when none was).
    async fn read_floor(&self) -> Result<u64, LockError> {
        let item = self.read_item(&self.floor_key()).await?;
        match item.as_ref().and_then(|item| item.get(FENCE)) {
            None => Ok(0),
            Some(AttributeValue::N(number)) => number.parse().map_err(|_| {
                LockError::invalid_record(
                    BACKEND,
                    format!("{}: the floor item's `{FENCE}` is {number}", self.describe),
                )
            }),
            Some(other) => Err(LockError::invalid_record(
                BACKEND,
                format!(
                    "{}: the floor item's `{FENCE}` is not a number: {other:?}",
                    self.describe
                ),
            )),
        }
    }
}

/// The codes of a cancelled transaction's reasons, one per item (`None` for an item that was
/// fine); empty for any other error.
pub(crate) fn cancellation_reasons<R>(
    err: &SdkError<TransactWriteItemsError, R>,
) -> Vec<Option<&str>> {
    match err.as_service_error() {
        Some(TransactWriteItemsError::TransactionCanceledException(cancelled)) => cancelled
            .cancellation_reasons()
            .iter()
            .map(|reason| reason.code().filter(|code| *code != "None"))
            .collect(),
        _ => Vec::new(),
    }
}

#[async_trait]
impl ResourceLock for DynamoLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        self.check_name()?;
        let Some(item) = self.read_item(&self.name).await? else {
            self.remember(None);
            return Ok(None);
        };
        let observed = decode(&self.describe, &item)?;
        self.remember(Some(&observed));
        Ok(Some(observed))
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        self.check_name()?;
        self.write_new_term(None, record).await
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        self.check_name()?;
        if !usable(version) {
            return Err(LockError::conflict(BACKEND));
        }
        self.store.check_table().await?;
        match self.known_token(version) {
            Some(token) if token == record.leader_transitions => {
                self.write_same_term(version, record).await
            }
            Some(_) => self.write_new_term(Some(version), record).await,
            // Unknown: a write of the stored token is the common case (a renewal after a
            // batch read); if the token differs, the condition says so and the term starts.
            None => match self.write_same_term(version, record).await {
                Err(LockError::Conflict { .. }) => self.write_new_term(Some(version), record).await,
                other => other,
            },
        }
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_fresh_and_far_from_any_time() {
        let previous = Version::new(new_version(None).to_string());
        for _ in 0..1000 {
            let version = new_version(Some(&previous));
            assert_ne!(version.to_string(), previous.as_str());
            assert!(version >= 1 << 62, "{version}");
        }
    }

    #[test]
    fn items_round_trip_and_garbage_is_invalid() {
        let record = leader_core::conformance::record("a", 3);
        let stored = item("app", &record, 1 << 62).expect("an item");
        let observed = decode("app", &stored).expect("decodes");
        assert_eq!(observed.record, record);
        assert_eq!(observed.version.as_str(), (1u64 << 62).to_string());
        let mut garbage = stored.clone();
        garbage.insert(RECORD.to_owned(), AttributeValue::N("5".to_owned()));
        assert!(matches!(
            decode("app", &garbage),
            Err(LockError::InvalidRecord { .. })
        ));
        let mut no_version = stored;
        no_version.remove(VERSION);
        assert!(matches!(
            decode("app", &no_version),
            Err(LockError::InvalidRecord { .. })
        ));
    }
}
