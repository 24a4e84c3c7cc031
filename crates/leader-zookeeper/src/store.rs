//! The ensemble: one ZooKeeper session shared by every lock made from a store, opened again
//! when the ensemble ends it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use leader_core::LockError;
use zookeeper_client as zk;

use crate::error::{BACKEND, Context, auth_failed, ends_session, map};

/// The default prefix: the znode under the chroot that keeps every election's znodes.
pub const DEFAULT_PREFIX: &str = "/leader";

/// The session timeout a store asks the ensemble for unless told otherwise. The ensemble
/// grants a value between its `minSessionTimeout` and `maxSessionTimeout` (by default 2 and 20
/// times its `tickTime` of 2 s: 4 to 40 s); a lock refuses to hold a lease longer than what it
/// granted less the connection timeout (see [`ZooKeeperLock`](crate::ZooKeeperLock)). 30 s,
/// with [`DEFAULT_CONNECTION_TIMEOUT`], covers every lease up to 26 s.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(30);

/// How long opening a session may take before the store reports the ensemble unavailable.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the client waits for a word from its server (an answer, a ping's) before it takes
/// the connection as lost and moves the session to another server. The client's own default,
/// 2/5 of the session timeout (12 s of a 30 s session), is longer than a renew deadline of
/// 10 s: a holder connected to a server that froze would lose its term waiting for it. 4 s
/// leaves the holder time to move and renew; the client pings an idle connection every 3/8 of
/// it (1.5 s).
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(4);

/// A ZooKeeper ensemble and the prefix that keeps the election znodes, on one session. Cheap to
/// clone; every lock made from it shares the session, whose ephemeral znodes are the leases of
/// its holders.
#[derive(Clone)]
pub struct ZooKeeperStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// `host:port,...` and the chroot, as the client takes it.
    connect: String,
    /// The servers and chroot for messages.
    described: String,
    chroot: String,
    pub(crate) prefix: String,
    session_timeout: Duration,
    connect_timeout: Duration,
    connection_timeout: Duration,
    digest: Option<(String, String)>,
    /// The session, until the ensemble ends it.
    session: tokio::sync::Mutex<Option<zk::Client>>,
}

impl fmt::Debug for ZooKeeperStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZooKeeperStore")
            .field("ensemble", &self.inner.described)
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

/// Builds a [`ZooKeeperStore`].
#[derive(Clone)]
pub struct ZooKeeperStoreBuilder {
    servers: Vec<String>,
    chroot: String,
    prefix: String,
    session_timeout: Duration,
    connect_timeout: Duration,
    connection_timeout: Duration,
    digest: Option<(String, String)>,
}

impl fmt::Debug for ZooKeeperStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZooKeeperStoreBuilder")
            .field("servers", &self.servers)
            .field("chroot", &self.chroot)
            .field("prefix", &self.prefix)
            .field("session_timeout", &self.session_timeout)
            .field("digest_user", &self.digest.as_ref().map(|(user, _)| user))
            .finish_non_exhaustive()
    }
}

impl ZooKeeperStoreBuilder {
    /// The chroot: a znode that must exist, which the session sees as its root (`/kafka`, say).
    /// Default: none.
    pub fn chroot(mut self, chroot: impl Into<String>) -> Self {
        self.chroot = normalize(&chroot.into());
        self
    }

    /// The znode under the chroot that keeps the elections' znodes, created when missing.
    /// Default [`DEFAULT_PREFIX`].
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix = normalize(&prefix.into());
        self.prefix = if prefix.is_empty() {
            DEFAULT_PREFIX.to_owned()
        } else {
            prefix
        };
        self
    }

    /// The session timeout to ask the ensemble for. Default [`DEFAULT_SESSION_TIMEOUT`].
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// How long opening a session may take. Default [`DEFAULT_CONNECT_TIMEOUT`].
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long the client waits for a word from its server before it moves the session to
    /// another; keep it well under the renew deadline. Default
    /// [`DEFAULT_CONNECTION_TIMEOUT`]. Whatever is set, the store asks for at most 2/5 of the
    /// session timeout it asks for (the client's own default). A lock's lease is at most the
    /// granted session timeout less this.
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// Authenticates the session with ZooKeeper's `digest` scheme, and creates the znodes with
    /// the `auth` ACL: only sessions with the same user and password may read or write them.
    pub fn digest(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.digest = Some((user.into(), password.into()));
        self
    }

    /// Opens the session, and checks that the chroot exists and that the prefix can be
    /// created.
    ///
    /// # Errors
    /// No server, or none answering within the connect timeout ([`LockError::Unavailable`]);
    /// a chroot that does not exist ([`LockError::Misconfigured`]); refused credentials or no
    /// rights on the prefix ([`LockError::Forbidden`]).
    pub async fn build(self) -> Result<ZooKeeperStore, LockError> {
        if self.servers.is_empty() {
            return Err(LockError::Misconfigured {
                backend: BACKEND,
                message: "no ZooKeeper server given".to_owned(),
            });
        }
        let servers = self.servers.join(",");
        let described = format!("{servers}{}", self.chroot);
        let store = ZooKeeperStore {
            inner: Arc::new(Inner {
                connect: described.clone(),
                described,
                chroot: self.chroot,
                prefix: self.prefix,
                session_timeout: self.session_timeout,
                connect_timeout: self.connect_timeout,
                connection_timeout: self.connection_timeout,
                digest: self.digest,
                session: tokio::sync::Mutex::new(None),
            }),
        };
        store.client().await?;
        Ok(store)
    }
}

/// `path` as an absolute znode path without a trailing `/`; the root is empty.
fn normalize(path: &str) -> String {
    let trimmed = path.trim_matches('/');
    if trimmed.is_empty() {
        String::new()
    } else {
        format!("/{trimmed}")
    }
}

impl ZooKeeperStore {
    /// A builder for the ensemble at `servers`: `host:port` pairs separated by commas, as
    /// ZooKeeper's own clients take them (a chroot goes to
    /// [`chroot`](ZooKeeperStoreBuilder::chroot)).
    pub fn builder(servers: impl AsRef<str>) -> ZooKeeperStoreBuilder {
        ZooKeeperStoreBuilder {
            servers: servers
                .as_ref()
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            chroot: String::new(),
            prefix: DEFAULT_PREFIX.to_owned(),
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            digest: None,
        }
    }

    /// The prefix under the chroot.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The ensemble and chroot, for messages.
    pub fn describe(&self) -> &str {
        &self.inner.described
    }

    /// The ACL of the znodes the locks create: the session's own digest identity when it has
    /// one, anyone otherwise.
    pub(crate) fn acls(&self) -> zk::Acls<'static> {
        if self.inner.digest.is_some() {
            zk::Acls::creator_all()
        } else {
            zk::Acls::anyone_all()
        }
    }

    /// The session: the one open, or a new one when there is none or the ensemble ended it
    /// (expired, closed, refused). A new session finds the chroot and creates the prefix.
    ///
    /// # Errors
    /// As [`ZooKeeperStoreBuilder::build`].
    pub async fn client(&self) -> Result<zk::Client, LockError> {
        let mut session = self.inner.session.lock().await;
        if let Some(client) = session.as_ref()
            && !client.state().is_terminated()
        {
            return Ok(client.clone());
        }
        *session = None;
        let client = self.open().await?;
        *session = Some(client.clone());
        Ok(client)
    }

    /// Drops session `id` after a request found it ended, so that the next request opens
    /// another.
    pub(crate) async fn forget(&self, id: zk::SessionId) {
        let mut session = self.inner.session.lock().await;
        if session
            .as_ref()
            .is_some_and(|client| client.session_id() == id)
        {
            tracing::info!(ensemble = %self.inner.described, session = %id, "the ZooKeeper session ended: opening another on the next request");
            *session = None;
        }
    }

    /// Maps `err` from a request on session `client`, dropping the session when `err` ended it.
    pub(crate) async fn fail(
        &self,
        client: &zk::Client,
        context: &str,
        err: zk::Error,
    ) -> LockError {
        if ends_session(&err) {
            self.forget(client.session_id()).await;
        }
        self.map(context, err)
    }

    /// Maps `err` on `context`, saying of a refused authentication what this store sent.
    pub(crate) fn map(&self, context: &str, err: zk::Error) -> LockError {
        match err {
            zk::Error::AuthFailed => auth_failed(context, self.inner.digest.is_some()),
            err => map(context, err),
        }
    }

    /// How long the client waits for a word from its server on a session the ensemble granted
    /// `granted` for, as the client derives it (its `reset_timeout`): the connection timeout
    /// the store asked for, or 2/5 of the granted session when that is more than 3/5 of it.
    pub(crate) fn connection_timeout_for(&self, granted: Duration) -> Duration {
        let asked = self.asked_connection_timeout();
        if asked.is_zero() || asked > granted * 3 / 5 {
            granted * 2 / 5
        } else {
            asked
        }
    }

    /// The connection timeout the store asks the client for.
    fn asked_connection_timeout(&self) -> Duration {
        let inner = &self.inner;
        inner.connection_timeout.min(inner.session_timeout * 2 / 5)
    }

    /// Opens a session, all of it (connecting, finding the chroot, making the prefix, the
    /// version check) within the connect timeout.
    async fn open(&self) -> Result<zk::Client, LockError> {
        let inner = &self.inner;
        match tokio::time::timeout(inner.connect_timeout, self.open_session()).await {
            Ok(opened) => opened,
            Err(_) => Err(LockError::unavailable(
                BACKEND,
                Context::new(
                    &inner.described,
                    &format!("no session within {:?}", inner.connect_timeout),
                ),
            )),
        }
    }

    /// Creates the prefix when it is missing, and returns its stat. An existing prefix is used
    /// as it is: creating it again would need the right to create under its parent, which an
    /// operator who made it may not have given. (Errors are mapped without dropping the
    /// session: opening one calls this while holding the session's slot.)
    /// The caller syncs first ([`sync`](Self::sync)).
    pub(crate) async fn ensure_prefix(&self, client: &zk::Client) -> Result<zk::Stat, LockError> {
        let inner = &self.inner;
        let prefix = format!("{} {}", inner.described, inner.prefix);
        match client.check_stat(&inner.prefix).await {
            Ok(Some(stat)) => return Ok(stat),
            Ok(None) => {}
            Err(err) => return Err(self.map(&prefix, err)),
        }
        let options = zk::CreateMode::Persistent.with_acls(self.acls());
        match client.mkdir(&inner.prefix, &options).await {
            Ok(()) => {}
            Err(zk::Error::NoNode) => return Err(self.missing_chroot()),
            Err(err) => return Err(self.map(&prefix, err)),
        }
        match client.check_stat(&inner.prefix).await {
            Ok(Some(stat)) => Ok(stat),
            // Deleted again at once: whoever creates an election under it next finds out.
            Ok(None) => Err(LockError::conflict(BACKEND)),
            Err(err) => Err(self.map(&prefix, err)),
        }
    }

    /// Brings the server `client` reads from up to date with the ensemble's leader, before a
    /// check whose answer is acted on as final: a server may not yet have applied a change
    /// another session already saw answered. Without it a chroot an operator had just made
    /// would read as missing and refuse the store, and a prefix just deleted would read as
    /// there, failing the creation under it as if another had won the election.
    pub(crate) async fn sync(&self, client: &zk::Client) -> Result<(), LockError> {
        client
            .sync("/")
            .await
            .map_err(|err| self.map(&self.inner.described, err))
    }

    fn missing_chroot(&self) -> LockError {
        LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{}: the chroot does not exist; create it (zkCli.sh create {}) or fix the URL's path",
                self.inner.described, self.inner.chroot
            ),
        }
    }

    async fn open_session(&self) -> Result<zk::Client, LockError> {
        let inner = &self.inner;
        let mut connector = zk::Client::connector()
            .with_session_timeout(inner.session_timeout)
            .with_connection_timeout(self.asked_connection_timeout())
            .with_fail_eagerly();
        if let Some((user, password)) = &inner.digest {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        let client = match connector.connect(&inner.connect).await {
            Ok(client) => client,
            Err(err) => {
                return Err(match err {
                    zk::Error::AuthFailed => self.map(&inner.described, err),
                    zk::Error::BadArguments(_) => LockError::Misconfigured {
                        backend: BACKEND,
                        message: format!("{}: {err}", inner.described),
                    },
                    err => LockError::unavailable(
                        BACKEND,
                        Context::new(&inner.described, &format!("no session: {err}")),
                    ),
                });
            }
        };
        // The chroot is the operator's: the client does not create it, and every path under a
        // missing one is missing.
        self.sync(&client).await?;
        match client.check_stat("/").await {
            Ok(Some(_)) => {}
            Ok(None) => return Err(self.missing_chroot()),
            Err(err) => return Err(self.map(&inner.described, err)),
        }
        self.ensure_prefix(&client).await?;
        let prefix = format!("{} {}", inner.described, inner.prefix);
        // The locks read with `multiRead` and watch with `addWatch`, both of ZooKeeper 3.6: an
        // older ensemble is refused here, in one line, instead of failing every read.
        let mut reader = client.new_multi_reader();
        reader
            .add_get_data(&inner.prefix)
            .map_err(|err| self.map(&prefix, err))?;
        let read = reader.commit().await;
        match read.as_deref() {
            Err(zk::Error::Unimplemented) => {
                return Err(LockError::Misconfigured {
                    backend: BACKEND,
                    message: format!(
                        "{}: the ensemble does not know multiRead: the lock needs ZooKeeper 3.6 or later",
                        inner.described
                    ),
                });
            }
            Err(err) => return Err(self.map(&prefix, err.clone())),
            Ok([zk::MultiReadResult::Error { err }]) => return Err(self.map(&prefix, err.clone())),
            Ok(_) => {}
        }
        tracing::debug!(
            ensemble = %inner.described,
            session = %client.session_id(),
            timeout = ?client.session_timeout(),
            "ZooKeeper session open"
        );
        Ok(client)
    }
}
