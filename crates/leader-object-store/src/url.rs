//! `s3://`, `gs://` and `az://` lock URLs: a bucket, a key prefix, and optionally the object.

use leader_core::backend::KeyedLocks;
use leader_core::{LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait};

use crate::store::{BucketStore, DEFAULT_PREFIX, check_url};

/// An object storage lock URL: `s3://BUCKET/PREFIX/`, `gs://BUCKET/PREFIX/` or
/// `az://CONTAINER/PREFIX/` (or `azure://`): the object `PREFIX/NAME`, or, for a path not ending
/// in `/`, the object the path names. Credentials, region and endpoint come from the environment
/// as `object_store` reads them; the URL holds none, and no parameters.
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    /// `scheme://bucket/prefix/`.
    store_url: String,
    object: Option<String>,
}

impl std::fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl LockUrl {
    /// Parses the URL, by the store's own rules ([`BucketStore::from_url`] checks the same).
    ///
    /// # Errors
    /// A malformed URL, another scheme, credentials or parameters in the URL, no bucket, or a
    /// store without conditional writes.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: String| UrlError::new(lock, message);
        let url = leader_core::backend::parse_lock_url(
            lock,
            &["s3", "gs", "az", "azure"],
            "not an object storage URL; use s3://, gs:// or az://",
        )?;
        let scheme = url.scheme();
        check_url(&url).map_err(invalid)?;
        let bucket = url.host_str().unwrap_or_default();
        let path = url.path().trim_start_matches('/');
        let (prefix, object) = match path.rsplit_once('/') {
            _ if path.is_empty() => (DEFAULT_PREFIX, None),
            Some((prefix, "")) => (&path[..prefix.len() + 1], None),
            Some((prefix, object)) => (&path[..prefix.len() + 1], Some(object)),
            None => ("", Some(path)),
        };
        Ok(Self {
            store_url: format!("{scheme}://{bucket}/{prefix}"),
            object: object.map(str::to_owned),
        })
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// The object the URL names itself, if its path does not end in `/`.
    pub fn object(&self) -> Option<&str> {
        self.object.as_deref()
    }

    /// The store the URL names, built from the environment (no request is made).
    ///
    /// # Errors
    /// As [`BucketStoreBuilder::build`](crate::BucketStoreBuilder::build).
    pub fn store(&self) -> Result<BucketStore, LockError> {
        // The URL's prefix as it is, also when empty: `s3://b/job` is the object `job`, not
        // the store's default prefix's `leader/job`.
        let prefix = self
            .store_url
            .splitn(4, '/')
            .nth(3)
            .unwrap_or(DEFAULT_PREFIX);
        BucketStore::from_url(&self.store_url)
            .prefix(prefix)
            .build()
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        format!(
            "{}{}",
            self.store_url,
            self.object.as_deref().unwrap_or_default()
        )
    }

    /// Checks once that the store keeps preconditions: a store that ignores them is refused
    /// here, before anything runs; one that cannot be reached now is checked again before the
    /// first write.
    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        let store = self.store()?;
        match store.check_conditional_writes().await {
            Err(err @ (LockError::Misconfigured { .. } | LockError::Forbidden { .. })) => {
                return Err(err);
            }
            Err(err) => {
                tracing::warn!(error = %err, "could not check the store's conditional writes yet");
            }
            Ok(()) => {}
        }
        let lock = match &self.object {
            Some(object) => store.lock(object, identity).with_election_name(name),
            None => store.lock(name, identity),
        };
        Ok(Box::new(lock))
    }

    /// An object per record under the URL's prefix; a URL naming one object has no room for
    /// a set.
    async fn open_set(&self, _name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        if let Some(object) = &self.object {
            return Err(LockError::Misconfigured {
                backend: "object storage",
                message: format!(
                    "{}: names the object {object}; a shard set needs a prefix (end the URL with /)",
                    self.describe()
                ),
            });
        }
        let store = self.store()?;
        store.check_conditional_writes().await?;
        Ok(Box::new(KeyedLocks::new(
            identity,
            self.describe(),
            move |key, identity| std::sync::Arc::new(store.lock(key, identity)),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_is_a_prefix_or_names_the_object() {
        for (url, store, object) in [
            ("s3://b/locks/", "s3://b/locks/", None),
            ("s3://b", "s3://b/leader/", None),
            ("gs://b/a/b/job", "gs://b/a/b/", Some("job")),
            ("az://c/job", "az://c/", Some("job")),
        ] {
            let parsed = LockUrl::parse(url).expect(url);
            assert_eq!(parsed.store_url, store, "{url}");
            assert_eq!(parsed.object(), object, "{url}");
        }
    }

    /// The object a URL names is the key its lock writes: `s3://b/job` is `job`, not the
    /// default prefix's `leader/job`, which a policy granting `b/job` would refuse.
    #[test]
    fn the_object_named_is_the_key_written() {
        crate::ensure_crypto_provider();
        for (url, key) in [
            ("s3://b/job", "job"),
            ("s3://b/a/b/job", "a/b/job"),
            ("s3://b/locks/", "locks/job"),
            ("s3://b", "leader/job"),
        ] {
            let parsed = LockUrl::parse(url).expect(url);
            let store = parsed.store().expect(url);
            let object = parsed.object().unwrap_or("job");
            assert_eq!(store.lock(object, "a").key(), key, "{url}");
        }
    }

    #[test]
    fn credentials_and_parameters_are_refused_without_being_shown() {
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                ("s3://AKID:secret@bucket/x/", "no credentials or options"),
                (
                    "s3://bucket/x/?aws_session_token=secret",
                    "no credentials or options",
                ),
                ("gs:///x/", "bucket"),
                ("file:///tmp/x", "s3://"),
            ],
        );
    }
}
