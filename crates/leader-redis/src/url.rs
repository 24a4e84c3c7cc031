//! `redis://` and `rediss://` lock URLs: the connection string as the driver takes it, plus the
//! lock's key prefix.

use leader_core::{
    LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait, redact_url,
};

use crate::store::{RedisStore, RedisStoreBuilder};

/// A Redis lock URL: `redis://user:pass@host:6379/0?prefix=P` (or `rediss://` for TLS). `prefix`
/// sets the lock's key prefix and `protocol` (`resp2`, `resp3`) goes to the driver; the database
/// is the path. Any other parameter is refused: the driver would ignore it, and a `?db=2` or a
/// mistyped `?prefx=` would put the election where another one is.
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    connection: String,
    prefix: Option<String>,
}

impl std::fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl LockUrl {
    /// Parses a `redis://` or `rediss://` URL.
    ///
    /// # Errors
    /// A malformed URL, another scheme, or a parameter other than `prefix` and `protocol`.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let mut url =
            leader_core::backend::parse_lock_url(lock, &["redis", "rediss"], "not a redis:// URL")?;
        let mut prefix = None;
        leader_core::backend::take_lock_params(&mut url, |key, value| {
            match key {
                "prefix" => prefix = Some(value.to_owned()),
                // The only parameter the driver reads from a redis:// or rediss:// URL.
                "protocol" => return Ok(false),
                "db" => {
                    return Err(UrlError::new(
                        lock,
                        "unknown parameter \"db\": the database is the path (redis://host:6379/2)",
                    ));
                }
                other => {
                    return Err(UrlError::new(
                        lock,
                        format!("unknown parameter {other:?} (known: prefix, protocol)"),
                    ));
                }
            }
            Ok(true)
        })?;
        Ok(Self {
            connection: url.into(),
            prefix,
        })
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

    /// A store builder with the URL's connection and prefix.
    pub fn store(&self) -> RedisStoreBuilder {
        let builder = RedisStore::builder(self.connection.clone());
        match &self.prefix {
            Some(prefix) => builder.prefix(prefix),
            None => builder,
        }
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        redact_url(&self.connection)
    }

    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        Ok(Box::new(self.store().build().await?.lock(name, identity)))
    }

    /// A key per record, on one connection.
    async fn open_set(&self, _name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        Ok(Box::new(self.store().build().await?.lock_set(identity)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_is_taken_out() {
        let url = LockUrl::parse("rediss://:pw@cache:6380/2?prefix=app:").expect("valid");
        assert_eq!(url.connection(), "rediss://:pw@cache:6380/2");
        assert_eq!(url.prefix.as_deref(), Some("app:"));
        assert_eq!(url.describe(), "rediss://:***@cache:6380/2");
        let url = LockUrl::parse("redis://cache/1?protocol=resp3&prefix=p:").expect("valid");
        assert_eq!(url.connection(), "redis://cache/1?protocol=resp3");
    }

    /// A parameter the driver would ignore is refused, with the password still hidden.
    #[test]
    fn parameters_nobody_reads_are_refused() {
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                ("redis://:secret@cache?db=2", "the database is the path"),
                (
                    "redis://:secret@cache/0?prefx=app:",
                    "unknown parameter \"prefx\"",
                ),
                (
                    "rediss://:secret@cache?timeout=5",
                    "known: prefix, protocol",
                ),
            ],
        );
    }
}
