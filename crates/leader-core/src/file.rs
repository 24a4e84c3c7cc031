//! A lock in a file, for electing one of several processes on one host without any server.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::LockError;
use crate::lock::{ChangeStream, ResourceLock};
use crate::record::{LeaderElectionRecord, Observed, Version};

const BACKEND: &str = "file";

/// A [`ResourceLock`] whose record lives in a file on the local host.
///
/// Every operation takes an exclusive OS lock (`flock`) on a sidecar file `PATH.lock`, reads the
/// record file, and for a write replaces it atomically (a temporary file, `fsync`, `rename`), so a
/// crash never leaves half a record. Versions carry a random generation, so a deleted and
/// re-created file never matches a version read before.
///
/// The file must be on a local file system: `flock` over NFS is not reliable.
///
/// ```no_run
/// use leader_core::FileLock;
///
/// let lock = FileLock::new("/run/myapp/leader.json", "replica-1");
/// # let _ = lock;
/// ```
#[derive(Clone, Debug)]
pub struct FileLock {
    path: PathBuf,
    lock_path: PathBuf,
    identity: String,
    lock_wait: Duration,
    poll_interval: Duration,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    generation: u64,
    version: u64,
    record: LeaderElectionRecord,
}

impl Stored {
    fn version(&self) -> Version {
        Version::new(format!("{:016x}-{}", self.generation, self.version))
    }

    fn observed(&self) -> Observed {
        Observed {
            record: self.record.clone(),
            version: self.version(),
        }
    }
}

impl FileLock {
    /// A lock whose record is the file at `path`, for candidate `identity`.
    pub fn new(path: impl Into<PathBuf>, identity: impl Into<String>) -> Self {
        let path = path.into();
        let mut lock_path = path.clone().into_os_string();
        lock_path.push(".lock");
        Self {
            path,
            lock_path: lock_path.into(),
            identity: identity.into(),
            lock_wait: Duration::from_secs(2),
            poll_interval: Duration::from_millis(50),
        }
    }

    /// How long an operation waits for another process's OS lock on the file (default 2 s); a
    /// process stopped while holding it cannot block others longer.
    #[must_use]
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// How often a follower checks the record file for changes (default 50 ms): a `stat` call
    /// that lets it act on a release at once instead of on its next retry.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// The record file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `op` on a blocking thread while holding the OS lock.
    async fn locked<T: Send + 'static>(
        &self,
        operation: &'static str,
        op: impl FnOnce(&Path) -> Result<T, LockError> + Send + 'static,
    ) -> Result<T, LockError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let _guard = this.acquire_os_lock(operation)?;
            op(&this.path)
        })
        .await
        .map_err(|err| LockError::other(BACKEND, err))?
    }

    fn acquire_os_lock(&self, operation: &'static str) -> Result<File, LockError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock_path)
            .map_err(|err| io_error(&self.lock_path, err))?;
        let started = Instant::now();
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(file),
                Err(TryLockError::WouldBlock) if started.elapsed() < self.lock_wait => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(TryLockError::WouldBlock) => {
                    return Err(LockError::Timeout {
                        operation,
                        after: self.lock_wait,
                    });
                }
                Err(TryLockError::Error(err)) => return Err(io_error(&self.lock_path, err)),
            }
        }
    }
}

fn io_error(path: &Path, err: io::Error) -> LockError {
    let message = format!("{}: {err}", path.display());
    match err.kind() {
        io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem => {
            LockError::Forbidden {
                backend: BACKEND,
                message,
            }
        }
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory | io::ErrorKind::IsADirectory => {
            LockError::Misconfigured {
                backend: BACKEND,
                message,
            }
        }
        _ => LockError::unavailable(BACKEND, message),
    }
}

fn read(path: &Path) -> Result<Option<Stored>, LockError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(io_error(path, err)),
    };
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let stored: Stored = serde_json::from_slice(&bytes).map_err(|err| {
        LockError::invalid_record(
            BACKEND,
            format!("{}: not a lock record file: {err}", path.display()),
        )
    })?;
    Ok(Some(stored))
}

fn write(path: &Path, stored: &Stored) -> Result<(), LockError> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let bytes = serde_json::to_vec_pretty(stored).map_err(|err| LockError::other(BACKEND, err))?;
    let mut tmp = tempfile_in(dir, path)?;
    let result = (|| {
        tmp.1.write_all(&bytes)?;
        tmp.1.sync_all()?;
        fs::rename(&tmp.0, path)?;
        // Make the rename itself durable; not every platform can sync a directory.
        if let Ok(dir) = File::open(dir) {
            let _ = dir.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp.0);
    }
    result.map_err(|err| io_error(path, err))
}

fn tempfile_in(dir: &Path, path: &Path) -> Result<(PathBuf, File), LockError> {
    let base = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{base}.{:016x}.tmp", fastrand::u64(..)));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|err| io_error(&tmp, err))?;
    Ok((tmp, file))
}

#[async_trait]
impl ResourceLock for FileLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        self.locked("get", |path| Ok(read(path)?.map(|s| s.observed())))
            .await
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let record = record.clone();
        self.locked("create", move |path| {
            // Anything stored, readable or not, makes this a conflict.
            match read(path) {
                Ok(None) => {}
                Ok(Some(_)) | Err(LockError::InvalidRecord { .. }) => {
                    return Err(LockError::conflict(BACKEND));
                }
                Err(err) => return Err(err),
            }
            let stored = Stored {
                generation: fastrand::u64(..),
                version: 1,
                record,
            };
            write(path, &stored)?;
            Ok(stored.observed())
        })
        .await
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let record = record.clone();
        let expected = version.clone();
        self.locked("update", move |path| {
            let current = match read(path)? {
                Some(current) if current.version() == expected => current,
                _ => return Err(LockError::conflict(BACKEND)),
            };
            let stored = Stored {
                generation: current.generation,
                version: current.version + 1,
                record,
            };
            write(path, &stored)?;
            Ok(stored.observed())
        })
        .await
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("file:{}", self.path.display())
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let path = self.path.clone();
        let interval = self.poll_interval;
        let first = file_stamp(&path).await;
        let stream = futures_util::stream::unfold(first, move |mut last| {
            let path = path.clone();
            async move {
                loop {
                    tokio::time::sleep(interval).await;
                    let stamp = file_stamp(&path).await;
                    if stamp != last {
                        last = stamp;
                        // Only what a follower acts on: the record removed or freed (or
                        // unreadable, which its next read reports). Renewals wake nobody.
                        let free =
                            read(&path).map_or(true, |s| s.is_none_or(|s| s.record.is_free()));
                        if free {
                            return Some(((), last));
                        }
                    }
                }
            }
        });
        Ok(Some(Box::pin(stream)))
    }
}

/// What changes when the record file is replaced or removed: every write renames a new file in.
async fn file_stamp(path: &Path) -> Option<(std::time::SystemTime, u64, u64)> {
    let meta = tokio::fs::metadata(path).await.ok()?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&meta);
    #[cfg(not(unix))]
    let inode = 0;
    Some((meta.modified().ok()?, meta.len(), inode))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_directory_is_misconfigured() {
        let lock = FileLock::new("/nonexistent-dir-for-leader-tests/x.json", "a");
        let err = lock.get().await.expect_err("no directory");
        assert!(matches!(err, LockError::Misconfigured { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_held_os_lock_times_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lock =
            FileLock::new(dir.path().join("x.json"), "a").lock_wait(Duration::from_millis(50));
        let held = lock.acquire_os_lock("test").expect("os lock");
        let err = lock.get().await.expect_err("lock is held");
        assert!(matches!(err, LockError::Timeout { .. }), "{err}");
        drop(held);
        assert!(lock.get().await.expect("free again").is_none());
    }
}
