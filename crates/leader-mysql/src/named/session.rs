//! The lock's own session: its statements, whether its connection (with the user-level lock)
//! is gone, and the lock's work on it (connecting, an operation that a cancellation ends with
//! the session, acquiring and letting go of the user-level lock).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use leader_core::backend::is_read_only;
use leader_core::{LeaderElectionRecord, LockError, ResourceLock};
use mysql_async::prelude::{FromRow, Queryable};
use mysql_async::{Conn, Value};

use super::{Hold, NamedLock, Summary, Written, session_timeouts};
use crate::error::{map, map_get_lock};

/// The lock's own session.
#[derive(Debug)]
pub(super) struct Session {
    pub(super) conn: Conn,
    /// The fencing term whose user-level lock this session holds; `None` when it holds none.
    pub(super) term: Option<u64>,
    /// The connection failed, or the server answered it as read-only: the session is gone, or
    /// closed when it is put back, and its user-level lock with it.
    pub(super) lost: bool,
    /// How long the server keeps the session when its client goes silent, as last set.
    pub(super) timeout: Duration,
}

impl Session {
    pub(super) async fn first<T: FromRow + Send + 'static>(
        &mut self,
        context: &str,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<Option<T>, LockError> {
        let result = self.conn.exec_first(sql, params).await;
        self.check(context, result, map)
    }

    /// Runs a statement that calls `GET_LOCK`: as [`first`](Self::first), with a server that
    /// refuses `GET_LOCK` reported as misconfigured.
    pub(super) async fn get_lock(
        &mut self,
        context: &str,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<Option<Option<i64>>, LockError> {
        let result = self.conn.exec_first(sql, params).await;
        self.check(context, result, map_get_lock)
    }

    /// Runs a write and returns how many rows it changed.
    pub(super) async fn write(
        &mut self,
        context: &str,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<u64, LockError> {
        let result = self.conn.exec_drop(sql, params).await;
        self.check(context, result, map)?;
        Ok(self.conn.affected_rows())
    }

    /// Has the server keep this session `timeout` after its client goes silent.
    pub(super) async fn keep_for(
        &mut self,
        context: &str,
        timeout: Duration,
    ) -> Result<(), LockError> {
        let result = self.conn.query_drop(session_timeouts(timeout)).await;
        self.check(context, result, map)?;
        self.timeout = timeout;
        Ok(())
    }

    fn check<T>(
        &mut self,
        context: &str,
        result: Result<T, mysql_async::Error>,
        map: fn(&str, mysql_async::Error) -> LockError,
    ) -> Result<T, LockError> {
        result.map_err(|err| {
            if connection_lost(&err) {
                self.lost = true;
                self.term = None;
            }
            let err = map(context, err);
            // A session the server answered as read-only (a replica, a demoted writer) is of
            // no more use: it is counted lost, so that it is closed once its user-level lock is
            // handed back, and the next session may reach the writer.
            if is_read_only(&err) {
                self.lost = true;
            }
            err
        })
    }
}

/// Whether `err` means the session is gone (and the server let go of its user-level locks).
pub(super) fn connection_lost(err: &mysql_async::Error) -> bool {
    match err {
        mysql_async::Error::Server(server) => {
            // Server shutdown, connection killed, idle connection closed by MySQL 8.
            matches!(server.code, 1053 | 1927 | 4031)
        }
        _ => true,
    }
}

/// The lock's work on its session: connecting, running an operation on the session (which a
/// cancelled operation ends), acquiring and letting go of the user-level lock.
impl NamedLock {
    pub(super) fn context(&self) -> String {
        format!("{} election {:?}", self.store.context(), self.table.name())
    }

    pub(super) async fn connect(&self, timeout: Duration) -> Result<Session, LockError> {
        let mut session = Session {
            conn: self.store.dedicated().await?,
            term: None,
            lost: false,
            timeout: Duration::ZERO,
        };
        session.keep_for(&self.context(), timeout).await?;
        Ok(session)
    }

    /// How long the server is to keep the session of a holder whose lease is `lease`: the idle
    /// session timeout, and never less than the lease. The holder writes once a retry period,
    /// which is shorter than the lease: a timeout below the lease could drop its session, and
    /// the user-level lock, between two renewals, and frees the election no sooner, since
    /// followers wait the lease out anyway.
    pub(super) fn session_timeout(&self, lease: Duration) -> Duration {
        self.idle_timeout.max(lease)
    }

    /// Runs `op` on the lock's session, connecting one if there is none, with the server
    /// keeping it at least `timeout` after its client goes silent. A session that holds no
    /// user-level lock may have been closed by the server while idle: it is checked first.
    ///
    /// The session is out of its slot while `op` runs: should this future be dropped midway
    /// (the elector's request timeout), a statement already sent may still run later, so what
    /// the session holds is unknown, and it is closed: the server lets go of its user-level
    /// lock instead of a late statement keeping it for a client that never hears back.
    pub(super) async fn with_session<T>(
        &self,
        timeout: Duration,
        op: impl AsyncFnOnce(&mut Session) -> Result<T, LockError>,
    ) -> Result<T, LockError> {
        self.table.check_name()?;
        let mut slot = self.shared.session.lock().await;
        let mut session = match slot.take() {
            Some(session) if session.term.is_some() => session,
            Some(mut session) => match session.conn.ping().await {
                Ok(()) => session,
                Err(_) => self.connect(timeout).await?,
            },
            None => self.connect(timeout).await?,
        };
        let pending = NotHoldingIfDropped(Some(&self.shared.holding));
        let result = async {
            if session.timeout < timeout {
                // A lease longer than the one the session was set up for.
                session.keep_for(&self.context(), timeout).await?;
            }
            op(&mut session).await
        }
        .await;
        pending.disarm();
        self.put_back(&mut slot, session);
        result
    }

    /// Runs `op` on the lock's session if it has one, as [`with_session`](Self::with_session)
    /// does.
    pub(super) async fn if_session(&self, op: impl AsyncFnOnce(&mut Session)) {
        let mut slot = self.shared.session.lock().await;
        let Some(mut session) = slot.take() else {
            return;
        };
        let pending = NotHoldingIfDropped(Some(&self.shared.holding));
        op(&mut session).await;
        pending.disarm();
        self.put_back(&mut slot, session);
    }

    pub(super) fn put_back(&self, slot: &mut Option<Session>, session: Session) {
        self.shared
            .holding
            .store(session.term.is_some() && !session.lost, Ordering::Release);
        if !session.lost {
            *slot = Some(session);
        }
    }

    /// Takes the user-level lock as `hold` says, then runs `sql`, a write naming this candidate
    /// as holder with fencing term `term`, guarded by the lock. A lock taken for a write that
    /// did not go through is handed back at once; one the session held before is kept only
    /// while the record still names this term.
    pub(super) async fn acquire(
        &self,
        session: &mut Session,
        hold: Hold,
        sql: &str,
        mut params: Vec<Value>,
        term: u64,
    ) -> Result<Written, LockError> {
        let context = self.context();
        let statements = &self.store.inner().named_statements;
        let held_before = session.term.is_some();
        if !held_before {
            let key = Value::from(self.key.as_str());
            let (sql, hold_params) = match hold {
                Hold::Always => (&statements.hold, vec![key.clone(), key]),
                Hold::Takeover(version) => (
                    &statements.hold_to_take,
                    vec![
                        key.clone(),
                        self.table.name().into(),
                        version.into(),
                        self.table.identity().into(),
                        key,
                    ],
                ),
            };
            let got = session.get_lock(&context, sql, hold_params).await?;
            if got.flatten() != Some(1) {
                return Ok(Written::Busy);
            }
            // Held from here on, even if the write below does not go through.
            session.term = Some(term);
        }
        params.push(self.key.as_str().into());
        let written = session.write(&context, sql, params).await;
        if matches!(written, Ok(1)) {
            session.term = Some(term);
            return Ok(Written::Stored);
        }
        if held_before {
            self.keep_if_holder(session).await;
        } else {
            self.let_go(session).await;
        }
        written.map(|_| Written::Missed)
    }

    /// Hands the user-level lock back (the session stays connected).
    pub(super) async fn let_go(&self, session: &mut Session) {
        if session.term.is_none() {
            return;
        }
        let sql = &self.store.inner().named_statements.release;
        let params = vec![Value::from(self.key.as_str())];
        match session
            .first::<Option<i64>>(&self.context(), sql, params)
            .await
        {
            Ok(_) => session.term = None,
            Err(err) => {
                // The session is left as it is only if it still works; a lost one held nothing.
                tracing::debug!(error = %err, "handing back the user-level lock failed");
                session.lost = true;
            }
        }
    }

    /// After a write of the term's holder that did not go through: keeps the user-level lock
    /// while the record still names this term (someone wrote a handover request on its
    /// behalf, and the holder carries on from the record as it now reads), hands it back
    /// otherwise.
    pub(super) async fn keep_if_holder(&self, session: &mut Session) {
        let sql = &self.store.inner().named_statements.summary;
        let params = vec![Value::from(self.table.name())];
        let summary: Result<Summary, _> = session.first(&self.context(), sql, params).await;
        let ours = match summary {
            Ok(Some((holder, _, term))) => {
                holder == self.table.identity().as_bytes()
                    && u64::try_from(term).ok() == session.term
            }
            Ok(None) => false,
            Err(_) => return,
        };
        if !ours {
            self.let_go(session).await;
        }
    }

    /// A write naming this candidate as holder: takes the user-level lock as `hold` says.
    pub(super) async fn own_write(
        &self,
        record: &LeaderElectionRecord,
        hold: Hold,
        sql: &str,
        params: Vec<Value>,
    ) -> Result<Written, LockError> {
        let term = record.leader_transitions;
        let timeout = self.session_timeout(record.lease_duration);
        self.with_session(timeout, async |session| {
            self.acquire(session, hold, sql, params, term).await
        })
        .await
    }
}

/// Clears the lock's `holding` flag when dropped armed: an operation on its session was
/// cancelled, and the session is closed with whatever it held.
struct NotHoldingIfDropped<'a>(Option<&'a AtomicBool>);

impl NotHoldingIfDropped<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for NotHoldingIfDropped<'_> {
    fn drop(&mut self) {
        if let Some(holding) = self.0 {
            holding.store(false, Ordering::Release);
            tracing::debug!(
                "a request on the GET_LOCK lock's session was cancelled; session ended"
            );
        }
    }
}
