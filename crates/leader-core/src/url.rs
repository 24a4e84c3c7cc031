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

    /// The directory a file lock URL names (where a shard set's records live); `None` for
    /// every other backend.
    fn file_path(&self) -> Option<&Path> {
        None
    }

    /// The file lock for election `name` as candidate `identity`, for a file lock URL (whose
    /// term lock the `leader` command hands to COMMAND); `None` for every other backend.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    fn file_lock(&self, name: &str, identity: &str) -> Option<Result<FileLock, LockError>> {
        let _ = (name, identity);
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

    /// Refuses `url` when an `@` follows the end of its authority (the first `/`, `?` or `#`
    /// after `://`). A URL parser ends the user-info there, so such a URL holds one of those
    /// characters unencoded in its password (read as the host, port, path or parameters, and
    /// shown as them), or an `@` in its path or parameters, which cannot be told apart.
    ///
    /// # Errors
    /// Such a URL, with a message asking to percent-encode them.
    pub(crate) fn check_user_info(url: &str) -> Result<(), Self> {
        let Some(scheme_end) = url.find("://") else {
            return Ok(());
        };
        let rest = &url[scheme_end + 3..];
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if rest[authority_end..].contains('@') {
            return Err(Self::new(
                url,
                "an @ after a /, ? or #: percent-encode /, ?, # and @ in a password (%2F, %3F, \
                 %23, %40), and @ in a path or parameter (%40)",
            ));
        }
        Ok(())
    }
}

/// A `file:///PATH` URL: a [`FileLock`] per election in a directory of its name under `PATH`
/// (`PATH/NAME`, the name percent-encoded), as every other store keeps a record per name. A
/// `PATH` that holds one election of the earlier layout (version files of its own) is used as
/// it is, for every name, with a warning; see the crate's README on rolling upgrades.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileUrl {
    path: PathBuf,
    /// Whether `path` holds a directory per election (a URL), or is the election's (a path
    /// given as it is, [`FileUrl::new`]).
    per_name: bool,
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
        Ok(Self {
            path: path.into(),
            per_name: true,
        })
    }

    /// The file lock on the directory `path` itself, whatever the election's name: the lock
    /// directory of one election (as the `leader` command's default, `leader-NAME` in the
    /// runtime directory).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            per_name: false,
        }
    }

    /// The lock of election `name` for `identity`.
    fn lock(&self, name: &str, identity: &str) -> Result<FileLock, LockError> {
        let dir = if self.per_name {
            crate::file::election_dir(&self.path, name)?
        } else {
            self.path.clone()
        };
        Ok(FileLock::new(dir, identity).with_election_name(name))
    }
}

#[async_trait]
impl LockTarget for FileUrl {
    fn describe(&self) -> String {
        format!("file:{}", self.path.display())
    }

    /// The lock of election `name`: in its own directory under the URL's, or in the path
    /// given itself ([`FileUrl::new`]).
    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        Ok(Box::new(self.lock(name, identity)?))
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

    fn file_lock(&self, name: &str, identity: &str) -> Option<Result<FileLock, LockError>> {
        Some(self.lock(name, identity))
    }
}

#[cfg(test)]
mod tests {
    use super::UrlError;

    /// An `@` past the authority is refused, and the password is not shown.
    #[test]
    fn redact_and_refuse_a_password_holding_a_delimiter() {
        for url in [
            "mysql://u:se/cret@h/x",
            "postgres://u:se?cret@h/db",
            "redis://:se#cret@h:6379",
            "postgres://u:54321?secret@h/db",
            "nats://tok/secret@h",
            "postgres://u:secret@h/db?application_name=a@b",
        ] {
            let err = UrlError::check_user_info(url).expect_err(url);
            assert!(err.message.contains("percent-encode"), "{url}: {err}");
            assert!(!format!("{err} {err:?}").contains("secret"), "{url}: {err}");
        }
        for url in [
            "postgres://u:se%2Fcret@h/db?sslmode=require",
            "postgres://u:p@ss:w@h/db",
            "postgres://h/db",
            "host=db password=a@b",
            "file:///run/a",
        ] {
            assert_eq!(UrlError::check_user_info(url), Ok(()), "{url}");
        }
    }
}
