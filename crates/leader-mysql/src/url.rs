//! `mysql://` and `mariadb://` lock URLs: the connection URL as the driver takes it, plus the
//! lock's own parameter.

use leader_core::{
    LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait, redact_url,
};

use crate::store::{MysqlStore, MysqlStoreBuilder};

/// A MySQL or MariaDB lock URL: `mysql://user:pass@host:3306/database?table=T&lock=named` (or
/// `mariadb://`). `table` picks the lock table (`table` or `database.table`), `lock` the lock:
/// `table` (the default, [`TableLock`](crate::TableLock)) or `named` (the `GET_LOCK` lock,
/// [`NamedLock`](crate::NamedLock), with `idle_session_timeout=30s` for its session).
/// `ssl_ca=PATH` (a PEM file of root certificates: a private CA, AWS RDS's bundle),
/// `ssl_cert=PATH` and `ssl_key=PATH` (a client certificate and its key), named as MySQL's
/// client options, go to the store ([`MysqlStoreBuilder::ssl_ca`],
/// [`MysqlStoreBuilder::ssl_client_identity`]), which reads them when it is built and turns TLS
/// on. Every other parameter goes to the driver (`require_ssl`, `verify_identity`,
/// `built_in_roots`, `pool_max`, ...), which refuses those it does not know.
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    connection: String,
    table: Option<String>,
    named: bool,
    /// The `GET_LOCK` lock's idle session timeout (`idle_session_timeout`).
    idle: Option<std::time::Duration>,
}

impl std::fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl LockUrl {
    /// Parses a `mysql://` or `mariadb://` URL.
    ///
    /// # Errors
    /// A malformed URL, another scheme, or an empty table name.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: String| UrlError::new(lock, message);
        let mut url = leader_core::backend::parse_lock_url(
            lock,
            &["mysql", "mariadb"],
            "not a mysql:// URL",
        )?;
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid("no server host".to_owned()));
        }
        let mut table = None;
        let mut named = false;
        let mut idle = None;
        leader_core::backend::take_lock_params(&mut url, |key, value| {
            match key {
                "table" if value.is_empty() => {
                    return Err(invalid("table= is empty".to_owned()));
                }
                "table" => table = Some(value.to_owned()),
                "idle_session_timeout" => {
                    idle = Some(
                        humantime::parse_duration(value)
                            .ok()
                            .filter(|d| *d >= std::time::Duration::from_secs(1))
                            .ok_or_else(|| {
                                invalid(format!(
                                    "idle_session_timeout={value}: a duration of at least 1s, like 30s"
                                ))
                            })?,
                    );
                }
                "lock" => {
                    named = match value {
                        "table" => false,
                        "named" => true,
                        other => {
                            return Err(invalid(format!(
                                "lock={other:?} is not a lock of this backend (table or named)"
                            )));
                        }
                    };
                }
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        Ok(Self {
            connection: url.into(),
            table,
            named,
            idle,
        })
    }

    /// Whether the URL asks for the `GET_LOCK` lock (`lock=named`).
    pub fn named(&self) -> bool {
        self.named
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// The connection URL the store gets: the URL without the lock's own parameters (the
    /// store takes out `ssl_ca`, `ssl_cert` and `ssl_key` before the rest goes to the driver).
    pub fn connection(&self) -> &str {
        &self.connection
    }

    /// A store builder with the URL's connection and table.
    pub fn store(&self) -> MysqlStoreBuilder {
        let mut builder = MysqlStore::builder(self.connection.clone());
        if let Some(table) = &self.table {
            builder = builder.table(table);
        }
        builder
    }

    async fn build(&self) -> Result<MysqlStore, LockError> {
        let store = self.store().build().await?;
        if let Err(err) = store.create_table().await {
            tracing::debug!(error = %err, "could not create the lock table");
        }
        Ok(store)
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        redact_url(&self.connection)
    }

    /// Builds the store (its pool connects lazily), creates the lock table when it is missing
    /// and the user may (a user without that right finds out from the lock's own error if the
    /// table is really missing), and makes the table lock or the `GET_LOCK` lock. The
    /// `GET_LOCK` lock is refused on a Galera cluster (`wsrep_on=ON`) as
    /// [`LockError::Misconfigured`]; a server that cannot be asked yet is left to the lock.
    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        let store = self.build().await?;
        Ok(if self.named {
            let mut lock = store.named_lock(name, identity);
            if let Some(idle) = self.idle {
                lock = lock.idle_session_timeout(idle);
            }
            match lock.check_server().await {
                Err(err @ LockError::Misconfigured { .. }) => return Err(err),
                // Down, or not answering yet: the lock's own attempts report it, and a Galera
                // refusal then too.
                Err(err) => tracing::debug!(error = %err, "could not check the server"),
                Ok(()) => {}
            }
            Box::new(lock)
        } else {
            Box::new(store.lock(name, identity))
        })
    }

    /// A row per record in the lock table, on one pool. Not with `lock=named`: the `GET_LOCK`
    /// lock keeps a server session for each record it holds.
    async fn open_set(&self, _name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        if self.named {
            return Err(LockError::Misconfigured {
                backend: crate::error::BACKEND,
                message: "shard sets use the table lock: the GET_LOCK lock keeps a server \
                          session for each record it holds, one per shard (leave out lock=named)"
                    .to_owned(),
            });
        }
        Ok(Box::new(self.build().await?.lock_set(identity)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_locks_own_parameter_is_taken_out() {
        let url =
            LockUrl::parse("mysql://u:p@db:3306/app?table=locks&require_ssl=true").expect("valid");
        assert_eq!(url.connection(), "mysql://u:p@db:3306/app?require_ssl=true");
        assert_eq!(url.table.as_deref(), Some("locks"));
        assert_eq!(url.describe(), "mysql://u:***@db:3306/app?require_ssl=true");
        assert!(LockUrl::parse("mariadb://u@db/app").is_ok());
        assert!(!url.named());
    }

    #[test]
    fn the_tls_files_go_to_the_store() {
        let lock = "mysql://u:p@db/app?ssl_ca=/etc/ssl/rds.pem&table=locks&ssl_cert=/c.pem&ssl_key=/k.pem&verify_identity=true";
        let url = LockUrl::parse(lock).expect("valid");
        assert_eq!(
            url.connection(),
            "mysql://u:p@db/app?ssl_ca=%2Fetc%2Fssl%2Frds.pem&ssl_cert=%2Fc.pem&ssl_key=%2Fk.pem&verify_identity=true"
        );
        assert!(url.describe().contains("ssl_ca=%2Fetc%2Fssl%2Frds.pem"));
    }

    #[test]
    fn the_lock_parameter_picks_the_lock() {
        let url = LockUrl::parse("mysql://u:p@db/app?lock=named&pool_max=2").expect("valid");
        assert!(url.named());
        assert_eq!(url.connection(), "mysql://u:p@db/app?pool_max=2");
        let url =
            LockUrl::parse("mysql://u:p@db/app?lock=named&idle_session_timeout=5s").expect("valid");
        assert_eq!(url.idle, Some(std::time::Duration::from_secs(5)));
        assert_eq!(url.connection(), "mysql://u:p@db/app");
        let err = LockUrl::parse("mysql://u:secret@db/app?lock=named&idle_session_timeout=10ms")
            .expect_err("under a second")
            .to_string();
        assert!(
            err.contains("at least 1s") && !err.contains("secret"),
            "{err}"
        );
        let url = LockUrl::parse("mysql://u:p@db/app?lock=table").expect("valid");
        assert!(!url.named());
    }

    #[test]
    fn bad_urls_name_the_problem_without_the_password() {
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                ("mysql://u:secret@h/x?table=", "empty"),
                ("postgres://u:secret@h/x", "not a mysql:// URL"),
                ("mysql:///x", "no server host"),
                (
                    "mysql://u:secret@h/x?lock=advisory",
                    "not a lock of this backend",
                ),
            ],
        );
    }
}
