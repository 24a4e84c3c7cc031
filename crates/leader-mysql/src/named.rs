//! The `GET_LOCK` lock: the table's record, plus a user-level lock held by the leader's own
//! session for as long as its term lasts.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use leader_core::backend::ChangeHub;
use leader_core::backend::HolderCheck;
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LeaderEvent, LockError, Observed,
    ResourceLock, Version,
};
use mysql_async::prelude::Queryable;
use tokio::task::JoinHandle;

use crate::error::{BACKEND, map};
use crate::lock::{TableLock, acquire_first};
use crate::sql::parse_version;
use crate::store::MysqlStore;

mod follower;
mod galera;
mod key;
mod session;

use follower::Follower;
use key::lock_key;
use session::Session;

/// The longest user-level lock name MySQL takes (MariaDB takes the same).
const MAX_KEY: usize = 64;

/// The hub channel of a lock's watch: one per lock, so any name does.
const CHANNEL: &str = "record";

/// How long a follower's watch waits in `GET_LOCK` before it reads the record again.
const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_secs(2);

/// How long a follower's watch first waits before it reads a free record again (doubling up to
/// the watch interval while the record stays free).
const FIRST_FREE_PAUSE: Duration = Duration::from_millis(50);

/// How long the server keeps a silent session of the lock (its `wait_timeout`).
const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How much longer than its interval a watch's connection may stay silent before the server
/// drops it: the watch sends a statement at least once an interval.
const WATCH_SILENCE_MARGIN: Duration = Duration::from_secs(5);

/// The statement that has the server drop a session once its client has been silent for
/// `timeout` (whole seconds, rounded up), whatever it was doing: waiting for the next statement
/// (`wait_timeout`, 8 hours by default), or for the rest of one, or for the client to read a
/// result (`net_read_timeout`, `net_write_timeout`). The server then lets go of the session's
/// user-level locks. It also turns autocommit on, whatever the server's or the user's default
/// (`autocommit = 0`, an `init_connect` that sets it): the session's writes are the term's,
/// and one left uncommitted would be rolled back with the session while its lock goes free.
fn session_timeouts(timeout: Duration) -> String {
    // The servers' largest `wait_timeout` (on Windows; 31536000 elsewhere).
    const MAX_SECONDS: u64 = 2_147_483;
    let seconds = (timeout.as_secs() + u64::from(timeout.subsec_nanos() > 0)).clamp(1, MAX_SECONDS);
    format!(
        "SET SESSION wait_timeout = {seconds}, net_read_timeout = {seconds}, \
         net_write_timeout = {seconds}, autocommit = 1"
    )
}

/// A [`ResourceLock`] that ties leadership to a MySQL or MariaDB session: the record lives in
/// the lock table as for [`TableLock`], and the holder also holds a user-level lock
/// (`GET_LOCK`) on a session of its own, kept outside the pool, for as long as its term lasts.
///
/// * Every write that names this candidate as holder requires, in the same statement, that the
///   lock's own session holds the user-level lock (`IS_USED_LOCK(key) = CONNECTION_ID()`): a
///   renewal on a session that was lost (killed, restarted, cut off) fails, and the leader steps
///   down at its renew deadline even though a new connection would work.
/// * An acquisition takes the user-level lock first, only if the session does not hold it yet
///   (`GET_LOCK` calls stack on one session, and a stacked lock needs as many releases), and
///   hands it back at once when the write does not go through. A term that ends (released,
///   lost, or reported over through [`ResourceLock::record_event`]) hands it back too: a session
///   holds the user-level lock only while it holds the record's term.
/// * A release writes the free record, then lets go of the user-level lock: a follower waiting
///   in `GET_LOCK` wakes at once and takes over.
/// * Followers still wait out the holder's lease by the server's clock, as for the table lock:
///   a leader whose session died may still act until its renew deadline.
/// * Fencing tokens are the table lock's: each term's goes on from the highest this lock has
///   seen, also after the row was deleted or a backup restored.
///
/// [`watch`](ResourceLock::watch) waits in `GET_LOCK` on a connection of its own (and lets go
/// in the same statement when it gets the lock, so that a follower whose process stops while
/// it waits keeps nothing), and reads the record after each wait: it reports a release, a
/// holder's session that ended, a handover request and a new holder, never a renewal.
///
/// Not behind a proxy that shares server sessions between clients, and a user-level lock is not
/// replicated: see the crate's documentation. Not on a Galera cluster, which refuses `GET_LOCK`
/// (or takes it on one node only): [`check_lease`](ResourceLock::check_lease), and opening
/// the lock from a URL, refuse a server with `wsrep_on=ON` as [`LockError::Misconfigured`].
#[derive(Clone)]
pub struct NamedLock {
    table: TableLock,
    store: MysqlStore,
    key: String,
    watch_interval: Duration,
    idle_timeout: Duration,
    shared: Arc<Shared>,
}

/// What the clones of one lock share: its session and its watch.
#[derive(Debug, Default)]
struct Shared {
    /// The lock's own session, connected when an acquisition first needs it.
    session: tokio::sync::Mutex<Option<Session>>,
    /// Whether the session holds the user-level lock for a term: the watch then does not wait
    /// for it.
    holding: AtomicBool,
    watcher: std::sync::Mutex<Option<Watcher>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let watcher = self
            .watcher
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(watcher) = watcher {
            watcher.stop();
        }
    }
}

#[derive(Debug)]
struct Watcher {
    hub: ChangeHub,
    task: JoinHandle<()>,
}

impl Watcher {
    /// Stops the task and ends its streams.
    fn stop(self) {
        self.task.abort();
        self.hub.close();
    }
}

/// What an acquisition does with the user-level lock before its write.
enum Hold {
    /// Takes it if it is free (an insert, or a takeover decided by the server's clock).
    Always,
    /// Takes it only if the record at this version names nobody or another holder: a holder
    /// whose session lost the lock never takes it again for the term it had.
    Takeover(i64),
}

/// What an acquisition's write did.
enum Written {
    /// Stored, and this session holds the user-level lock for it.
    Stored,
    /// Another session holds the user-level lock.
    Busy,
    /// The write matched no row (the record changed, or is not takeable).
    Missed,
}

/// What a watch compares between two reads: the holder, the preferred holder and the fencing
/// term, or nothing when there is no record.
type Summary = Option<(Vec<u8>, Option<Vec<u8>>, i64)>;

fn held(summary: &Summary) -> bool {
    summary
        .as_ref()
        .is_some_and(|(holder, _, _)| !holder.is_empty())
}

impl MysqlStore {
    /// A `GET_LOCK` lock on election `name` for candidate `identity`: the record in this
    /// store's table, plus a user-level lock on a session of the lock's own. Names and
    /// identities are up to 512 bytes.
    pub fn named_lock(&self, name: impl Into<String>, identity: impl Into<String>) -> NamedLock {
        let table = self.lock(name, identity);
        let key = lock_key(
            &self.inner().database,
            &self.inner().table.table,
            table.name(),
        );
        NamedLock {
            table,
            store: self.clone(),
            key,
            watch_interval: DEFAULT_WATCH_INTERVAL,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            shared: Arc::default(),
        }
    }
}

impl fmt::Debug for NamedLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NamedLock")
            .field("store", &self.store)
            .field("name", &self.table.name())
            .field("identity", &self.table.identity())
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl NamedLock {
    /// How long a follower's [`watch`](ResourceLock::watch) waits in `GET_LOCK` before it reads
    /// the record again (whole seconds, at least one; default 2 s). A release is seen at once
    /// either way; a handover request, or a holder's session that ended while the follower was
    /// not waiting, within about this long. The watch sends a statement at least this often,
    /// and the server drops its connection after this long and 5 s more of silence (a follower
    /// whose process stopped).
    #[must_use]
    pub fn watch_interval(mut self, interval: Duration) -> Self {
        self.watch_interval = interval.max(Duration::from_secs(1));
        self
    }

    /// How long the server keeps this lock's session when the client goes silent (its
    /// `wait_timeout`, and `net_read_timeout` and `net_write_timeout` for a client that stops
    /// in the middle of a packet; whole seconds; default 30 s), and never less than the lease
    /// of the term it holds: a holder whose process stopped with its connection open (frozen,
    /// or cut off without the server noticing) keeps the user-level lock, and with it the
    /// election, this long after its last statement, instead of the server's default of 8
    /// hours. The lock sets these on its own session whatever the server's defaults are, so a
    /// short server `wait_timeout` does not drop a holder between renewals; a value below the
    /// lease would (the holder renews once a retry period), and would free the election no
    /// sooner, since followers wait the lease out.
    #[must_use]
    pub fn idle_session_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout.max(Duration::from_secs(1));
        self
    }

    /// The election's name (its row's primary key).
    pub fn name(&self) -> &str {
        self.table.name()
    }

    /// The user-level lock's name, derived from the database, table and election name: what
    /// `IS_USED_LOCK` takes.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The connection id of the lock's own session, if it has one: what `KILL` takes.
    pub async fn session_id(&self) -> Option<u32> {
        self.shared
            .session
            .lock()
            .await
            .as_ref()
            .map(|session| session.conn.id())
    }
}

#[async_trait]
impl ResourceLock for NamedLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        self.table.get().await
    }

    /// Creates the record; one naming this candidate as holder takes the user-level lock first
    /// ([`LockError::Conflict`] when another session holds it), and goes on from the highest
    /// fencing token this lock saw, as the table lock's does.
    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        if record.is_free() || record.holder_identity != self.table.identity() {
            return self.table.create(record).await;
        }
        let record = self.table.fenced(None, record).await?;
        let (params, version) = self.table.create_params(&record)?;
        let sql = &self.store.inner().named_statements.create;
        match self.own_write(&record, Hold::Always, sql, params).await? {
            Written::Stored => {
                let created = self.table.written(record, version);
                self.store.term_started(self, created).await
            }
            Written::Busy | Written::Missed => Err(LockError::conflict(BACKEND)),
        }
    }

    /// As the table lock's update (fencing tokens included); a write naming this candidate as
    /// holder also needs the user-level lock on this lock's session (taken for a takeover of a
    /// record that names nobody or another holder, only checked for the holder's own writes),
    /// and a release hands the user-level lock back once the free record is stored.
    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        if record.is_free() {
            let mut result = None;
            self.if_session(async |session| {
                let written = self.table.update(version, record).await;
                if written.is_ok() {
                    self.let_go(session).await;
                } else if session.term.is_some() {
                    self.keep_if_holder(session).await;
                }
                result = Some(written);
            })
            .await;
            return match result {
                Some(written) => written,
                None => self.table.update(version, record).await,
            };
        }
        if record.holder_identity != self.table.identity() {
            // A request on the holder's behalf: no user-level lock is involved.
            return self.table.update(version, record).await;
        }
        let Some(expected) = parse_version(version) else {
            return Err(LockError::conflict(BACKEND));
        };
        let record = self.table.fenced(Some(expected), record).await?;
        let (params, new_version) = self.table.update_params(expected, &record)?;
        let sql = &self.store.inner().named_statements.update;
        match self
            .own_write(&record, Hold::Takeover(expected), sql, params)
            .await?
        {
            Written::Stored => Ok(self.table.written(record, new_version)),
            Written::Busy | Written::Missed => Err(LockError::conflict(BACKEND)),
        }
    }

    async fn time_left(&self) -> Result<Option<Duration>, LockError> {
        self.table.time_left().await
    }

    /// Refuses a server with Galera replication on (`wsrep_on=ON`), as opening the lock from a
    /// URL does: there every attempt would fail; and what the table lock refuses.
    async fn check_lease(&self, lease_duration: Duration) -> Result<(), LockError> {
        self.check_server().await?;
        self.table.check_lease(lease_duration).await
    }

    /// Writes the event as a `tracing` event; when a term ends, hands its user-level lock back
    /// (unless a later term of this lock holds it by now).
    async fn record_event(&self, event: &LeaderEvent) {
        tracing::info!(lock = %self.describe(), identity = self.identity(), ?event, "leader event");
        if let LeaderEvent::StoppedLeading { fencing_token } = event {
            self.if_session(async |session| {
                if session.term == Some(*fencing_token) {
                    self.let_go(session).await;
                }
            })
            .await;
        }
    }

    fn identity(&self) -> &str {
        self.table.identity()
    }

    fn describe(&self) -> String {
        format!(
            "mysql+named:{}/{}",
            self.store.inner().table.display(),
            self.table.name()
        )
    }

    fn election_name(&self) -> Option<&str> {
        Some(self.table.name())
    }

    /// A stream fed by a task with a connection of its own, shared by every stream of this
    /// lock: it waits in `GET_LOCK` while another session holds the lock (and lets go in the
    /// same statement when it gets it), reads the record after each wait, and fires when the holder's session
    /// let go, or the holder, the handover request or the fencing term changed.
    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        {
            let watcher = self
                .shared
                .watcher
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some(watcher) = watcher
                .as_ref()
                // The task closes the hub before it ends: a watch from then on starts another.
                .filter(|w| !w.hub.is_closed() && !w.task.is_finished())
            {
                return Ok(Some(watcher.hub.subscribe(CHANNEL)));
            }
        }
        self.table.check_name()?;
        let mut conn = self.store.dedicated().await?;
        let context = self.context();
        // The watch holds the user-level lock only inside a statement; should a statement
        // still leave it held (killed between its GET_LOCK and RELEASE_LOCK), the server drops
        // a stopped follower's connection, and the lock, within this long.
        conn.query_drop(session_timeouts(self.watch_interval + WATCH_SILENCE_MARGIN))
            .await
            .map_err(|err| map(&context, err))?;
        let statements = &self.store.inner().named_statements;
        let last: Summary = conn
            .exec_first(&statements.summary, (self.table.name(),))
            .await
            .map_err(|err| map(&context, err))?;
        let hub = ChangeHub::new();
        let stream = hub.subscribe(CHANNEL);
        let follower = Follower {
            lock: Arc::downgrade(&self.shared),
            store: self.store.clone(),
            name: self.table.name().to_owned(),
            key: self.key.clone(),
            interval: self.watch_interval,
            hub: hub.clone(),
            last,
        };
        let task = tokio::spawn(follower.run(conn));
        let previous = self
            .shared
            .watcher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(Watcher { hub, task });
        if let Some(previous) = previous {
            previous.stop();
        }
        Ok(Some(stream))
    }

    async fn close(&self) {
        let watcher = self
            .shared
            .watcher
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(watcher) = watcher {
            watcher.stop();
        }
        let mut slot = self.shared.session.lock().await;
        if let Some(mut session) = slot.take() {
            self.let_go(&mut session).await;
            let _ = session.conn.disconnect().await;
        }
        self.shared.holding.store(false, Ordering::Release);
    }

    /// Reads the record; when it is free, or expired by the server's clock, takes the
    /// user-level lock on this lock's session and then the record, with one `UPDATE` at the
    /// version read whose condition (free or expired, and the session holding the lock) the
    /// server checks again. When another session holds the user-level lock, the lease is
    /// reported [`Held`](Acquisition::Held). Inserts the record when there is none.
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let Some((observed, left)) = self.table.observe().await? else {
            return acquire_first(self, desired).await;
        };
        let current = &observed.record;
        let reserved = current.reserved_for_other_than(&desired.holder_identity);
        let held = Acquisition::Held {
            observed: observed.clone(),
            expires_in: Some(left),
            // Every renewal writes the row: its version changes.
            renewed_in_store: false,
        };
        if (!current.is_free() && !left.is_zero()) || reserved {
            return Ok(Some(held));
        }
        let (taken, params, version) = self.table.takeover(&observed, desired)?;
        let sql = &self.store.inner().named_statements.take;
        match self.own_write(&taken, Hold::Always, sql, params).await? {
            Written::Stored => {
                let taken = self.table.written(taken, version);
                self.store.acquired(self, taken).await
            }
            Written::Busy => Ok(Some(held)),
            // Written since the read, or not expired yet by the server's clock.
            Written::Missed => Err(LockError::conflict(BACKEND)),
        }
    }

    /// Every write naming a holder needs the user-level lock (`GET_LOCK`) on this lock's
    /// session, which a deletion of the row does not free: no lease is taken while the
    /// holder's session lives, row or not.
    fn holder_check(&self) -> HolderCheck {
        HolderCheck::Session
    }
}
