//! The table lock: one row per election, compare-and-swap on a version column.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leader_core::{Acquisition, LeaderElectionRecord, LockError, Observed, ResourceLock, Version};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row, Value};

use crate::error::BACKEND;
use crate::fence::TokenFloor;
use crate::sql::{MAX_TEXT, columns, decode, next_version, parse_version, values};
use crate::store::MysqlStore;

/// A [`ResourceLock`] on one row of the lock table.
///
/// A renewal is one `UPDATE ... WHERE name = ? AND version = ?` that sets the expiry from the
/// server's clock; a takeover is a read, then one `UPDATE` at the version read whose condition
/// (free, or expired by the server's clock) the server decides again in the same statement.
/// The server has no notifications, so followers see a release at their next retry.
#[derive(Clone, Debug)]
pub struct TableLock {
    store: MysqlStore,
    name: String,
    identity: String,
    /// The fencing tokens this lock has seen: an acquisition goes on from above them, also
    /// after the row was deleted or a backup restored (its count would start over).
    floor: Arc<TokenFloor>,
}

impl MysqlStore {
    /// A table lock on election `name` for candidate `identity`. Names and identities are up to
    /// 512 bytes; a longer one is refused by every operation as misconfigured.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> TableLock {
        TableLock {
            store: self.clone(),
            name: name.into(),
            identity: identity.into(),
            floor: Arc::default(),
        }
    }
}

impl TableLock {
    /// The election's name (its row's primary key).
    pub fn name(&self) -> &str {
        &self.name
    }

    fn context(&self) -> String {
        format!("{} election {:?}", self.store.context(), self.name)
    }

    /// Notes the token of a record read or written.
    pub(crate) fn seen(&self, observed: &Observed) {
        self.floor.seen(
            parse_version(&observed.version),
            observed.record.leader_transitions,
        );
    }

    /// `record` as a write of this candidate stored it at `version`, its token noted for the
    /// floor.
    pub(crate) fn written(&self, record: LeaderElectionRecord, version: i64) -> Observed {
        let written = Observed {
            record,
            version: Version::from(version),
        };
        self.seen(&written);
        written
    }

    /// `record` as this candidate's write of it must store it (S5): one it holds that starts a
    /// term (a new row, when `expected` is `None`, or a compare-and-swap over a record at
    /// `expected` with another token) goes on from above every token this lock has seen; a
    /// write of the term stored at `expected` (a renewal) keeps its token, as does a record it
    /// does not hold.
    pub(crate) async fn fenced(
        &self,
        expected: Option<i64>,
        record: &LeaderElectionRecord,
    ) -> Result<LeaderElectionRecord, LockError> {
        let mut record = record.clone();
        if !record.is_held_by(&self.identity) {
            return Ok(record);
        }
        let token = record.leader_transitions;
        record.leader_transitions = match expected {
            None => self.floor.new_term(token),
            Some(expected) => match self.floor.holder_write(expected, token) {
                Some(token) => token,
                None => {
                    // Rare (a version a shard set's batch read or wrote): one read tells.
                    self.note_stored(expected).await?;
                    // No row at that version any more: the write matches none either.
                    self.floor.holder_write(expected, token).unwrap_or(token)
                }
            },
        };
        Ok(record)
    }

    /// Notes the token stored at version `expected`, if the row is still at it.
    async fn note_stored(&self, expected: i64) -> Result<(), LockError> {
        let mut conn = self.conn().await?;
        let token = conn
            .exec_first(
                &self.store.inner().statements.token_at,
                (self.name.as_str(), expected),
            )
            .await;
        let token: Option<i64> = self.store.answered(conn, token, &self.context()).await?;
        if let Some(token) = token.and_then(|t| u64::try_from(t).ok()) {
            self.floor.seen(Some(expected), token);
        }
        Ok(())
    }

    /// An election name the table can store, or why not.
    pub(crate) fn check_name(&self) -> Result<(), LockError> {
        if self.name.len() > MAX_TEXT || self.name.is_empty() {
            return Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "{}: an election name is 1 to {MAX_TEXT} bytes",
                    self.context()
                ),
            });
        }
        Ok(())
    }

    async fn conn(&self) -> Result<Conn, LockError> {
        self.check_name()?;
        self.store.conn().await
    }

    /// The parameters of the `create` statement for `record`, and the version it stores.
    pub(crate) fn create_params(
        &self,
        record: &LeaderElectionRecord,
    ) -> Result<(Vec<Value>, i64), LockError> {
        let p = columns(record)?;
        let version = next_version();
        let mut params: Vec<Value> = vec![self.name.clone().into()];
        params.extend(values(&p));
        params.extend([version.into(), p.lease_ms.into()]);
        Ok((params, version))
    }

    /// The parameters of the `update` statement (the holder's own write, or a release) of
    /// `record` over version `expected`, and the version it stores.
    pub(crate) fn update_params(
        &self,
        expected: i64,
        record: &LeaderElectionRecord,
    ) -> Result<(Vec<Value>, i64), LockError> {
        let p = columns(record)?;
        let version = next_version();
        let mut params = values(&p);
        params.push(version.into());
        params.extend([p.lease_ms.into(), self.name.clone().into(), expected.into()]);
        Ok((params, version))
    }

    /// What taking over `current` (free, or expired by the server's clock) for `desired`
    /// stores: the record, the parameters of the `take` statement, and the new version.
    pub(crate) fn takeover(
        &self,
        current: &Observed,
        desired: &LeaderElectionRecord,
    ) -> Result<(LeaderElectionRecord, Vec<Value>, i64), LockError> {
        let Some(expected) = parse_version(&current.version) else {
            return Err(LockError::conflict(BACKEND));
        };
        let stored = &current.record;
        let taken = {
            let mut record = LeaderElectionRecord::new(
                desired.holder_identity.clone(),
                desired.lease_duration,
                desired.acquire_time,
                self.floor.new_term(
                    (stored.leader_transitions + 1).max(desired.leader_transitions.max(1)),
                ),
            );
            record.strategy = stored.strategy.clone();
            record.extensions = stored.extensions.clone();
            record
        };
        let p = columns(&taken)?;
        let version = next_version();
        let mut params = values(&p);
        params.extend([
            version.into(),
            p.lease_ms.into(),
            self.name.clone().into(),
            expected.into(),
            p.holder.clone().into(),
        ]);
        Ok((taken, params, version))
    }

    /// Runs a write and returns how many rows it changed.
    async fn write(&self, sql: &str, params: Vec<Value>) -> Result<u64, LockError> {
        let mut conn = self.conn().await?;
        let changed = conn
            .exec_drop(sql, params)
            .await
            .map(|()| conn.affected_rows());
        self.store.answered(conn, changed, &self.context()).await
    }

    async fn read(&self, sql: &str) -> Result<Option<Row>, LockError> {
        let mut conn = self.conn().await?;
        let row = conn.exec_first(sql, (self.name.as_str(),)).await;
        self.store.answered(conn, row, &self.context()).await
    }

    /// The record, and the holder's time left by the server's clock.
    pub(crate) async fn observe(&self) -> Result<Option<(Observed, Duration)>, LockError> {
        let Some(row) = self.read(&self.store.inner().statements.observe).await? else {
            return Ok(None);
        };
        let observed = decode(&row, 0, &self.context())?;
        self.seen(&observed);
        let left_us = row.get_opt::<i64, _>(9).and_then(Result::ok).unwrap_or(0);
        Ok(Some((
            observed,
            Duration::from_micros(u64::try_from(left_us).unwrap_or(0)),
        )))
    }
}

#[async_trait]
impl ResourceLock for TableLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let row = self.read(&self.store.inner().statements.get).await?;
        let observed = row
            .map(|row| decode(&row, 0, &self.context()))
            .transpose()?;
        if let Some(observed) = &observed {
            self.seen(observed);
        }
        Ok(observed)
    }

    /// A row created for this candidate goes on from the highest token this lock saw: one
    /// deleted since starts its count over.
    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let record = self.fenced(None, record).await?;
        let (params, version) = self.create_params(&record)?;
        self.write(&self.store.inner().statements.create, params)
            .await?;
        let created = self.written(record, version);
        if created.record.is_free() {
            return Ok(created);
        }
        self.store.term_started(self, created).await
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let Some(expected) = parse_version(version) else {
            return Err(LockError::conflict(BACKEND));
        };
        let statements = &self.store.inner().statements;
        // A write naming another holder is a request on its behalf (a handover): it must keep
        // that holder and its expiry. Anything else is the holder's own write, or a release.
        let (sql, params, new_version) =
            if !record.is_free() && record.holder_identity != self.identity {
                let p = columns(record)?;
                let new_version = next_version();
                let mut params = values(&p);
                params.extend([
                    new_version.into(),
                    self.name.clone().into(),
                    expected.into(),
                    p.holder.clone().into(),
                ]);
                (&statements.request, params, new_version)
            } else {
                // An acquisition by update at or below a token seen (the row's count started
                // over) goes on from above it; a renewal carries its term's token on.
                let record = self.fenced(Some(expected), record).await?;
                let (params, new_version) = self.update_params(expected, &record)?;
                return match self.write(&statements.update, params).await? {
                    1 => Ok(self.written(record, new_version)),
                    _ => Err(LockError::conflict(BACKEND)),
                };
            };
        match self.write(sql, params).await? {
            1 => Ok(Observed {
                record: record.clone(),
                version: Version::from(new_version),
            }),
            _ => Err(LockError::conflict(BACKEND)),
        }
    }

    async fn time_left(&self) -> Result<Option<Duration>, LockError> {
        let row = self.read(&self.store.inner().statements.time_left).await?;
        Ok(row
            .and_then(|row| row.get_opt::<i64, _>(0).and_then(Result::ok))
            .and_then(|us| u64::try_from(us).ok())
            .map(Duration::from_micros))
    }

    /// Refuses a server on which a crash can undo an acknowledged commit (S15): any lease.
    async fn check_lease(&self, lease_duration: Duration) -> Result<(), LockError> {
        let _ = lease_duration;
        self.store.check_durability().await
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("mysql:{}/{}", self.store.inner().table.display(), self.name)
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }

    /// Reads the record; when it is free, or expired by the server's clock, takes it with one
    /// `UPDATE` at the version read, whose condition the server checks again by its own clock.
    /// A record that cannot be decoded is reported and never written (S8). Inserts it when there
    /// is none.
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let Some((observed, left)) = self.observe().await? else {
            return acquire_first(self, desired).await;
        };
        let current = &observed.record;
        let reserved = current.reserved_for_other_than(&desired.holder_identity);
        if (!current.is_free() && !left.is_zero()) || reserved {
            return Ok(Some(Acquisition::Held {
                observed,
                expires_in: Some(left),
                // Every renewal writes the row: its version changes.
                renewed_in_store: false,
            }));
        }
        let (taken, params, version) = self.takeover(&observed, desired)?;
        match self
            .write(&self.store.inner().statements.take, params)
            .await?
        {
            1 => {
                self.store
                    .acquired(self, self.written(taken, version))
                    .await
            }
            // Written since the read, or not expired yet by the server's clock.
            _ => Err(LockError::conflict(BACKEND)),
        }
    }
}

/// Acquires by creating the record when there is none yet: `desired`, with the first fencing
/// term (at least the one asked for) and nothing carried over. Someone may insert it first: a
/// conflict, and the next attempt reads theirs.
pub(crate) async fn acquire_first(
    lock: &impl ResourceLock,
    desired: &LeaderElectionRecord,
) -> Result<Option<Acquisition>, LockError> {
    let mut record = desired.clone();
    record.renew_time = desired.acquire_time;
    record.leader_transitions = desired.leader_transitions.max(1);
    record.strategy = None;
    record.preferred_holder = None;
    record.extensions = Default::default();
    lock.create(&record)
        .await
        .map(|o| Some(Acquisition::Acquired(o)))
}
