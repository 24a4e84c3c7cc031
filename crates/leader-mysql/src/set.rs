//! A shard set's records in the lock table: one statement reads them all, one renews all of a
//! member's.

use std::collections::HashMap;
use std::sync::Arc;

use leader_core::backend::{KeyedLocks, LockErrorExt, RecordColumns, Renewal, common_prefix};
use leader_core::{LockError, LockSet, Observed, ResourceLock, Version, async_trait};
use mysql_async::Value;
use mysql_async::prelude::Queryable;

use crate::error::BACKEND;
use crate::sql::{COLUMNS, VALID, columns, decode, next_version, parse_version, values};
use crate::store::MysqlStore;

/// Renewals per statement: 11 parameters each, under the protocol's 65,535 per statement.
const RENEWALS_PER_STATEMENT: usize = 5000;

/// The records of a shard set, rows of one lock table ([`MysqlStore::lock_set`]).
/// [`get_many`](LockSet::get_many) is one statement (the rows under the keys' common prefix,
/// a range of the primary key), [`renew_many`](LockSet::renew_many) one statement per 5,000
/// records, plus a read of the versions when some record was not renewed; each row keeps the
/// table lock's contract.
#[derive(Clone, Debug)]
pub struct MysqlLockSet {
    store: MysqlStore,
    locks: KeyedLocks,
}

impl MysqlStore {
    /// The records of a shard set, as member `identity`: a [`TableLock`](crate::TableLock) per
    /// key, read and renewed in batches.
    pub fn lock_set(&self, identity: impl Into<String>) -> MysqlLockSet {
        let store = self.clone();
        let describe = format!("mysql:{}", self.inner().table.display());
        MysqlLockSet {
            store: self.clone(),
            locks: KeyedLocks::new(identity, describe, move |key, identity| {
                Arc::new(store.lock(key, identity))
            }),
        }
    }
}

/// `prefix` as a `LIKE` pattern that matches exactly the strings starting with it (escape `!`).
fn like_prefix(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '!' | '%' | '_') {
            pattern.push('!');
        }
        pattern.push(c);
    }
    pattern.push('%');
    pattern
}

impl MysqlLockSet {
    /// The rows whose names start with `prefix`, by name: the record's columns, decoded.
    async fn read_prefix(
        &self,
        prefix: &str,
    ) -> Result<HashMap<String, Result<Observed, LockError>>, LockError> {
        let inner = self.store.inner();
        let sql = format!(
            "SELECT name, {COLUMNS} FROM {} WHERE name LIKE ? ESCAPE '!'",
            inner.table.quoted()
        );
        let context = self.store.context();
        let mut conn = self.store.conn().await?;
        let rows = conn.exec(sql, (like_prefix(prefix),)).await;
        let rows: Vec<mysql_async::Row> = self.store.answered(conn, rows, &context).await?;
        Ok(rows
            .iter()
            .filter_map(|row| {
                let name = row.get_opt::<Vec<u8>, _>(0)?.ok()?;
                let name = String::from_utf8(name).ok()?;
                let observed = decode(row, 1, format_args!("{context} election {name:?}"));
                Some((name, observed))
            })
            .collect())
    }

    /// One statement renewing `batch` (each with its new version); the number of rows renewed.
    /// The derived table is padded to a power of two (at least 8) with rows that match none
    /// (an empty name): each connection prepares a handful of statements, not one per size.
    async fn renew_batch(
        &self,
        batch: &[(&Renewal, RecordColumns, i64, i64)],
    ) -> Result<u64, LockError> {
        let inner = self.store.inner();
        let row = "SELECT ? AS name, ? AS expected, ? AS new_version, ? AS holder, ? AS lease_ms, \
                   ? AS acquire, ? AS renew, ? AS transitions, ? AS strategy, ? AS preferred, \
                   ? AS extensions";
        let rows = batch.len().next_power_of_two().max(8);
        let sql = format!(
            "UPDATE {} AS l JOIN ({}) AS v \
               ON l.name = v.name AND l.version = v.expected AND l.holder_identity = v.holder \
             SET l.holder_identity = v.holder, l.lease_duration_ms = v.lease_ms, \
               l.acquire_time = v.acquire, l.renew_time = v.renew, \
               l.leader_transitions = v.transitions, l.strategy = v.strategy, \
               l.preferred_holder = v.preferred, l.extensions = v.extensions, \
               l.version = v.new_version, \
               l.expires_at = UTC_TIMESTAMP(6) + INTERVAL (v.lease_ms * 1000) MICROSECOND \
             WHERE {VALID}",
            inner.table.quoted(),
            vec![row; rows].join(" UNION ALL ")
        );
        let mut params: Vec<Value> = Vec::with_capacity(rows * 11);
        for (renewal, p, expected, new_version) in batch {
            params.extend([
                renewal.key.clone().into(),
                (*expected).into(),
                (*new_version).into(),
            ]);
            // The derived table's columns: holder, lease, acquire, renew, transitions, strategy,
            // preferred, extensions, as `values` gives them.
            params.extend(values(p));
        }
        if let Some((_, first, ..)) = batch.first() {
            // Padding: the first renewal's values under an empty name, which no row has.
            let mut pad: Vec<Value> = vec!["".into(), 0_i64.into(), 0_i64.into()];
            pad.extend(values(first));
            for _ in batch.len()..rows {
                params.extend(pad.iter().cloned());
            }
        }
        let mut conn = self.store.conn().await?;
        let changed = conn
            .exec_drop(sql, params)
            .await
            .map(|()| conn.affected_rows());
        self.store
            .answered(conn, changed, &self.store.context())
            .await
    }
}

#[async_trait]
impl LockSet for MysqlLockSet {
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
        let mut found = match self.read_prefix(common_prefix(keys)).await {
            Ok(found) => found,
            Err(err) => return err.for_each(keys.len()),
        };
        keys.iter()
            .map(|key| found.remove(key).transpose())
            .collect()
    }

    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        let mut results: Vec<Option<Result<Observed, LockError>>> = Vec::new();
        let mut usable = Vec::new();
        for (i, renewal) in renewals.iter().enumerate() {
            match (columns(&renewal.record), parse_version(&renewal.version)) {
                (Ok(p), Some(expected)) => {
                    results.push(None);
                    usable.push((i, (renewal, p, expected, next_version())));
                }
                (Err(err), _) => results.push(Some(Err(err))),
                // A version this table never issued matches no row.
                (_, None) => results.push(Some(Err(LockError::conflict(BACKEND)))),
            }
        }
        // Each statement's records on their own: a statement that failed fails its records
        // alone, and one that renewed fewer rows than it had is read again to say which.
        let mut unsure = Vec::new();
        for chunk in usable.chunks(RENEWALS_PER_STATEMENT) {
            let batch: Vec<_> = chunk.iter().map(|(_, b)| b.clone()).collect();
            match self.renew_batch(&batch).await {
                Ok(n) if usize::try_from(n).is_ok_and(|n| n == chunk.len()) => {
                    for (i, (renewal, _, _, new_version)) in chunk {
                        results[*i] = Some(Ok(renewed(renewal, *new_version)));
                    }
                }
                Ok(_) => unsure.extend(chunk.iter().map(|(i, b)| (*i, b.0, b.3))),
                Err(err) => {
                    for (i, _) in chunk {
                        results[*i] = Some(Err(err.duplicate()));
                    }
                }
            }
        }
        if !unsure.is_empty() {
            // Renewed: the rows now at the version their renewal wrote (random, so no other
            // write leaves it).
            let keys: Vec<String> = unsure.iter().map(|(_, r, _)| r.key.clone()).collect();
            match self.read_prefix(common_prefix(&keys)).await {
                Ok(found) => {
                    for (i, renewal, new_version) in unsure {
                        let ours = found.get(&renewal.key).is_some_and(|observed| {
                            observed
                                .as_ref()
                                .ok()
                                .and_then(|o| parse_version(&o.version))
                                == Some(new_version)
                        });
                        results[i] = Some(if ours {
                            Ok(renewed(renewal, new_version))
                        } else {
                            Err(LockError::conflict(BACKEND))
                        });
                    }
                }
                Err(err) => {
                    for (i, ..) in unsure {
                        results[i] = Some(Err(err.duplicate()));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(LockError::conflict(BACKEND))))
            .collect()
    }
}

/// What a renewal stored, at the version it wrote.
fn renewed(renewal: &Renewal, version: i64) -> Observed {
    Observed {
        record: renewal.record.clone(),
        version: Version::from(version),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_pattern_matches_the_prefix_literally() {
        assert_eq!(like_prefix("jobs-"), "jobs-%");
        assert_eq!(like_prefix("a_b%c!"), "a!_b!%c!!%");
        assert_eq!(like_prefix(""), "%");
    }
}
