//! The advisory lock: the table's record, plus a session-level advisory lock held by the leader's
//! own dedicated connection.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leader_core::backend::HolderCheck;
use leader_core::backend::is_read_only;
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};
use tokio::sync::Mutex;

use crate::error::map;
use crate::lock::Election;
use crate::param::typed;
use crate::store::{Dedicated, PostgresStore};

/// A [`ResourceLock`] that ties leadership to a Postgres session: the record lives in the lock
/// table as for [`TableLock`](crate::TableLock), and every write that names this candidate as
/// holder also requires `pg_try_advisory_lock` held by this lock's own dedicated connection.
///
/// * Acquiring takes the advisory lock (`pg_try_advisory_lock`, only if this session does not
///   hold it yet, so it never stacks) in the same statement that writes the record.
/// * Every renewal checks, in the same statement, that the *same* backend session still holds it:
///   when the session died (a restart, `pg_terminate_backend`, a network cut), the renewal fails
///   and the leader steps down at its renew deadline even though a new connection would succeed.
/// * Releasing clears the record and unlocks in one statement.
/// * Followers still wait out the holder's lease (decided by the server's clock), so a leader
///   whose session died silently is never overlapped while it may still act.
///
/// A candidate may take the advisory lock while the previous holder's lease is running out; it
/// then acquires the record as soon as the lease has expired, before anyone else.
///
/// # What it cannot do
///
/// * It does not work behind PgBouncer in transaction (or statement) pooling mode: advisory locks
///   belong to a server session, and such a pooler hands the session to other clients between
///   transactions. Connect directly or through session pooling.
/// * A half-open client connection (the client host vanished without closing the socket) keeps
///   the lock until the server notices. The session sets `idle_session_timeout` (Postgres 14 and
///   later) and TCP keepalives so that it notices within about [`idle_session_timeout`] (or the
///   lease, when longer), and the
///   lease keeps followers from acting early meanwhile.
///
/// [`idle_session_timeout`]: Self::idle_session_timeout
#[derive(Clone, Debug)]
pub struct AdvisoryLock {
    store: PostgresStore,
    election: Election,
    idle_timeout: Duration,
    session: Arc<Mutex<Option<Session>>>,
}

/// The lock's session: the connection whose advisory lock it holds, and the
/// `idle_session_timeout` it was given.
#[derive(Debug)]
struct Session {
    client: Dedicated,
    timeout: Duration,
}

impl PostgresStore {
    /// An advisory lock on election `name` for candidate `identity`, with a dedicated connection.
    pub fn advisory_lock(
        &self,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> AdvisoryLock {
        let store = self.clone();
        let election = Election::new(&store, name.into(), identity.into());
        AdvisoryLock {
            store,
            election,
            idle_timeout: Duration::from_secs(30),
            session: Arc::default(),
        }
    }
}

impl AdvisoryLock {
    /// How long the server keeps this lock's session when the client goes silent (Postgres 14+
    /// `idle_session_timeout`; default 30 s), and never less than the lease of the record the
    /// session last wrote: the holder writes once a retry period, which is shorter than the
    /// lease, so a timeout below it cannot end the holder's session between two renewals, and
    /// a shorter one would free the election no sooner, since followers wait the lease out.
    #[must_use]
    pub fn idle_session_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// The advisory lock key (`pg_try_advisory_lock(bigint)`), derived from table and name.
    pub fn key(&self) -> i64 {
        self.election.key
    }

    /// The backend process id of this lock's session, if connected: what
    /// `pg_terminate_backend` takes.
    pub async fn backend_pid(&self) -> Result<Option<i32>, LockError> {
        let session = self.session.lock().await;
        let Some(session) = session.as_ref().filter(|s| !s.client.is_closed()) else {
            return Ok(None);
        };
        let row = session
            .client
            .query_typed_one("SELECT pg_backend_pid()", &[])
            .await
            .map_err(|err| map(&self.store.context(), err))?;
        Ok(Some(row.get(0)))
    }

    async fn connect(&self, timeout: Duration) -> Result<Session, LockError> {
        let client = self.store.dedicated("", None).await?;
        let context = self.store.context();
        let idle = format!("{}ms", timeout.as_millis());
        let app = format!("leader:{}", self.election.identity);
        client
            .query_typed(
                "SELECT set_config('application_name', $1, false)",
                &[typed(&app)],
            )
            .await
            .map_err(|err| map(&context, err))?;
        // Postgres before 14 has neither setting; keepalives still apply. The connection check
        // lets a backend waiting on a row lock notice that its client closed the connection.
        for (setting, value) in [
            ("idle_session_timeout", idle.as_str()),
            ("client_connection_check_interval", "1s"),
        ] {
            if let Err(err) = client
                .query_typed(
                    "SELECT set_config($1, $2, false)",
                    &[typed(&setting), typed(&value)],
                )
                .await
            {
                tracing::debug!(error = %err, setting, "not supported by this server");
            }
        }
        Ok(Session { client, timeout })
    }

    /// Gives `session` an `idle_session_timeout` of at least `timeout`, for a longer lease
    /// than it was given for.
    async fn keep_for(&self, session: &mut Session, timeout: Duration) -> Result<(), LockError> {
        if session.timeout >= timeout {
            return Ok(());
        }
        let idle = format!("{}ms", timeout.as_millis());
        if let Err(err) = session
            .client
            .query_typed(
                "SELECT set_config('idle_session_timeout', $1, false)",
                &[typed(&idle)],
            )
            .await
        {
            if session.client.is_closed() {
                return Err(map(&self.store.context(), err));
            }
            tracing::debug!(error = %err, "idle_session_timeout not supported by this server");
        }
        session.timeout = timeout;
        Ok(())
    }

    /// Runs `op` on the dedicated session, connecting first if there is none, with the server
    /// keeping it for the idle timeout and at least `lease` (the lease of the record `op`
    /// writes); a session whose connection broke, or that the server answered as read-only, is
    /// dropped, and its advisory lock is gone with it.
    ///
    /// When `op` is cancelled midway (the elector's request timeout dropped it), a statement
    /// already sent may still run on the server later, so what the session holds is unknown:
    /// the session is ended (its connection closed), and the server lets go of its advisory
    /// lock instead of a late statement keeping it, and the lease, alive for a client that
    /// never hears back.
    async fn with_session<T>(
        &self,
        lease: Duration,
        op: impl AsyncFnOnce(&Session) -> Result<T, LockError>,
    ) -> Result<T, LockError> {
        let timeout = self.idle_timeout.max(lease);
        let mut guard = self.session.lock().await;
        if guard.as_ref().is_none_or(|s| s.client.is_closed()) {
            *guard = None;
            *guard = Some(self.connect(timeout).await?);
        } else if let Some(session) = guard.as_mut() {
            self.keep_for(session, timeout).await?;
        }
        let mut pending = EndIfCancelled(Some(guard));
        let Some(session) = pending.0.as_ref().and_then(|g| g.as_ref()) else {
            unreachable!("connected above");
        };
        let result = op(session).await;
        let Some(mut guard) = pending.0.take() else {
            unreachable!("taken once");
        };
        // A session the server answered as read-only (a standby, a demoted primary) is ended
        // too: the next one may reach the primary.
        if guard.as_ref().is_some_and(|s| s.client.is_closed())
            || result.as_ref().is_err_and(is_read_only)
        {
            *guard = None;
        }
        result
    }

    /// After a lost compare-and-swap, lets go of an advisory lock taken in vain.
    async fn unlock_unless_holder(&self, session: &Session) {
        let name = &self.election.name;
        let identity = &self.election.identity;
        let sql = &self.store.inner().advisory_statements.unlock;
        let params = [typed(&self.election.key), typed(name), typed(identity)];
        if let Err(err) = session.client.query_typed(sql, &params).await {
            tracing::debug!(error = %err, "advisory unlock after a conflict failed");
        }
    }
}

/// Holds the session while an operation runs; dropped before the operation finished, it ends
/// the session (see [`AdvisoryLock::with_session`]).
struct EndIfCancelled<'a>(Option<tokio::sync::MutexGuard<'a, Option<Session>>>);

impl Drop for EndIfCancelled<'_> {
    fn drop(&mut self) {
        if let Some(guard) = self.0.as_mut()
            && guard.take().is_some()
        {
            tracing::debug!(
                "a request on the advisory lock's session was cancelled; session ended"
            );
        }
    }
}

#[async_trait]
impl ResourceLock for AdvisoryLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let sql = &self.store.inner().advisory_statements.get;
        self.with_session(Duration::ZERO, async |s| {
            self.election.get(&self.store, &s.client, sql).await
        })
        .await
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let sql = &self.store.inner().advisory_statements.create;
        let created = self
            .with_session(record.lease_duration, async |s| {
                let result = self
                    .election
                    .create(&self.store, &s.client, sql, record, true)
                    .await;
                if result.as_ref().is_err_and(LockError::is_conflict) {
                    self.unlock_unless_holder(s).await;
                }
                result
            })
            .await?;
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
            .write_sql(&self.store.inner().advisory_statements, record);
        self.with_session(record.lease_duration, async |s| {
            let result = self
                .election
                .update(&self.store, &s.client, sql, version, record, true)
                .await;
            if result.as_ref().is_err_and(LockError::is_conflict) {
                self.unlock_unless_holder(s).await;
            }
            result
        })
        .await
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
        self.election.describe(&self.store, "+advisory")
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
        let sql = &self.store.inner().advisory_statements.try_acquire;
        let acquisition = self
            .with_session(desired.lease_duration, async |s| {
                let acquisition = self
                    .election
                    .try_acquire(&self.store, &s.client, sql, desired, true)
                    .await?;
                // The statement may take the advisory lock although the record is reserved for
                // the candidate a handover names: kept, it would stop that candidate from
                // acquiring, and after a lease of standing back another would lead instead.
                if let Acquisition::Held { observed, .. } = &acquisition
                    && observed
                        .record
                        .reserved_for_other_than(&self.election.identity)
                {
                    self.unlock_unless_holder(s).await;
                }
                Ok(acquisition)
            })
            .await?;
        self.store
            .acquisition_started(self, acquisition)
            .await
            .map(Some)
    }

    /// Every write naming a holder needs this session's advisory lock, which a deletion of
    /// the row does not free: no lease is taken while the holder's session lives, row or not.
    fn holder_check(&self) -> HolderCheck {
        HolderCheck::Session
    }
}
