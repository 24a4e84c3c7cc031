//! The table lock: one row per election, compare-and-swap on a version column.

use async_trait::async_trait;
use leader_core::backend::{RecordColumns, fnv1a};
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};
use tokio_postgres::Client;

use crate::error::{BACKEND, map};
use crate::param::{Typed, typed};
use crate::sql::{Statements, TIME_LEFT, decode, parse_version};
use crate::store::PostgresStore;

/// A [`ResourceLock`] on one row of the lock table.
///
/// Every operation is one statement, sent unnamed with its parameters' types, so that no
/// prepared statement stays on the server's session (a pooler in transaction mode gives the next
/// transaction another one): a renewal is one `UPDATE ... WHERE version = $v`, an acquisition
/// one `INSERT ... ON CONFLICT DO UPDATE` that decides expiry with the server's `now()`. A release notifies followers through
/// `LISTEN/NOTIFY`, so one of them takes over at once.
#[derive(Clone, Debug)]
pub struct TableLock {
    store: PostgresStore,
    election: Election,
}

/// The kinds of write an `update` can be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Write {
    /// The holder writes its own record (an acquisition or a renewal).
    Update,
    /// An empty holder: followers are notified.
    Release,
    /// A write on the holder's behalf: its expiry is kept, and it is notified.
    Request,
}

/// What identifies one election in a table, shared by both locks.
#[derive(Clone, Debug)]
pub(crate) struct Election {
    pub(crate) name: String,
    pub(crate) identity: String,
    pub(crate) channel: String,
    pub(crate) key: i64,
}

impl Election {
    pub(crate) fn new(store: &PostgresStore, name: String, identity: String) -> Self {
        let table = &store.inner().table;
        let hash = fnv1a(&[&table.schema, &table.table, &name]);
        Self {
            channel: format!("leader_{hash:016x}"),
            // The advisory key space is shared by every application on the server: hash a prefix
            // of ours with the table and name. The cast keeps all 64 bits.
            key: fnv1a(&["leader-postgres", &table.schema, &table.table, &name]).cast_signed(),
            name,
            identity,
        }
    }

    /// `$1` name and `$2..$9` the record's columns.
    fn record_params<'a>(&'a self, p: &'a RecordColumns) -> Vec<Typed<'a>> {
        vec![
            typed(&self.name),
            typed(&p.holder),
            typed(&p.lease_ms),
            typed(&p.acquire),
            typed(&p.renew),
            typed(&p.transitions),
            typed(&p.strategy),
            typed(&p.preferred),
            typed(&p.extensions),
        ]
    }

    /// The statement's parameters, with the advisory key last for the advisory lock's statements.
    fn params<'a>(&'a self, mut params: Vec<Typed<'a>>, advisory: bool) -> Vec<Typed<'a>> {
        if advisory {
            params.push(typed(&self.key));
        }
        params
    }

    /// The holder's time left by the server's clock (`expires_at - now()`), on a pooled
    /// connection.
    pub(crate) async fn time_left(
        &self,
        store: &PostgresStore,
    ) -> Result<Option<std::time::Duration>, LockError> {
        let context = self.context(store);
        let client = store.client().await?;
        let row = client
            .query_typed_opt(
                &store.inner().table_statements.time_left,
                &[typed(&self.name)],
            )
            .await;
        let row = client.answered(row.map_err(|err| map(&context, err)))?;
        Ok(row
            .and_then(|row| u64::try_from(row.get::<_, i64>(0)).ok())
            .map(std::time::Duration::from_millis))
    }

    pub(crate) fn describe(&self, store: &PostgresStore, kind: &str) -> String {
        format!(
            "postgres{kind}:{}/{}",
            store.inner().table.display(),
            self.name
        )
    }

    fn context(&self, store: &PostgresStore) -> String {
        format!("{} election {:?}", store.context(), self.name)
    }

    pub(crate) async fn get(
        &self,
        store: &PostgresStore,
        client: &Client,
        sql: &str,
    ) -> Result<Option<Observed>, LockError> {
        let context = self.context(store);
        let row = client
            .query_typed_opt(sql, &[typed(&self.name)])
            .await
            .map_err(|err| map(&context, err))?;
        row.map(|row| decode(&row, 0, &context)).transpose()
    }

    pub(crate) async fn create(
        &self,
        store: &PostgresStore,
        client: &Client,
        sql: &str,
        record: &LeaderElectionRecord,
        advisory: bool,
    ) -> Result<Observed, LockError> {
        let p = RecordColumns::new(record, BACKEND)?;
        let row = client
            .query_typed_opt(sql, &self.params(self.record_params(&p), advisory))
            .await
            .map_err(|err| map(&self.context(store), err))?;
        written(record, row)
    }

    /// Which statement writes `record`: the holder's own write (`update`), a release, or a
    /// write on another holder's behalf (a handover request).
    fn write_kind(&self, record: &LeaderElectionRecord) -> Write {
        if record.is_free() {
            Write::Release
        } else if record.holder_identity != self.identity {
            Write::Request
        } else {
            Write::Update
        }
    }

    /// The statement of `statements` that writes `record`, as [`write_kind`](Self::write_kind)
    /// names it.
    pub(crate) fn write_sql<'s>(
        &self,
        statements: &'s Statements,
        record: &LeaderElectionRecord,
    ) -> &'s str {
        match self.write_kind(record) {
            Write::Update => &statements.update,
            Write::Release => &statements.release,
            Write::Request => &statements.request,
        }
    }

    /// Runs `sql`, the statement [`write_sql`](Self::write_sql) names for `record`.
    pub(crate) async fn update(
        &self,
        store: &PostgresStore,
        client: &Client,
        sql: &str,
        version: &Version,
        record: &LeaderElectionRecord,
        advisory: bool,
    ) -> Result<Observed, LockError> {
        let Some(expected) = parse_version(version) else {
            return Err(LockError::conflict(BACKEND));
        };
        let p = RecordColumns::new(record, BACKEND)?;
        let mut params = self.record_params(&p);
        params.push(typed(&expected));
        let kind = self.write_kind(record);
        if kind != Write::Update {
            params.push(typed(&self.channel));
        }
        // A request needs no advisory lock: it names no new holder.
        let advisory = advisory && kind != Write::Request;
        let row = client
            .query_typed_opt(sql, &self.params(params, advisory))
            .await
            .map_err(|err| map(&self.context(store), err))?;
        written(record, row)
    }

    pub(crate) async fn try_acquire(
        &self,
        store: &PostgresStore,
        client: &Client,
        sql: &str,
        desired: &LeaderElectionRecord,
        advisory: bool,
    ) -> Result<Acquisition, LockError> {
        let context = self.context(store);
        let p = RecordColumns::new(desired, BACKEND)?;
        let row = client
            .query_typed_opt(
                sql,
                &self.params(
                    vec![
                        typed(&self.name),
                        typed(&p.holder),
                        typed(&p.lease_ms),
                        typed(&p.acquire),
                        typed(&p.transitions),
                    ],
                    advisory,
                ),
            )
            .await
            .map_err(|err| map(&context, err))?;
        // No row: someone inserted it after this statement's snapshot; try again.
        let row = row.ok_or(LockError::conflict(BACKEND))?;
        let acquired: bool = row.get(0);
        let observed = decode(&row, 1, &context)?;
        Ok(if acquired {
            Acquisition::Acquired(observed)
        } else {
            // What the lease has left by the server's clock (`expires_at - now()`).
            let left_ms: Option<i64> = row.try_get(TIME_LEFT).ok().flatten();
            Acquisition::Held {
                observed,
                expires_in: left_ms
                    .and_then(|ms| u64::try_from(ms).ok())
                    .map(std::time::Duration::from_millis),
                // Every renewal writes the row: its version changes.
                renewed_in_store: false,
            }
        })
    }
}

/// The record as a write stored it: the returned row holds its new version, no row means the
/// compare-and-swap (or the insert) lost.
fn written(
    record: &LeaderElectionRecord,
    row: Option<tokio_postgres::Row>,
) -> Result<Observed, LockError> {
    let row = row.ok_or(LockError::conflict(BACKEND))?;
    Ok(Observed {
        record: record.clone(),
        version: Version::from(row.get::<_, i64>(0)),
    })
}

impl PostgresStore {
    /// A table lock on election `name` for candidate `identity`.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> TableLock {
        let store = self.clone();
        let election = Election::new(&store, name.into(), identity.into());
        TableLock { store, election }
    }
}

impl TableLock {
    /// The election's name (its row's primary key).
    pub fn name(&self) -> &str {
        &self.election.name
    }
}

#[async_trait]
impl ResourceLock for TableLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let client = self.store.client().await?;
        let sql = &self.store.inner().table_statements.get;
        let got = self.election.get(&self.store, &client, sql).await;
        client.answered(got)
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let client = self.store.client().await?;
        let sql = &self.store.inner().table_statements.create;
        let created = self
            .election
            .create(&self.store, &client, sql, record, false)
            .await;
        let created = client.answered(created)?;
        if !created.record.is_free() {
            self.store.term_started(self, &created).await?;
        }
        Ok(created)
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let sql = self
            .election
            .write_sql(&self.store.inner().table_statements, record);
        let client = self.store.client().await?;
        let updated = self
            .election
            .update(&self.store, &client, sql, version, record, false)
            .await;
        client.answered(updated)
    }

    async fn time_left(&self) -> Result<Option<std::time::Duration>, LockError> {
        self.election.time_left(&self.store).await
    }

    /// Refuses a server on which a crash can undo an acknowledged commit (S15): any lease.
    async fn check_lease(&self, lease_duration: std::time::Duration) -> Result<(), LockError> {
        let _ = lease_duration;
        self.store.check_durability().await
    }

    fn identity(&self) -> &str {
        &self.election.identity
    }

    fn describe(&self) -> String {
        self.election.describe(&self.store, "")
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.election.name)
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        self.store.listen(&self.election.channel).await
    }

    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let client = self.store.client().await?;
        let sql = &self.store.inner().table_statements.try_acquire;
        let acquired = self
            .election
            .try_acquire(&self.store, &client, sql, desired, false)
            .await;
        let acquired = client.answered(acquired)?;
        self.store
            .acquisition_started(self, acquired)
            .await
            .map(Some)
    }
}
