//! The connection side: pool, TLS, dedicated sessions and the shared LISTEN connection.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use futures_util::StreamExt;
use leader_core::backend::{ChangeHub, SettingsCheck, is_read_only};
use leader_core::{Acquisition, ChangeStream, LockError, Observed, ResourceLock};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Mutex, broadcast};
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{AsyncMessage, Client, Config, Connection, NoTls, SimpleQueryMessage, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{BACKEND, map, map_pool};
use crate::sql::{Kind, Statements, TableName};
use leader_core::redact_url;

/// The default table name.
pub const DEFAULT_TABLE: &str = "leader_election";

/// The default schema.
pub const DEFAULT_SCHEMA: &str = "public";

/// Builds a [`PostgresStore`]; start with [`PostgresStore::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct PostgresStoreBuilder {
    url: String,
    schema: String,
    table: String,
    create_table: bool,
    max_connections: usize,
    tls: Option<rustls::ClientConfig>,
    pool: Option<Pool>,
    listen: bool,
}

impl fmt::Debug for PostgresStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStoreBuilder")
            .field("url", &redact_url(&self.url))
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("create_table", &self.create_table)
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

impl PostgresStoreBuilder {
    /// The schema of the lock table (default `public`).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The lock table (default `leader_election`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Create the table when it is missing, at [`build`](Self::build) (default false: a
    /// least-privilege role cannot, see `deploy/postgres/`).
    pub fn create_table(mut self, create: bool) -> Self {
        self.create_table = create;
        self
    }

    /// Size of the connection pool (default 4). Advisory locks and notifications use dedicated
    /// connections besides the pool.
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// TLS settings for `sslmode=require` (default: the Mozilla root certificates from
    /// `webpki-roots`). Use it to trust a private CA.
    pub fn tls(mut self, config: rustls::ClientConfig) -> Self {
        self.tls = Some(config);
        self
    }

    /// Use an existing pool for the table lock's statements; the URL still serves the dedicated
    /// connections (notifications, advisory locks). A connection that the pool's other users had
    /// since the locks last did is checked with one statement before a lock uses it, and closed
    /// if they left it inside a transaction.
    pub fn pool(mut self, pool: Pool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Whether followers of the table lock hear releases and takeovers through `LISTEN` on a
    /// connection of the store's own (default true). Behind a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`), which gives each transaction whichever server
    /// session is free, a `LISTEN` hears nothing: turn it off there, and followers read the
    /// record every retry period instead (`listen=false` in a lock URL). The advisory lock
    /// needs a session of its own, which such a pooler does not keep: see the README.
    pub fn listen(mut self, listen: bool) -> Self {
        self.listen = listen;
        self
    }

    /// Connects (lazily: the pool opens connections on first use) and, if asked, creates the table.
    pub async fn build(self) -> Result<PostgresStore, LockError> {
        let redacted = redact_url(&self.url);
        let invalid = |message: String| LockError::Misconfigured {
            backend: BACKEND,
            message: format!("invalid connection string {redacted}: {message}"),
        };
        leader_core::backend::check_user_info(&self.url).map_err(|err| invalid(err.message))?;
        let mut config = Config::from_str(&self.url).map_err(|err| invalid(err.to_string()))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(5));
        }
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(10));
        if config.get_application_name().is_none() {
            config.application_name("leader-postgres");
        }
        let connector = match config.get_ssl_mode() {
            SslMode::Require => {
                Connector::Tls(MakeRustlsConnect::new(self.tls.unwrap_or_else(default_tls)))
            }
            _ => {
                config.ssl_mode(SslMode::Disable);
                Connector::Plain
            }
        };
        let table = TableName::new(&self.schema, &self.table)?;
        let pool = match self.pool {
            Some(pool) => pool,
            None => {
                let manager_config = ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                };
                let manager = match &connector {
                    Connector::Plain => Manager::from_config(config.clone(), NoTls, manager_config),
                    Connector::Tls(tls) => {
                        Manager::from_config(config.clone(), tls.clone(), manager_config)
                    }
                };
                Pool::builder(manager)
                    .max_size(self.max_connections)
                    .runtime(Runtime::Tokio1)
                    .wait_timeout(Some(Duration::from_secs(5)))
                    .create_timeout(Some(Duration::from_secs(5)))
                    .build()
                    .map_err(|err| LockError::other(BACKEND, err.to_string()))?
            }
        };
        let store = PostgresStore {
            inner: Arc::new(Inner {
                pool,
                config,
                connector,
                redacted,
                table_statements: Statements::new(&table, Kind::Table),
                advisory_statements: Statements::new(&table, Kind::Advisory),
                table,
                listen: self.listen,
                listener: Listener::default(),
                checkouts: Checkouts::default(),
                durable: SettingsCheck::default(),
            }),
        };
        if self.create_table {
            store.create_table().await?;
        }
        Ok(store)
    }
}

fn default_tls() -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map(|builder| builder.with_root_certificates(roots).with_no_client_auth())
        .unwrap_or_else(|_| unreachable!("ring supports the default protocol versions"))
}

#[derive(Clone)]
enum Connector {
    Plain,
    Tls(MakeRustlsConnect),
}

/// A Postgres server holding lock tables: make [`TableLock`](crate::TableLock)s and
/// [`AdvisoryLock`](crate::AdvisoryLock)s from it.
///
/// Cheap to clone; all locks made from one store share its pool and one LISTEN connection.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: Pool,
    config: Config,
    connector: Connector,
    pub(crate) redacted: String,
    pub(crate) table: TableName,
    pub(crate) table_statements: Statements,
    pub(crate) advisory_statements: Statements,
    /// Whether followers listen ([`PostgresStoreBuilder::listen`]).
    listen: bool,
    listener: Listener,
    checkouts: Checkouts,
    /// [`check_durability`](PostgresStore::check_durability), which stands for a second.
    durable: SettingsCheck,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("url", &self.inner.redacted)
            .field("table", &self.inner.table.display())
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// A builder for the server at `url` (`postgres://user:password@host:port/db?sslmode=require`
    /// or `host=... user=...`).
    ///
    /// TLS: `sslmode=require` connects with rustls and verifies the server's certificate; without
    /// it (or with `disable` / `prefer`) the connection is plain TCP.
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.into(),
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            create_table: false,
            max_connections: 4,
            tls: None,
            pool: None,
            listen: true,
        }
    }

    /// A store for the server at `url` with the default table and settings.
    pub async fn connect(url: impl Into<String>) -> Result<Self, LockError> {
        Self::builder(url).build().await
    }

    /// Makes the lock table ready, after looking at the table of that name: creates it if it
    /// does not exist (`CREATE TABLE IF NOT EXISTS`; needs the CREATE privilege on the schema),
    /// adds the `extensions` column to a lock table of the earlier version (as
    /// [`MIGRATION`](crate::MIGRATION); needs to own it), and uses a current lock table as it is
    /// (needs no right beyond the lock's).
    ///
    /// # Errors
    /// `Misconfigured`, in one line naming the table and what is wrong, when a table of that
    /// name is not a lock table of this or the earlier version (other columns or types, no
    /// unique `name`, a view): it is left exactly as it is.
    pub async fn create_table(&self) -> Result<(), LockError> {
        let client = self.client().await?;
        let prepared = crate::schema::prepare(&client, &self.inner.table, &self.context()).await;
        client.answered(prepared)
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The connection string with the password redacted.
    pub fn redacted_url(&self) -> &str {
        &self.inner.redacted
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    pub(crate) fn context(&self) -> String {
        format!(
            "{} table {}",
            self.inner.redacted,
            self.inner.table.display()
        )
    }

    /// A pooled connection for one of the locks' statements, each its own transaction, lent
    /// until the request has its answer ([`Lent::answered`]). One that another user of the pool
    /// had since the locks last did is checked first: see [`checked`](Self::checked).
    pub(crate) async fn client(&self) -> Result<Lent, LockError> {
        let client = self
            .inner
            .pool
            .get()
            .await
            .map_err(|err| map_pool(&self.context(), err))?;
        let client = Lent {
            object: Some(client),
            store: self.clone(),
        };
        let checkouts = &self.inner.checkouts;
        let bound = 4 * self.inner.pool.status().max_size + 16;
        if checkouts.ours(&client, bound) {
            return Ok(client);
        }
        let client = self.checked(client).await?;
        checkouts.record(&client, bound);
        Ok(client)
    }

    /// S15: refuses a server on which a crash can undo a commit the lock was told of, as the
    /// connections the locks use see it (the server's `postgresql.conf`, or an `ALTER ROLE` or
    /// `ALTER DATABASE ... SET`, or the URL's `options`): `synchronous_commit = off` acknowledges
    /// a commit before its WAL is flushed, and `fsync = off` never flushes it. A take-over lost
    /// so would leave the row at the expired record it replaced, and the next candidate would
    /// take it with the same fencing token while the first leads on.
    ///
    /// Checked before an elector runs and again at each term's start ([`term_started`](
    /// Self::term_started)), since a reload or an `ALTER ROLE` changes it under a running lock;
    /// a check that passed stands for a second, so a shard set's member that takes many shards
    /// at once asks once.
    pub(crate) async fn check_durability(&self) -> Result<(), LockError> {
        self.inner.durable.run(self.read_durability()).await
    }

    /// [`check_durability`](Self::check_durability)'s reading, every time.
    async fn read_durability(&self) -> Result<(), LockError> {
        let context = self.context();
        let client = self.client().await?;
        let read = client
            .query_typed_one(
                "SELECT pg_catalog.current_setting('synchronous_commit'), \
                 pg_catalog.current_setting('fsync')",
                &[],
            )
            .await
            .map_err(|err| map(&context, err));
        let row = client.answered(read)?;
        let (synchronous_commit, fsync): (String, String) = (row.get(0), row.get(1));
        let undoable = if fsync == "off" {
            Some(("fsync = off", "turn fsync on in the server's configuration"))
        } else if synchronous_commit == "off" {
            Some((
                "synchronous_commit = off",
                "turn it on for the lock's role (ALTER ROLE ... SET synchronous_commit = on), its database or the server",
            ))
        } else {
            None
        };
        match undoable {
            None => Ok(()),
            Some((setting, remedy)) => Err(LockError::Misconfigured {
                backend: crate::error::BACKEND,
                message: format!(
                    "{context}: the lock's connections run with {setting}, so a crash can undo a commit the server acknowledged, and a lease taken over could be taken again with the same fencing token: {remedy}"
                ),
            }),
        }
    }

    /// At a term's start (`lock` just took `taken`): checks the durability of commits again
    /// (S15). When a crash can undo them now, the lease is released at once and the term never
    /// starts; an outage leaves the term to go on, and the next one checks.
    pub(crate) async fn term_started(
        &self,
        lock: &dyn ResourceLock,
        taken: &Observed,
    ) -> Result<(), LockError> {
        let checked = self.check_durability().await;
        leader_core::backend::refuse_at_term_start(lock, taken, checked).await
    }

    /// [`term_started`](Self::term_started) for what a lock's one-request acquisition answered.
    pub(crate) async fn acquisition_started(
        &self,
        lock: &dyn ResourceLock,
        answer: Acquisition,
    ) -> Result<Acquisition, LockError> {
        if let Acquisition::Acquired(taken) = &answer {
            self.term_started(lock, taken).await?;
        }
        Ok(answer)
    }

    /// `client`, unless the user of the pool who had it left it inside a transaction (or one
    /// that failed): its `now()` is when that transaction began, and nothing the lock wrote
    /// would be committed. One statement in the simple protocol tells: it begins a transaction
    /// of its own, which starts when it does, unless it runs inside one already. Such a
    /// connection is closed, which rolls its transaction back.
    async fn checked(&self, client: Lent) -> Result<Lent, LockError> {
        let answer = client
            .simple_query(
                "SELECT pg_catalog.statement_timestamp() = pg_catalog.transaction_timestamp()",
            )
            .await;
        let own_transaction = match answer {
            Ok(messages) => messages
                .iter()
                .any(|m| matches!(m, SimpleQueryMessage::Row(row) if row.get(0) == Some("t"))),
            Err(err) if err.code() == Some(&SqlState::IN_FAILED_SQL_TRANSACTION) => false,
            Err(err) => return Err(map(&self.context(), err)),
        };
        if own_transaction {
            return Ok(client);
        }
        client.close();
        Err(LockError::other(
            BACKEND,
            format!(
                "{}: a pooled connection was inside a transaction, left open by another user of the pool: its now() is when that transaction began, and nothing written on it would be committed; nothing was run on it, and it is closed (commit or roll back before returning a connection to the pool)",
                self.context()
            ),
        ))
    }

    /// Closes a pooled connection, and forgets it.
    fn close_pooled(&self, object: Object) {
        self.inner.checkouts.forget(&object);
        drop(Object::take(object));
    }

    /// A connection outside the pool; its notifications go to `notify`.
    pub(crate) async fn dedicated(
        &self,
        settings: &str,
        notify: Option<broadcast::Sender<String>>,
    ) -> Result<Dedicated, LockError> {
        let context = self.context();
        let client = match &self.inner.connector {
            Connector::Plain => connect(&self.inner.config, NoTls, notify).await,
            Connector::Tls(tls) => connect(&self.inner.config, tls.clone(), notify).await,
        }
        .map_err(|err| map(&context, err))?;
        if !settings.is_empty() {
            client
                .batch_execute(settings)
                .await
                .map_err(|err| map(&context, err))?;
        }
        Ok(client)
    }

    /// Subscribes to the notification channel `channel` on the store's LISTEN connection;
    /// `None` when the store does not listen ([`PostgresStoreBuilder::listen`]).
    pub(crate) async fn listen(&self, channel: &str) -> Result<Option<ChangeStream>, LockError> {
        if !self.inner.listen {
            return Ok(None);
        }
        self.inner.listener.subscribe(self, channel).await.map(Some)
    }
}

/// A connection of its own: its client, and the task that drives its socket. Dropping it
/// closes the socket at once, even while a request is in flight (dropping a client alone
/// leaves the socket open until every pending response has arrived), so the server ends the
/// session as soon as the close reaches it.
pub(crate) struct Dedicated {
    client: Client,
    connection: tokio::task::AbortHandle,
}

impl std::ops::Deref for Dedicated {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Dedicated {
    /// Closes the socket at once, as dropping it does.
    pub(crate) fn close(&self) {
        self.connection.abort();
    }
}

impl Drop for Dedicated {
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for Dedicated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dedicated")
            .field("closed", &self.client.is_closed())
            .finish_non_exhaustive()
    }
}

async fn connect<T>(
    config: &Config,
    tls: T,
    notify: Option<broadcast::Sender<String>>,
) -> Result<Dedicated, tokio_postgres::Error>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
{
    let (client, connection) = config.connect(tls).await?;
    let connection = tokio::spawn(drive(connection, notify)).abort_handle();
    Ok(Dedicated { client, connection })
}

/// Drives a dedicated connection, forwarding the channel names of notifications.
async fn drive<S, T>(mut connection: Connection<S, T>, notify: Option<broadcast::Sender<String>>)
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    while let Some(message) = messages.next().await {
        match message {
            Ok(AsyncMessage::Notification(n)) => {
                if let Some(tx) = &notify {
                    let _ = tx.send(n.channel().to_owned());
                }
            }
            Ok(_) => {}
            Err(err) => {
                tracing::debug!(error = %err, "postgres dedicated connection closed");
                break;
            }
        }
    }
}

/// Which pooled connections the store's locks had, and at which of their checkouts. The pool
/// counts every checkout of a connection after the first (its recycle count): a connection the
/// locks had at the count just before went to nobody else in between, and one the pool has just
/// made (count 0) went to nobody before.
#[derive(Debug, Default)]
struct Checkouts {
    /// By connection (its statement cache's address, and when it was made): the count at the
    /// locks' last checkout of it.
    last: std::sync::Mutex<HashMap<(usize, Instant), usize>>,
}

impl Checkouts {
    fn key(client: &Object) -> (usize, Instant) {
        (
            Arc::as_ptr(&client.statement_cache).addr(),
            Object::metrics(client).created,
        )
    }

    /// Whether the locks had `client` at its previous checkout, or nobody did; records this
    /// checkout when so.
    fn ours(&self, client: &Object, bound: usize) -> bool {
        let count = Object::metrics(client).recycle_count;
        let key = Self::key(client);
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let ours = count == 0 || last.get(&key).is_some_and(|&seen| seen + 1 == count);
        if ours {
            Self::insert(&mut last, key, count, bound);
        }
        ours
    }

    /// Forgets `client`, which is closed.
    fn forget(&self, client: &Object) {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        last.remove(&Self::key(client));
    }

    /// Records a checkout of `client` by the locks.
    fn record(&self, client: &Object, bound: usize) {
        let count = Object::metrics(client).recycle_count;
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        Self::insert(&mut last, Self::key(client), count, bound);
    }

    /// Keeps at most `bound` connections: the others are ones the pool has dropped, or are
    /// checked again at their next checkout.
    fn insert(
        last: &mut HashMap<(usize, Instant), usize>,
        key: (usize, Instant),
        count: usize,
        bound: usize,
    ) {
        if last.len() >= bound && !last.contains_key(&key) {
            last.clear();
        }
        last.insert(key, count);
    }
}

/// Hands the LISTEN connection's notifications to the followers until it closes; then every
/// follower is woken to read the record and its stream ends, and the next subscription opens a
/// new connection.
async fn read_notifications(mut rx: broadcast::Receiver<String>, hub: ChangeHub) {
    loop {
        match rx.recv().await {
            Ok(channel) => hub.notify(&channel),
            // Missed some: wake every follower, they will read the record.
            Err(broadcast::error::RecvError::Lagged(_)) => hub.notify_all(),
            Err(broadcast::error::RecvError::Closed) => break,
        }
    }
    // A release may have gone unheard: every follower reads the record.
    hub.notify_all();
    hub.close();
}

/// Checks the LISTEN connection every [`LISTEN_CHECK`] with an empty statement, beside its
/// reader, until its hub closes or the listener lets go of it. A check unanswered within
/// [`LISTEN_CHECK_TIMEOUT`] closes the connection and the hub: the followers are woken to read
/// the record (a release may have gone unheard), and their streams end, so that the next
/// subscription opens a new connection.
async fn check_listener(connection: std::sync::Weak<Dedicated>, hub: ChangeHub) {
    loop {
        tokio::time::sleep(LISTEN_CHECK).await;
        let Some(connection) = connection.upgrade() else {
            return;
        };
        if hub.is_closed() {
            return;
        }
        let answer = tokio::time::timeout(LISTEN_CHECK_TIMEOUT, connection.simple_query("")).await;
        if !matches!(answer, Ok(Ok(_))) {
            tracing::debug!("the LISTEN connection did not answer its check: closed");
            hub.notify_all();
            hub.close();
            connection.close();
            return;
        }
    }
}

/// A pooled connection lent to one request. It goes back to the pool once the request has its
/// answer ([`answered`](Self::answered)), an error from the server included. Dropped before
/// that (its caller gave up on the request: the elector's request timeout, a shard round's
/// deadline; or a statement failed on the way), it is checked first: an empty statement, which
/// the server answers after whatever the connection still runs. Answered within
/// [`CHECK_TIMEOUT`], the connection goes back to the pool (a server that was only slow keeps
/// its connections); otherwise what it still runs is cancelled and it is closed. While
/// requests wait for a connection, it is closed at once. A connection whose request went
/// unanswered may be one whose state a NAT or firewall dropped, which no error reports, and the
/// pool would lend it to every later request until TCP gave up on it.
pub(crate) struct Lent {
    object: Option<Object>,
    store: PostgresStore,
}

/// How long the check of a connection whose request went unanswered waits for its answer:
/// the connection is out of the pool meanwhile, so it is short.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

impl Lent {
    /// The request has its answer: the connection goes back to the pool, and `result` is
    /// passed on. A connection that answered that it takes no writes (a standby, a primary
    /// demoted by a failover) is closed instead, so the next request opens another.
    pub(crate) fn answered<T>(mut self, result: Result<T, LockError>) -> Result<T, LockError> {
        match &result {
            Err(err) if is_read_only(err) => self.close(),
            _ => drop(self.object.take()),
        }
        result
    }

    /// Closes the connection instead of giving it back to the pool.
    fn close(mut self) {
        if let Some(object) = self.object.take() {
            self.store.close_pooled(object);
        }
    }
}

impl std::ops::Deref for Lent {
    type Target = Object;

    fn deref(&self) -> &Object {
        match &self.object {
            Some(object) => object,
            None => unreachable!("a lent connection is only taken back when it is dropped"),
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(object) = self.object.take() else {
            return;
        };
        let store = self.store.clone();
        // Dropped outside a runtime (a store dropped at exit), nothing to check with; and a
        // request waiting for a connection gets a new one at once rather than after a check.
        let runtime = tokio::runtime::Handle::try_current().ok();
        let Some(runtime) = runtime.filter(|_| store.inner.pool.status().waiting == 0) else {
            store.close_pooled(object);
            return;
        };
        runtime.spawn(async move {
            let answer = tokio::time::timeout(CHECK_TIMEOUT, object.simple_query("")).await;
            if matches!(answer, Ok(Ok(_))) {
                return;
            }
            tracing::debug!("a pooled connection did not answer its check: closed");
            // A statement still running (one waiting on a lock, say) would go on after the
            // close, which a waiting backend does not notice: it is cancelled first.
            let cancel = object.cancel_token();
            let cancelled = tokio::time::timeout(CHECK_TIMEOUT, async {
                match &store.inner.connector {
                    Connector::Plain => cancel.cancel_query(NoTls).await,
                    Connector::Tls(tls) => cancel.cancel_query(tls.clone()).await,
                }
            })
            .await;
            if !matches!(cancelled, Ok(Ok(()))) {
                tracing::debug!("could not cancel the statement of a closed connection");
            }
            store.close_pooled(object);
        });
    }
}

/// How often the LISTEN connection is checked with an empty statement. The connection is idle
/// while nobody releases or takes a lease, and a NAT or firewall drops the state of an idle
/// connection: the check keeps it in use, and finds one whose state was dropped all the same,
/// which no error reports, within this period and [`LISTEN_CHECK_TIMEOUT`].
const LISTEN_CHECK: Duration = Duration::from_secs(10);

/// How long the LISTEN connection's check waits for its answer before it closes the connection.
const LISTEN_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// One LISTEN connection per store, fanned out to the followers of each channel.
#[derive(Default)]
struct Listener {
    connection: Mutex<Option<Listening>>,
}

/// The LISTEN connection, the hub of its followers, and the task that checks it (stopped, and
/// the connection closed, when dropped).
struct Listening {
    client: Arc<Dedicated>,
    hub: ChangeHub,
    checker: tokio::task::AbortHandle,
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.checker.abort();
        self.hub.close();
    }
}

impl Listener {
    async fn subscribe(
        &self,
        store: &PostgresStore,
        channel: &str,
    ) -> Result<ChangeStream, LockError> {
        let mut connection = self.connection.lock().await;
        // A connection that closed, or whose hub closed (it did not answer a check), is
        // replaced.
        if connection
            .as_ref()
            .is_none_or(|c| c.client.is_closed() || c.hub.is_closed())
        {
            *connection = None;
            let (tx, rx) = broadcast::channel::<String>(256);
            let client = Arc::new(store.dedicated("", Some(tx)).await?);
            let hub = ChangeHub::new();
            tokio::spawn(read_notifications(rx, hub.clone()));
            let checker =
                tokio::spawn(check_listener(Arc::downgrade(&client), hub.clone())).abort_handle();
            *connection = Some(Listening {
                client,
                hub,
                checker,
            });
        }
        let Some(active) = connection.as_ref() else {
            unreachable!("connected above");
        };
        if !active.hub.contains(channel) {
            let listened = active
                .client
                .batch_execute(&format!("LISTEN \"{channel}\""))
                .await
                .map_err(|err| map(&store.context(), err));
            // A standby refuses LISTEN as read-only: the connection is given up, and the next
            // subscription may reach the primary.
            if let Err(err) = listened {
                if is_read_only(&err) {
                    *connection = None;
                }
                return Err(err);
            }
        }
        // Ends at once if the hub closed meanwhile: the follower subscribes again.
        Ok(active.hub.subscribe(channel))
    }
}
