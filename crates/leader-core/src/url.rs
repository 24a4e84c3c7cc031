//! Locks named by URLs: each backend crate parses its own schemes into a [`LockTarget`], and the
//! `leader` facade maps a scheme to the crate that owns it.

use std::fmt;
use std::path::{Path, PathBuf};

use async_trait::async_trait;

use crate::error::LockError;
use crate::file::FileLock;
use crate::lock::ResourceLock;
use crate::redact::redact_url;
use crate::shards::{KeyedLocks, LockSet};

/// A lock URL as its backend parsed it: the store and the kind of lock, before anything
/// connects. Each backend crate's `LockUrl` implements it; the `leader` facade opens any of them.
#[async_trait]
pub trait LockTarget: fmt::Debug + Send + Sync {
    /// The lock for messages, before it is opened; never with credentials.
    fn describe(&self) -> String;

    /// Opens the lock for election `name` as candidate `identity`, connecting where the backend
    /// needs it. What it checks beyond that is the backend's to say; the facade's `open` reads
    /// the record once.
    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError>;

    /// Opens the records of shard set `name` as member `identity` (see
    /// [`Shards`](crate::Shards)): one connection shared by every record, and batched reads and
    /// renewals where the backend has them. The default says the backend has no shard sets.
    async fn open_set(&self, name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        let _ = (name, identity);
        Err(LockError::Misconfigured {
            backend: "lock",
            message: format!("{}: this backend keeps no shard sets", self.describe()),
        })
    }

    /// The lock directory, for a file lock (whose term lock the `leader` command hands to
    /// COMMAND); `None` for every other backend.
    fn file_path(&self) -> Option<&Path> {
        None
    }
}

/// Why a lock URL cannot be used: malformed, an unknown parameter or a bad value. The message
/// never contains credentials.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("lock URL {url}: {message}")]
pub struct UrlError {
    /// The URL, credentials removed.
    pub url: String,
    /// What is wrong with it.
    pub message: String,
}

impl UrlError {
    /// An error about `url` (redacted here), saying `message`.
    pub fn new(url: &str, message: impl Into<String>) -> Self {
        Self {
            url: redact_url(url),
            message: message.into(),
        }
    }
}

/// A `file:///PATH` URL: a [`FileLock`] on that directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileUrl {
    path: PathBuf,
}

impl FileUrl {
    /// Parses `file:///PATH`; the path must be absolute.
    ///
    /// # Errors
    /// Not a `file://` URL, or a relative path.
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let path = url
            .strip_prefix("file://")
            .filter(|p| p.starts_with('/') && p.len() > 1)
            .ok_or_else(|| {
                UrlError::new(
                    url,
                    "a file lock needs an absolute path, like file:///run/myapp/leader",
                )
            })?;
        Ok(Self { path: path.into() })
    }

    /// A file lock URL for the directory `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }
}

#[async_trait]
impl LockTarget for FileUrl {
    fn describe(&self) -> String {
        format!("file:{}", self.path.display())
    }

    async fn open(&self, _name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        Ok(Box::new(FileLock::new(&self.path, identity)))
    }

    /// A directory per record below the URL's directory, which is made for this user alone
    /// (or checked, as a lock directory is).
    async fn open_set(&self, _name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        crate::file::ensure_private_dir(&self.path)?;
        let dir = self.path.clone();
        Ok(Box::new(KeyedLocks::new(
            identity,
            self.describe(),
            move |key, identity| std::sync::Arc::new(FileLock::new(dir.join(key), identity)),
        )))
    }

    fn file_path(&self) -> Option<&Path> {
        Some(&self.path)
    }
}
