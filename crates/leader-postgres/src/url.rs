//! `postgres://` and `postgresql://` lock URLs: the connection string as the driver takes it,
//! plus the lock's own parameters.

use std::time::Duration;

use leader_core::{
    LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait, redact_url,
};

use crate::store::{PostgresStore, PostgresStoreBuilder};

/// A Postgres lock URL: `postgres://user:pass@host/db?table=T&schema=S&advisory=true&idle_session_timeout=30s`
/// (or `postgresql://`). `table` and `schema` pick the lock table, `advisory=true` the advisory
/// lock, `idle_session_timeout` (advisory only) how long the server keeps a silent session and
/// its advisory lock, and `listen=false` has followers read the record every retry period
/// instead of listening (behind a pooler in transaction mode:
/// [`PostgresStoreBuilder::listen`]); every other parameter goes to the driver (`sslmode`,
/// `connect_timeout`, ...).
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    connection: String,
    advisory: bool,
    schema: Option<String>,
    table: Option<String>,
    idle_session_timeout: Option<Duration>,
    listen: bool,
}

impl std::fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl LockUrl {
    /// Parses a `postgres://` or `postgresql://` URL.
    ///
    /// # Errors
    /// A malformed URL, another scheme, or a bad value of the lock's own parameters.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: String| UrlError::new(lock, message);
        let mut url = leader_core::backend::parse_lock_url(
            lock,
            &["postgres", "postgresql"],
            "not a postgres:// URL",
        )?;
        let mut parsed = Self {
            connection: String::new(),
            advisory: false,
            schema: None,
            table: None,
            idle_session_timeout: None,
            listen: true,
        };
        leader_core::backend::take_lock_params(&mut url, |key, value| {
            match key {
                "advisory" => parsed.advisory = parse_bool(key, value).map_err(invalid)?,
                "listen" => parsed.listen = parse_bool(key, value).map_err(invalid)?,
                "idle_session_timeout" => {
                    let timeout = humantime::parse_duration(value).map_err(|err| {
                        invalid(format!(
                            "idle_session_timeout={value:?} is not a duration like 30s: {err}"
                        ))
                    })?;
                    parsed.idle_session_timeout = Some(timeout);
                }
                "schema" => parsed.schema = Some(value.to_owned()),
                "table" => parsed.table = Some(value.to_owned()),
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        if parsed.idle_session_timeout.is_some() && !parsed.advisory {
            return Err(invalid(
                "idle_session_timeout applies to the advisory lock (advisory=true)".to_owned(),
            ));
        }
        parsed.connection = url.into();
        Ok(parsed)
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// The connection string the driver gets: the URL without the lock's own parameters.
    pub fn connection(&self) -> &str {
        &self.connection
    }

    /// Whether the URL asks for the advisory lock.
    pub fn advisory(&self) -> bool {
        self.advisory
    }

    /// A store builder with the URL's connection, schema and table.
    pub fn store(&self) -> PostgresStoreBuilder {
        let mut builder = PostgresStore::builder(self.connection.clone());
        if let Some(schema) = &self.schema {
            builder = builder.schema(schema);
        }
        if let Some(table) = &self.table {
            builder = builder.table(table);
        }
        builder.listen(self.listen)
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        redact_url(&self.connection)
    }

    /// Builds the store (its pool connects lazily), makes the lock table ready as
    /// [`PostgresStore::create_table`] does, and makes the table lock or the advisory lock.
    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        let store = self.prepared().await?;
        Ok(if self.advisory {
            let mut lock = store.advisory_lock(name, identity);
            if let Some(timeout) = self.idle_session_timeout {
                lock = lock.idle_session_timeout(timeout);
            }
            Box::new(lock)
        } else {
            Box::new(store.lock(name, identity))
        })
    }

    /// A row per record in the lock table, on one pool. Not on the advisory lock, which holds
    /// a session per lock: a set of thousands would hold thousands of connections.
    async fn open_set(&self, _name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        if self.advisory {
            return Err(LockError::Misconfigured {
                backend: "postgres",
                message: "shard sets use the table lock: the advisory lock holds a database \
                          session per lock, one per shard (leave out advisory=true)"
                    .into(),
            });
        }
        let store = self.prepared().await?;
        Ok(Box::new(store.lock_set(identity)))
    }
}

impl LockUrl {
    /// The store, with its table made ready where the role may: a role without the right to
    /// create or alter it finds out from the lock's own error whether the table is really
    /// missing or of the earlier version. A table that is not a lock table is refused here,
    /// untouched.
    async fn prepared(&self) -> Result<PostgresStore, LockError> {
        let store = self.store().build().await?;
        match store.create_table().await {
            Ok(()) => {}
            Err(err @ LockError::Misconfigured { .. }) => return Err(err),
            Err(err) => tracing::debug!(error = %err, "could not create the lock table"),
        }
        Ok(store)
    }
}

fn parse_bool(key: &str, value: &str) -> Result<bool, String> {
    match value {
        "" | "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        other => Err(format!("{key}={other:?} is not a boolean (true or false)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_locks_own_parameters_are_taken_out() {
        let url = LockUrl::parse(
            "postgres://u:p@db/app?advisory=true&sslmode=require&table=locks&idle_session_timeout=5s",
        )
        .expect("valid");
        assert_eq!(url.connection(), "postgres://u:p@db/app?sslmode=require");
        assert!(url.advisory());
        assert_eq!(url.table.as_deref(), Some("locks"));
        assert_eq!(url.idle_session_timeout, Some(Duration::from_secs(5)));
        assert!(url.listen, "followers listen unless told not to");
        assert_eq!(url.describe(), "postgres://u:***@db/app?sslmode=require");
        let url = LockUrl::parse("postgres://u:p@bouncer:6432/app?listen=false").expect("valid");
        assert_eq!(url.connection(), "postgres://u:p@bouncer:6432/app");
        assert!(!url.listen);
        assert!(format!("{:?}", url.store()).contains("listen: false"));
    }

    #[test]
    fn bad_values_name_the_problem_without_the_password() {
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                (
                    "postgres://u:secret@h/x?advisory=maybe",
                    "advisory=\"maybe\" is not a boolean",
                ),
                (
                    "postgres://u:secret@h/x?listen=later",
                    "listen=\"later\" is not a boolean",
                ),
                (
                    "postgres://u:secret@h/x?advisory=true&idle_session_timeout=soon",
                    "not a duration",
                ),
                (
                    "postgres://u:secret@h/x?idle_session_timeout=5s",
                    "applies to the advisory lock",
                ),
            ],
        );
    }
}
