//! The server and its lock table: a connection pool shared by every lock made from it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use leader_core::backend::is_read_only;
use leader_core::{Acquisition, LockError, Observed, ResourceLock, redact_url};
use mysql_async::prelude::Queryable;
use mysql_async::{ClientIdentity, Conn, Opts, OptsBuilder, Pool};

use crate::error::{BACKEND, map};
use crate::sql::{NamedStatements, Statements, TableName};

/// The default lock table.
pub const DEFAULT_TABLE: &str = "leader_election";

/// Builds a [`MysqlStore`].
#[must_use]
pub struct MysqlStoreBuilder {
    url: String,
    table: String,
    create_table: bool,
    max_connections: usize,
    ssl_ca: Option<PathBuf>,
    ssl_identity: Option<(PathBuf, PathBuf)>,
}

impl fmt::Debug for MysqlStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlStoreBuilder")
            .field("url", &redact_url(&self.url))
            .field("table", &self.table)
            .field("create_table", &self.create_table)
            .field("max_connections", &self.max_connections)
            .field("ssl_ca", &self.ssl_ca)
            .field("ssl_identity", &self.ssl_identity)
            .finish()
    }
}

impl MysqlStoreBuilder {
    /// The lock table: `table`, or `database.table` for a table outside the URL's database
    /// (default [`DEFAULT_TABLE`]).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Creates the table at build time when it is missing (needs the CREATE privilege).
    pub fn create_table(mut self, create: bool) -> Self {
        self.create_table = create;
        self
    }

    /// The pool's size, unless the URL sets `pool_max` (default 4).
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// Trusts the root certificates in `path` (PEM, one or more; the URL's `ssl_ca=PATH`), and
    /// only those unless the URL says `built_in_roots=true`: for a server whose certificate a
    /// private CA signed (a self-hosted server, AWS RDS with its CA bundle). Turns TLS on
    /// (`require_ssl=true`); the URL's host must be a name (an address) the server's certificate
    /// carries.
    pub fn ssl_ca(mut self, path: impl Into<PathBuf>) -> Self {
        self.ssl_ca = Some(path.into());
        self
    }

    /// Presents the client certificate (chain) in `cert` with its private key in `key` (PEM;
    /// the URL's `ssl_cert=PATH&ssl_key=PATH`), for a user created `REQUIRE X509` or
    /// `REQUIRE SUBJECT ...`. Turns TLS on (`require_ssl=true`).
    pub fn ssl_client_identity(
        mut self,
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.ssl_identity = Some((cert.into(), key.into()));
        self
    }

    /// Makes the store (the pool connects lazily: on first use) and, if asked, creates the table.
    ///
    /// # Errors
    /// An invalid URL or table name, or a TLS file ([`ssl_ca`](Self::ssl_ca),
    /// [`ssl_client_identity`](Self::ssl_client_identity)) that cannot be read or holds no
    /// certificate or key ([`LockError::Misconfigured`]); with
    /// [`create_table`](Self::create_table), what the server answered to it.
    pub async fn build(self) -> Result<MysqlStore, LockError> {
        let redacted = redact_url(&self.url);
        let invalid = |message: String| LockError::Misconfigured {
            backend: BACKEND,
            message: format!("invalid connection URL {redacted}: {message}"),
        };
        leader_core::backend::check_user_info(&self.url).map_err(|err| invalid(err.message))?;
        let mut url = url::Url::parse(&self.url).map_err(|err| invalid(err.to_string()))?;
        let tls = TlsFiles::take(&mut url, self.ssl_ca, self.ssl_identity).map_err(invalid)?;
        let given: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        let value = |key: &str| {
            given
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        if let Some(tls) = &tls {
            tls.check().map_err(|message| LockError::Misconfigured {
                backend: BACKEND,
                message: format!("{redacted}: {message}"),
            })?;
            if value("require_ssl").is_some_and(|v| v != "true") {
                return Err(invalid(format!(
                    "{} turns TLS on: leave out require_ssl=false",
                    tls.given()
                )));
            }
        }
        {
            let mut query = url.query_pairs_mut();
            if tls.is_some() && value("require_ssl").is_none() {
                query.append_pair("require_ssl", "true");
            }
            // A private CA is trusted alone, as MySQL's own client trusts its --ssl-ca.
            if tls.as_ref().is_some_and(|tls| tls.ca.is_some()) && value("built_in_roots").is_none()
            {
                query.append_pair("built_in_roots", "false");
            }
            // A TCP address is what is meant: the driver would otherwise switch to the server's
            // Unix socket when it finds one, past any proxy or network path the URL names.
            if value("prefer_socket").is_none() {
                query.append_pair("prefer_socket", "false");
            }
            // Each bound on its own: the driver's own minimum (10) is above a small maximum.
            if value("pool_min").is_none() {
                query.append_pair("pool_min", "0");
            }
            if value("pool_max").is_none() {
                query.append_pair("pool_max", &self.max_connections.to_string());
            }
            // Idle connections are kept for a minute: the driver's default (0) closes every
            // connection above the pool's minimum as soon as it is returned, so each request
            // would open a new one.
            if value("inactive_connection_ttl").is_none() {
                query.append_pair("inactive_connection_ttl", "60");
            }
        }
        if url.scheme() == "mariadb" {
            url.set_scheme("mysql")
                .map_err(|()| invalid("cannot read the scheme".into()))?;
        }
        let opts = Opts::from_url(url.as_str()).map_err(|err| invalid(err.to_string()))?;
        // A connection that another user of the pool returns is reset before the pool hands it
        // out again: its session may have moved its clock (`SET timestamp` moves the
        // `UTC_TIMESTAMP()` the locks judge leases by), or kept a transaction open. The locks
        // skip the reset on their own connections ([`MysqlStore::conn`]).
        if !opts.pool_opts().reset_connection() {
            return Err(invalid(
                "reset_connection=false: the pool would hand the lock connections whose session another user changed (a session's SET timestamp moves the clock the lock judges leases by); the lock already skips the reset on its own connections".into(),
            ));
        }
        // The URL's TLS settings (verify_ca, verify_identity, built_in_roots) with the files.
        let ssl = tls.map(|tls| tls.apply(opts.ssl_opts().cloned().unwrap_or_default()));
        // Autocommit on, on every connection the pool opens or resets, whatever the server's or
        // the user's default (`autocommit = 0`, an `init_connect` that sets it): a lock's write
        // left uncommitted would be no write at all. The URL's own setup runs first.
        let mut setup = opts.setup().to_vec();
        setup.push("SET autocommit = 1".to_owned());
        let mut opts = OptsBuilder::from_opts(opts)
            .setup(setup)
            .tcp_keepalive(Some(Duration::from_secs(10)));
        if ssl.is_some() {
            opts = opts.ssl_opts(ssl);
        }
        let table = TableName::parse(&self.table)?;
        let opts = Opts::from(opts);
        let statements = Statements::new(&table);
        let store = MysqlStore {
            inner: Arc::new(Inner {
                pool: Pool::new(opts.clone()),
                database: table
                    .database
                    .clone()
                    .or_else(|| opts.db_name().map(str::to_owned))
                    .unwrap_or_default(),
                opts,
                redacted,
                named_statements: NamedStatements::new(&table, &statements),
                statements,
                table,
                durable: leader_core::backend::SettingsCheck::default(),
            }),
        };
        if self.create_table {
            store.create_table().await?;
        }
        Ok(store)
    }
}

/// The TLS files a store was given, by its builder or by its URL (`ssl_ca`, `ssl_cert`,
/// `ssl_key`, named as MySQL's client options), which the driver does not know.
struct TlsFiles {
    ca: Option<PathBuf>,
    identity: Option<(PathBuf, PathBuf)>,
}

impl TlsFiles {
    /// Takes the TLS parameters out of `url`; the builder's own settings win over them. `None`
    /// when there are none. The other parameters stay, written again in their order
    /// (form-encoded, as the driver reads them back).
    fn take(
        url: &mut url::Url,
        ca: Option<PathBuf>,
        identity: Option<(PathBuf, PathBuf)>,
    ) -> Result<Option<Self>, String> {
        let (mut url_ca, mut cert, mut key) = (None, None, None);
        leader_core::backend::take_lock_params(url, |k, v| {
            let slot = match k {
                "ssl_ca" => &mut url_ca,
                "ssl_cert" => &mut cert,
                "ssl_key" => &mut key,
                _ => return Ok(false),
            };
            if v.is_empty() {
                return Err(format!("{k}= is empty: the path of a PEM file"));
            }
            *slot = Some(PathBuf::from(v));
            Ok(true)
        })?;
        if url_ca.is_none() && cert.is_none() && key.is_none() {
            return Ok((ca.is_some() || identity.is_some()).then_some(Self { ca, identity }));
        }
        let url_identity = match (cert, key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            (Some(_), None) => return Err("ssl_cert without ssl_key: give both".to_owned()),
            (None, Some(_)) => return Err("ssl_key without ssl_cert: give both".to_owned()),
        };
        Ok(Some(Self {
            ca: ca.or(url_ca),
            identity: identity.or(url_identity),
        }))
    }

    /// What turned TLS on, for messages.
    fn given(&self) -> &'static str {
        if self.ca.is_some() {
            "ssl_ca"
        } else {
            "ssl_cert"
        }
    }

    /// Reads each file now, so that a wrong path is found when the store is built rather than
    /// at every connection attempt: it must be readable and hold a PEM certificate (a key).
    fn check(&self) -> Result<(), String> {
        if let Some(ca) = &self.ca {
            check_pem(ca, "ssl_ca", "CERTIFICATE-----")?;
        }
        if let Some((cert, key)) = &self.identity {
            check_pem(cert, "ssl_cert", "CERTIFICATE-----")?;
            check_pem(key, "ssl_key", "PRIVATE KEY-----")?;
        }
        Ok(())
    }

    /// The driver's TLS options with these files; the driver reads them (by path, so that no
    /// key is kept in memory that a `Debug` of the options could print) when it first connects.
    fn apply(self, mut ssl: mysql_async::SslOpts) -> mysql_async::SslOpts {
        if let Some(ca) = self.ca {
            ssl = ssl.with_root_certs(vec![ca.into()]);
        }
        if let Some((cert, key)) = self.identity {
            ssl = ssl.with_client_identity(Some(ClientIdentity::new(cert.into(), key.into())));
        }
        ssl
    }
}

/// Checks that `path` can be read and holds a PEM block ending in `marker` (DER, binary, is
/// taken as it is).
fn check_pem(path: &Path, what: &str, marker: &str) -> Result<(), String> {
    let data = std::fs::read(path)
        .map_err(|err| format!("{what} file {}: cannot read it: {err}", path.display()))?;
    let text = std::str::from_utf8(&data).ok();
    if data.is_empty() || text.is_some_and(|text| !text.contains(marker)) {
        return Err(format!(
            "{what} file {}: no PEM {} in it",
            path.display(),
            marker.trim_end_matches('-').to_lowercase()
        ));
    }
    Ok(())
}

/// A MySQL or MariaDB server holding a lock table: make [`TableLock`](crate::TableLock)s and
/// shard sets from it.
///
/// Cheap to clone; all locks made from one store share its pool.
#[derive(Clone)]
pub struct MysqlStore {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: Pool,
    /// The pool's options, for connections kept outside it.
    pub(crate) opts: Opts,
    /// The lock table's database (the URL's, unless the table names one); empty if neither does.
    pub(crate) database: String,
    pub(crate) redacted: String,
    pub(crate) table: TableName,
    pub(crate) statements: Statements,
    pub(crate) named_statements: NamedStatements,
    /// [`check_durability`](MysqlStore::check_durability), which stands for a second.
    durable: leader_core::backend::SettingsCheck,
}

impl fmt::Debug for MysqlStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlStore")
            .field("url", &self.inner.redacted)
            .field("table", &self.inner.table.display())
            .finish_non_exhaustive()
    }
}

impl MysqlStore {
    /// A builder for the server at `url`: `mysql://user:password@host:3306/database` (or
    /// `mariadb://`), with the driver's own parameters (`require_ssl=true`, `pool_max=8`, ...) and
    /// the TLS files `ssl_ca`, `ssl_cert` and `ssl_key` (as [`MysqlStoreBuilder::ssl_ca`] and
    /// [`MysqlStoreBuilder::ssl_client_identity`]).
    pub fn builder(url: impl Into<String>) -> MysqlStoreBuilder {
        MysqlStoreBuilder {
            url: url.into(),
            table: DEFAULT_TABLE.to_owned(),
            create_table: false,
            max_connections: 4,
            ssl_ca: None,
            ssl_identity: None,
        }
    }

    /// A store for the server at `url` with the default table and settings.
    ///
    /// # Errors
    /// As [`MysqlStoreBuilder::build`].
    pub async fn connect(url: impl Into<String>) -> Result<Self, LockError> {
        Self::builder(url).build().await
    }

    /// Creates the lock table if it does not exist (`CREATE TABLE IF NOT EXISTS`; needs the
    /// CREATE privilege).
    ///
    /// # Errors
    /// The server could not be reached, or refused.
    pub async fn create_table(&self) -> Result<(), LockError> {
        let mut conn = self.conn().await?;
        let created = conn.query_drop(&self.inner.statements.create_table).await;
        self.answered(conn, created, &self.context()).await
    }

    /// The connection pool. Its connections run with autocommit on, whatever the server's
    /// default, as the locks need; a user of the pool who turns it off, or opens a
    /// transaction, commits or rolls back before returning the connection.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The connection URL with the password redacted.
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

    /// S15: refuses a server on which a crash can undo a commit it acknowledged:
    /// `innodb_flush_log_at_trx_commit` 0 (the log is written and flushed about once a second)
    /// or 2 (written at each commit, flushed once a second: an operating system's crash or a
    /// power loss undoes up to a second). A take-over lost so would leave the row at the expired
    /// record it replaced, and the next candidate would take it with the same fencing token
    /// while the first leads on. A Galera node passes: a commit is on the other nodes before
    /// it is acknowledged, and one node's crash undoes none.
    ///
    /// Checked before an elector runs and again at each term's start ([`term_started`](
    /// Self::term_started)), since `SET GLOBAL` changes it under a running lock; a check that
    /// passed stands for a second, so a shard set's member that takes many shards at once asks
    /// once.
    pub(crate) async fn check_durability(&self) -> Result<(), LockError> {
        self.inner.durable.run(self.read_durability()).await
    }

    /// [`check_durability`](Self::check_durability)'s reading, every time.
    async fn read_durability(&self) -> Result<(), LockError> {
        let context = self.context();
        let mut conn = self.conn().await?;
        // `SHOW` answers only the variables the server has (a `SELECT @@` of another would fail).
        let rows = conn
            .query(
                "SHOW GLOBAL VARIABLES WHERE Variable_name IN \
                 ('innodb_flush_log_at_trx_commit', 'wsrep_on')",
            )
            .await;
        let rows: Vec<(String, String)> = self.answered(conn, rows, &context).await?;
        let value = |name: &str| {
            rows.iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        refuse_undoable_commits(
            &context,
            value("innodb_flush_log_at_trx_commit"),
            value("wsrep_on"),
        )
    }

    /// At a term's start (`lock` just took `taken`): checks the durability of commits again
    /// (S15). When a crash can undo them now, the lease is released at once and the term never
    /// starts; an outage leaves the term to go on, and the next one checks.
    pub(crate) async fn term_started(
        &self,
        lock: &dyn ResourceLock,
        taken: Observed,
    ) -> Result<Observed, LockError> {
        let checked = self.check_durability().await;
        leader_core::backend::refuse_at_term_start(lock, &taken, checked).await?;
        Ok(taken)
    }

    /// [`term_started`](Self::term_started) for an acquisition `lock` made in one request.
    pub(crate) async fn acquired(
        &self,
        lock: &dyn ResourceLock,
        taken: Observed,
    ) -> Result<Option<Acquisition>, LockError> {
        let taken = self.term_started(lock, taken).await?;
        Ok(Some(Acquisition::Acquired(taken)))
    }

    /// Settles a statement run on pooled `conn`: what it returned, once
    /// [`committed`](Self::committed), or its error, mapped. A connection the server answered as read-only
    /// (a replica, a writer that a failover demoted, reached through a name that still leads
    /// there) is closed instead of going back to the pool, so that the next request connects
    /// again, and the name may lead elsewhere by then.
    pub(crate) async fn answered<T>(
        &self,
        conn: Conn,
        result: Result<T, mysql_async::Error>,
        context: &str,
    ) -> Result<T, LockError> {
        match result {
            Ok(value) => {
                self.committed(conn).await?;
                Ok(value)
            }
            Err(err) => {
                let err = map(context, err);
                if is_read_only(&err) {
                    tokio::spawn(async move {
                        let _ = conn.disconnect().await;
                    });
                }
                Err(err)
            }
        }
    }

    /// Returns `conn` to the pool when its last statement left it outside any transaction, with
    /// autocommit on, as the locks need: otherwise (another user of [`pool`](Self::pool)
    /// returned it in a transaction with its reset turned off) what the statement wrote is not
    /// committed, so it fails, and closes the connection, which rolls that transaction back.
    async fn committed(&self, conn: Conn) -> Result<(), LockError> {
        use mysql_async::consts::StatusFlags;
        let flags = conn.last_ok_packet().map(|ok| ok.status_flags());
        let open = flags.is_some_and(|flags| {
            flags.contains(StatusFlags::SERVER_STATUS_IN_TRANS)
                || !flags.contains(StatusFlags::SERVER_STATUS_AUTOCOMMIT)
        });
        if !open {
            return Ok(());
        }
        let _ = conn.disconnect().await;
        Err(LockError::other(
            BACKEND,
            format!(
                "{}: a pooled connection was inside a transaction or had autocommit off, so the statement was not committed, and the connection is closed: another user of MysqlStore::pool left it so (commit or roll back before returning a connection, and leave autocommit on)",
                self.context()
            ),
        ))
    }

    /// A connection of its own, outside the pool: a session that keeps what it holds (a
    /// user-level lock) for as long as it lives.
    pub(crate) async fn dedicated(&self) -> Result<Conn, LockError> {
        Conn::new(self.inner.opts.clone())
            .await
            .map_err(|err| map(&self.context(), err))
    }

    /// A pooled connection; its prepared statements are cached on it. It comes back to the
    /// pool without a reset, which would cost a round trip and those statements: the locks
    /// change nothing in a session. A connection any other user of the pool returns is reset
    /// (the pool's default, which [`MysqlStoreBuilder::build`] keeps), so the lock never gets a
    /// session whose clock was moved with `SET timestamp`.
    pub(crate) async fn conn(&self) -> Result<Conn, LockError> {
        let mut conn = self
            .inner
            .pool
            .get_conn()
            .await
            .map_err(|err| map(&self.context(), err))?;
        conn.reset_connection(false);
        Ok(conn)
    }
}

#[cfg(test)]
mod tests {
    use mysql_async::SslOpts;

    use super::*;

    async fn ssl_opts(builder: MysqlStoreBuilder) -> Option<SslOpts> {
        let store = builder.build().await.expect("store");
        store.inner().opts.ssl_opts().cloned()
    }

    #[tokio::test]
    async fn the_tls_files_reach_the_driver_with_the_urls_settings() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let pem = "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n";
        let (a, b) = (dir.path().join("a.pem"), dir.path().join("b.pem"));
        std::fs::write(&a, pem).expect("write");
        std::fs::write(&b, pem).expect("write");
        let key = dir.path().join("key.pem");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n",
        )
        .expect("write");
        let base = "mysql://app:secret@127.0.0.1:1/app";
        let trusting = |ca: &PathBuf| SslOpts::default().with_root_certs(vec![ca.clone().into()]);

        assert_eq!(ssl_opts(MysqlStore::builder(base)).await, None);
        // ssl_ca turns TLS on, trusts that CA alone (by path) and checks the server's name.
        assert_eq!(
            ssl_opts(MysqlStore::builder(format!(
                "{base}?ssl_ca={}",
                a.display()
            )))
            .await,
            Some(trusting(&a).with_disable_built_in_roots(true))
        );
        // The driver's own TLS parameters still apply.
        assert_eq!(
            ssl_opts(MysqlStore::builder(format!(
                "{base}?ssl_ca={}&built_in_roots=true&verify_identity=false&require_ssl=true",
                a.display()
            )))
            .await,
            Some(trusting(&a).with_danger_skip_domain_validation(true))
        );
        // The builder's paths win over the URL's.
        assert_eq!(
            ssl_opts(
                MysqlStore::builder(format!("{base}?ssl_ca={}", a.display()))
                    .ssl_ca(&b)
                    .ssl_client_identity(&a, &key),
            )
            .await,
            Some(
                trusting(&b)
                    .with_disable_built_in_roots(true)
                    .with_client_identity(Some(ClientIdentity::new(
                        a.clone().into(),
                        key.clone().into()
                    )))
            )
        );
        // A client certificate alone turns TLS on, with the built-in roots.
        assert_eq!(
            ssl_opts(MysqlStore::builder(format!(
                "{base}?ssl_cert={}&ssl_key={}",
                a.display(),
                key.display()
            )))
            .await,
            Some(
                SslOpts::default().with_client_identity(Some(ClientIdentity::new(
                    a.clone().into(),
                    key.clone().into()
                )))
            )
        );
    }
}

/// [`LockError::Misconfigured`] when `innodb_flush_log_at_trx_commit`, as `SHOW VARIABLES`
/// answers it (`None`: a server without it), lets a crash undo acknowledged commits: 0 or 2,
/// unless Galera replication is on (`wsrep_on`). 1 flushes at each commit, as does MariaDB's 3.
fn refuse_undoable_commits(
    context: &str,
    flush: Option<&str>,
    wsrep_on: Option<&str>,
) -> Result<(), LockError> {
    let galera = wsrep_on.is_some_and(|on| on.eq_ignore_ascii_case("ON") || on == "1");
    match flush {
        Some(value @ ("0" | "2")) if !galera => Err(LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: innodb_flush_log_at_trx_commit = {value}, so a crash can undo a commit the server acknowledged, and a lease taken over could be taken again with the same fencing token: set it to 1"
            ),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod durability_tests {
    use super::refuse_undoable_commits;

    #[test]
    fn commits_a_crash_can_undo_are_refused() {
        for value in ["0", "2"] {
            for wsrep_on in [None, Some("OFF")] {
                let err =
                    refuse_undoable_commits("ctx", Some(value), wsrep_on).expect_err("undoable");
                assert_eq!(err.kind(), "misconfigured", "{err}");
                assert!(
                    err.to_string()
                        .contains(&format!("innodb_flush_log_at_trx_commit = {value}")),
                    "{err}"
                );
            }
            // A Galera node: the other nodes hold the commit.
            assert!(refuse_undoable_commits("ctx", Some(value), Some("ON")).is_ok());
        }
        for value in [Some("1"), Some("3"), None] {
            assert!(
                refuse_undoable_commits("ctx", value, None).is_ok(),
                "{value:?}"
            );
        }
    }
}
