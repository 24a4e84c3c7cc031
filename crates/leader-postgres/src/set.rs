//! A shard set's records in the lock table: one statement renews all of a member's and reads
//! them all.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use leader_core::backend::{
    KeyedLocks, Known, LockErrorExt, RecordColumns, Renewal, RenewedAndRead, Reread,
};
use leader_core::{LockError, LockSet, Observed, ResourceLock, Version, async_trait};

use crate::error::{BACKEND, map};
use crate::param::{Typed, typed};
use crate::sql::{VERSION, decode, parse_version};
use crate::store::PostgresStore;

/// The records of a shard set, rows of one lock table ([`PostgresStore::lock_set`]).
/// [`get_many`](LockSet::get_many), [`renew_many`](LockSet::renew_many) and a round of both
/// ([`renew_and_read`](LockSet::renew_and_read)) are one statement each, whatever the number of
/// records; each row keeps the table lock's contract.
#[derive(Clone, Debug)]
pub struct PostgresLockSet {
    store: PostgresStore,
    locks: KeyedLocks,
}

impl PostgresStore {
    /// The records of a shard set, as member `identity`: a [`TableLock`](crate::TableLock) per
    /// key, read and renewed in batches.
    pub fn lock_set(&self, identity: impl Into<String>) -> PostgresLockSet {
        let store = self.clone();
        let describe = format!("postgres:{}", self.inner().table.display());
        PostgresLockSet {
            store: self.clone(),
            locks: KeyedLocks::new(identity, describe, move |key, identity| {
                Arc::new(store.lock(key, identity))
            }),
        }
    }
}

impl PostgresLockSet {
    async fn query(
        &self,
        sql: &str,
        params: &[Typed<'_>],
    ) -> Result<Vec<tokio_postgres::Row>, LockError> {
        let context = self.store.context();
        let client = self.store.client().await?;
        let rows = client.query_typed(sql, params).await;
        client.answered(rows.map_err(|err| map(&context, err)))
    }
}

#[async_trait]
impl LockSet for PostgresLockSet {
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
        let sql = &self.store.inner().table_statements.get_many;
        let rows = match self.query(sql, &[typed(&keys)]).await {
            Ok(rows) => rows,
            Err(err) => return err.for_each(keys.len()),
        };
        let context = self.store.context();
        let mut found: HashMap<&str, Result<Observed, LockError>> = rows
            .iter()
            .map(|row| {
                let name: &str = row.get(0);
                let observed = decode(row, 1, format_args!("{context} election {name:?}"));
                (name, observed)
            })
            .collect();
        keys.iter()
            .map(|key| found.remove(key.as_str()).transpose())
            .collect()
    }

    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        let (columns, unusable) = Columns::of(renewals);
        let sql = &self.store.inner().table_statements.renew_many;
        let rows = match self.query(sql, &columns.params()).await {
            Ok(rows) => rows,
            Err(err) => return err.for_each(renewals.len()),
        };
        let written: HashMap<String, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        answer_renewals(renewals, unusable, |key| written.get(key).copied())
    }

    /// One statement: the renewals, then the read, which sees them.
    async fn renew_and_read(
        &self,
        renewals: &[Renewal],
        keys: &[String],
        known: &[Known<'_>],
    ) -> RenewedAndRead {
        if renewals.is_empty() {
            let read = self.get_changed(keys, known).await;
            return RenewedAndRead {
                renewed: Vec::new(),
                read,
            };
        }
        let (columns, unusable) = Columns::of(renewals);
        let mut params = columns.params().to_vec();
        params.push(typed(&keys));
        let sql = &self.store.inner().table_statements.renew_and_read;
        let rows = match self.query(sql, &params).await {
            Ok(rows) => rows,
            Err(err) => {
                return RenewedAndRead {
                    renewed: err.for_each(renewals.len()),
                    read: err.for_each(keys.len()),
                };
            }
        };
        let context = self.store.context();
        let asked: HashSet<&str> = keys.iter().map(String::as_str).collect();
        let mut written: HashMap<&str, i64> = HashMap::new();
        let mut found: HashMap<&str, Result<Observed, LockError>> = HashMap::new();
        for row in &rows {
            let name: &str = row.get(1);
            // A renewal's answer is its row's new version alone (the row holds what the
            // renewal wrote); only a row the read asked for is decoded, as read.
            if row.get::<_, bool>(0) {
                if let Ok(version) = row.try_get::<_, i64>(2 + VERSION) {
                    written.insert(name, version);
                }
                if !asked.contains(name) {
                    continue;
                }
            }
            let observed = decode(row, 2, format_args!("{context} election {name:?}"));
            found.insert(name, observed);
        }
        let renewed = answer_renewals(renewals, unusable, |key| written.get(key).copied());
        let read = keys
            .iter()
            .map(|key| found.remove(key.as_str()).transpose().map(Reread::Now))
            .collect();
        RenewedAndRead { renewed, read }
    }
}

/// The answer to each renewal: its error if it could not be sent, else the version `written`
/// gives its key, or a conflict when the row was not written.
fn answer_renewals(
    renewals: &[Renewal],
    mut unusable: HashMap<usize, LockError>,
    written: impl Fn(&str) -> Option<i64>,
) -> Vec<Result<Observed, LockError>> {
    renewals
        .iter()
        .enumerate()
        .map(|(i, renewal)| {
            if let Some(err) = unusable.remove(&i) {
                return Err(err);
            }
            match written(&renewal.key) {
                Some(version) => Ok(Observed {
                    record: renewal.record.clone(),
                    version: Version::from(version),
                }),
                None => Err(LockError::conflict(BACKEND)),
            }
        })
        .collect()
}

/// The renewals as the columns `renew_many` unnests.
#[derive(Default)]
struct Columns {
    names: Vec<String>,
    holders: Vec<String>,
    lease_ms: Vec<i64>,
    acquire: Vec<DateTime<Utc>>,
    renew: Vec<DateTime<Utc>>,
    transitions: Vec<i64>,
    strategy: Vec<Option<String>>,
    preferred: Vec<Option<String>>,
    extensions: Vec<Option<String>>,
    expected: Vec<i64>,
}

impl Columns {
    /// The columns of `renewals`, and the error of each that cannot be sent (by its index).
    fn of(renewals: &[Renewal]) -> (Self, HashMap<usize, LockError>) {
        let mut columns = Self::default();
        let mut unusable = HashMap::new();
        for (i, renewal) in renewals.iter().enumerate() {
            let params = RecordColumns::new(&renewal.record, BACKEND);
            match (params, parse_version(&renewal.version)) {
                (Ok(params), Some(expected)) => columns.push(&renewal.key, params, expected),
                (Err(err), _) => {
                    unusable.insert(i, err);
                }
                // A version this table never issued matches no row.
                (_, None) => {
                    unusable.insert(i, LockError::conflict(BACKEND));
                }
            }
        }
        (columns, unusable)
    }

    fn push(&mut self, name: &str, p: RecordColumns, expected: i64) {
        self.names.push(name.to_owned());
        self.holders.push(p.holder);
        self.lease_ms.push(p.lease_ms);
        self.acquire.push(p.acquire);
        self.renew.push(p.renew);
        self.transitions.push(p.transitions);
        self.strategy.push(p.strategy);
        self.preferred.push(p.preferred);
        self.extensions.push(p.extensions);
        self.expected.push(expected);
    }

    fn params(&self) -> [Typed<'_>; 10] {
        [
            typed(&self.names),
            typed(&self.holders),
            typed(&self.lease_ms),
            typed(&self.acquire),
            typed(&self.renew),
            typed(&self.transitions),
            typed(&self.strategy),
            typed(&self.preferred),
            typed(&self.extensions),
            typed(&self.expected),
        ]
    }
}
