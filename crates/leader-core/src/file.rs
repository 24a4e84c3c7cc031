//! A lock in a directory, for electing one of several processes on one host without any server.
//!
//! No operation holds an OS lock across a read and a write, so no process can hold up the others
//! by stopping (SIGSTOP, a frozen container, a debugger). A compare-and-swap creates the next
//! version's file with `link(2)`, which fails if that file exists: of all writers that read
//! version `n`, exactly one creates `n + 1`.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::LockError;
use crate::lock::{Acquisition, ChangeStream, HolderCheck, ResourceLock};
use crate::record::{LeaderElectionRecord, Observed, Version};

mod dir;
mod layout;

pub(crate) use dir::ensure_private_dir;
use dir::*;
pub(crate) use layout::election_dir;

const BACKEND: &str = "file";
/// Versions kept behind the newest, for readers that listed the directory a moment ago.
const KEEP: u64 = 4;
/// Leftovers (temporary files, term files nobody holds) younger than this are left alone: they
/// may belong to a write in progress.
const LEFTOVER_AGE: Duration = Duration::from_secs(60);
/// How often a read retries when the version it listed was collected before it could open it.
const READ_TRIES: usize = 20;

/// A [`ResourceLock`] whose record lives in a directory on the local host.
///
/// The directory holds one file per version of the record, `v00000000000000000001.json`, ...; the
/// newest is the record. A write prepares the next version in a temporary file (`fsync`ed) and
/// links it to the next version's name, which fails if another writer got there first: a
/// compare-and-swap that holds no lock, so a process frozen in the middle of an operation holds
/// nobody up. Old versions are removed as new ones are written. A version's content names its
/// generation, a random number chosen when the first version was written, so a directory deleted
/// and made again never matches a version read before.
///
/// **Failover when the holder dies.** While it holds the lease, a candidate keeps an exclusive
/// `flock` on a file of its term (`term-*.lock`, named in the record). The kernel drops it when
/// the holder's process ends, however it ends, and followers take the lease over at once instead
/// of waiting out the lease. A frozen holder keeps its lock, so followers wait for its lease as
/// usual (and its fencing token guards what it does when it wakes up). Handles that outlive the
/// lock object keep the term's lock until the process exits, since the leader's work may still
/// run: see [`term_lock`](Self::term_lock) to hand it to child processes doing that work.
///
/// The directory must be on a local file system: `flock` over NFS is not reliable.
///
/// **Other users.** The directory is this user's own: the lock creates it private (mode
/// `0700`), and refuses one that is a symbolic link, owned by another user, or writable by
/// group or others ([`LockError::Misconfigured`], saying why and what to do), since whoever can
/// write there can block the election or take it. A directory shared by several users is not
/// supported: run every candidate as one user.
///
/// ```no_run
/// use leader_core::FileLock;
///
/// let lock = FileLock::new("/run/myapp/leader", "replica-1");
/// # let _ = lock;
/// ```
#[derive(Clone, Debug)]
pub struct FileLock {
    dir: PathBuf,
    /// The election's name: the directory's own name unless set, `None` for a path that ends
    /// in no name that is text (`/`, `..`, bytes that are not UTF-8).
    name: Option<String>,
    identity: String,
    poll_interval: Duration,
    term: Arc<TermSlot>,
}

#[derive(Serialize, Deserialize)]
struct Stored {
    generation: u64,
    version: u64,
    record: LeaderElectionRecord,
    /// The holder's term lock file, when the holder keeps one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    term: Option<String>,
    /// What a later release keeps beside the record, written back as it was (S16).
    #[serde(flatten)]
    unknown_fields: std::collections::BTreeMap<String, serde_json::Value>,
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

/// The term lock this candidate holds, if any.
#[derive(Debug, Default)]
struct TermSlot(Mutex<Option<TermLock>>);

#[derive(Debug)]
struct TermLock {
    /// The fencing token of the term.
    token: u64,
    name: String,
    file: File,
}

impl TermSlot {
    fn get(&self) -> MutexGuard<'_, Option<TermLock>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for TermSlot {
    fn drop(&mut self) {
        // The lock object is gone but this process, and the leader's work in it, may still run:
        // keep the term's lock until the process exits, so that followers wait out the lease.
        let term = self.get().take();
        if let Some(term) = term {
            std::mem::forget(term.file);
        }
    }
}

impl FileLock {
    /// A lock whose record lives in the directory `path`, for candidate `identity`. The directory
    /// is created on the first write; its parent must exist. The election's name
    /// ([`ResourceLock::election_name`]) is the directory's own name (`leader` for
    /// `/run/myapp/leader`); [`with_election_name`](Self::with_election_name) sets another.
    pub fn new(path: impl Into<PathBuf>, identity: impl Into<String>) -> Self {
        let dir: PathBuf = path.into();
        Self {
            name: dir.file_name().and_then(|n| n.to_str()).map(str::to_owned),
            dir,
            identity: identity.into(),
            poll_interval: Duration::from_millis(50),
            term: Arc::default(),
        }
    }

    /// How often a follower checks the directory for changes (default 50 ms): a directory listing,
    /// and a non-blocking `flock` of the holder's term file, that let it act on a release or on
    /// the holder's death at once instead of on its next retry.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// The lock directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Names the election `name` instead of after the lock directory, for a directory that is
    /// not named after its election (the one a `file://` URL names, say).
    #[must_use]
    pub fn with_election_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// A new handle on the open file whose `flock` marks this candidate's current term as alive,
    /// while it holds one. The lock lasts as long as any handle on it is open, in any process:
    /// give it (without close-on-exec) to child processes that do the leader's work, and followers
    /// take over at once only when the leader and all of them are gone.
    pub fn term_lock(&self) -> Option<File> {
        self.term
            .get()
            .as_ref()
            .and_then(|term| term.file.try_clone().ok())
    }

    async fn blocking<T: Send + 'static>(
        &self,
        op: impl FnOnce(&FileLock) -> Result<T, LockError> + Send + 'static,
    ) -> Result<T, LockError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || op(&this))
            .await
            .map_err(|err| LockError::other(BACKEND, err))?
    }

    /// Writes `record` as the version after `current` (or as the first version), with a term lock
    /// when this candidate is the holder. A conflict when another writer created that version
    /// first, or when a newer version exists once it is written (this writer was frozen while
    /// others wrote, and its version number had been collected).
    fn write_next(
        &self,
        current: Option<&Stored>,
        record: LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let mut slot = self.term.get();
        let ours = record.is_held_by(&self.identity);
        let held = slot
            .as_ref()
            .filter(|t| ours && t.token == record.leader_transitions)
            .map(|t| t.name.clone());
        let new_term = match (&held, ours) {
            (None, true) => Some(self.new_term_lock(record.leader_transitions)?),
            _ => None,
        };
        // A write on the holder's behalf (a handover request) keeps its term file.
        let holders = current
            .filter(|c| {
                !ours && !record.is_free() && c.record.holder_identity == record.holder_identity
            })
            .and_then(|c| c.term.clone());
        let stored = Stored {
            generation: current.map_or_else(|| fastrand::u64(..), |c| c.generation),
            version: current.map_or(1, |c| c.version + 1),
            record,
            term: held
                .or_else(|| new_term.as_ref().map(|t| t.name.clone()))
                .or(holders),
            unknown_fields: current
                .map(|c| c.unknown_fields.clone())
                .unwrap_or_default(),
        };
        match self.link_version(&stored) {
            Ok(()) => {}
            Err(err) => {
                if let Some(term) = new_term {
                    self.remove_term(term);
                }
                return Err(err);
            }
        }
        if ours {
            if let Some(term) = new_term
                && let Some(old) = slot.replace(term)
            {
                self.remove_term(old);
            }
        } else if let Some(old) = slot.take() {
            self.remove_term(old);
        }
        drop(slot);
        self.collect(stored.version, stored.term.as_deref());
        Ok(stored.observed())
    }

    fn new_term_lock(&self, token: u64) -> Result<TermLock, LockError> {
        self.ensure_dir()?;
        let name = format!("term-{:016x}.lock", fastrand::u64(..));
        let path = self.dir.join(&name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|err| io_error(&path, err))?;
        match file.try_lock() {
            Ok(()) => Ok(TermLock { token, name, file }),
            Err(TryLockError::WouldBlock) => Err(LockError::unavailable(
                BACKEND,
                format!(
                    "{}: a new term file is locked by another process",
                    path.display()
                ),
            )),
            Err(TryLockError::Error(err)) => Err(io_error(&path, err)),
        }
    }

    fn remove_term(&self, term: TermLock) {
        let _ = fs::remove_file(self.dir.join(&term.name));
        drop(term.file);
    }

    fn ensure_dir(&self) -> Result<(), LockError> {
        ensure_private_dir(&self.dir)
    }

    /// Creates the file of `stored`'s version from a complete temporary file: `link(2)` fails
    /// if the name exists, so of two writers only one creates it.
    fn link_version(&self, stored: &Stored) -> Result<(), LockError> {
        self.ensure_dir()?;
        let bytes =
            serde_json::to_vec_pretty(stored).map_err(|err| LockError::other(BACKEND, err))?;
        let tmp = self.dir.join(format!(".tmp-{:016x}", fastrand::u64(..)));
        let target = self.dir.join(version_name(stored.version));
        let result = (|| {
            let mut file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            fs::hard_link(&tmp, &target)
        })();
        let _ = fs::remove_file(&tmp);
        match result {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {
                return Err(LockError::conflict(BACKEND));
            }
            Err(err) => return Err(io_error(&target, err)),
        }
        // Make the new name durable; not every platform can sync a directory.
        if let Ok(dir) = File::open(&self.dir) {
            let _ = dir.sync_all();
        }
        // A writer frozen between its read and its link may have created a version number that
        // was written and collected meanwhile: then a newer version exists, and this one is not
        // the record.
        if newest_versions(&self.dir)?.first().copied() != Some(stored.version) {
            let _ = fs::remove_file(&target);
            return Err(LockError::conflict(BACKEND));
        }
        Ok(())
    }

    /// Removes versions older than the newest few, temporary files of writers that died, and
    /// term files nobody holds. Best effort: another process may be collecting at the same time.
    fn collect(&self, newest: u64, term: Option<&str>) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        let now = SystemTime::now();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = entry.path();
            if let Some(version) = parse_version_name(name) {
                if version + KEEP < newest {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|modified| {
                    now.duration_since(modified)
                        .is_ok_and(|age| age > LEFTOVER_AGE)
                });
            if !old {
                continue;
            }
            if name.starts_with(".tmp-") {
                let _ = fs::remove_file(&path);
            } else if name.starts_with("term-") && Some(name) != term {
                // Only a term file nobody holds; the lock is held while it is removed.
                if let Ok(file) = File::open(&path)
                    && file.try_lock().is_ok()
                {
                    let _ = fs::remove_file(&path);
                }
            }
        }
    }

    /// Whether the holder of `stored` is known to be gone: its term file is there and nobody
    /// holds its lock. A missing term file, or none named, tells nothing.
    fn holder_is_gone(&self, stored: &Stored) -> bool {
        let Some(term) = &stored.term else {
            return false;
        };
        if stored.record.is_free() {
            return false;
        }
        match File::open(self.dir.join(term)) {
            Ok(file) => file.try_lock().is_ok(),
            Err(_) => false,
        }
    }
}

#[async_trait]
impl ResourceLock for FileLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        self.blocking(|this| Ok(read(&this.dir)?.map(|s| s.observed())))
            .await
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let record = record.clone();
        self.blocking(move |this| {
            // Anything stored, readable or not, makes this a conflict.
            match read(&this.dir) {
                Ok(None) => this.write_next(None, record),
                Ok(Some(_)) | Err(LockError::InvalidRecord { .. }) => {
                    Err(LockError::conflict(BACKEND))
                }
                Err(err) => Err(err),
            }
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
        self.blocking(move |this| match read(&this.dir)? {
            Some(current) if current.version() == expected => {
                this.write_next(Some(&current), record)
            }
            _ => Err(LockError::conflict(BACKEND)),
        })
        .await
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("file:{}", self.dir.display())
    }

    fn election_name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let this = self.clone();
        let interval = self.poll_interval;
        let first = tokio::task::spawn_blocking({
            let dir = this.dir.clone();
            move || newest_versions(&dir).ok().and_then(|v| v.first().copied())
        })
        .await
        .ok()
        .flatten();
        // The newest version seen, and whether its holder was already reported gone.
        let stream = futures_util::stream::unfold((first, false), move |(mut last, mut gone)| {
            let this = this.clone();
            async move {
                loop {
                    tokio::time::sleep(interval).await;
                    let check = this.clone();
                    // One listing and one read a poll.
                    let seen = tokio::task::spawn_blocking(move || {
                        let (newest, stored) = read_listed(&check.dir);
                        let state = stored.map(|s| {
                            s.map(|s| {
                                let free = s.record.is_free() || s.record.handover_to().is_some();
                                (free, check.holder_is_gone(&s))
                            })
                        });
                        (newest, state)
                    })
                    .await
                    .ok();
                    // A directory that cannot be listed tells nothing new: poll again.
                    let Some((newest, state)) = seen.filter(|(n, s)| n.is_some() || s.is_ok())
                    else {
                        continue;
                    };
                    let changed = newest != last;
                    if changed {
                        last = newest;
                        gone = false;
                    }
                    // Only what a candidate acts on: the record removed, freed, asking for a
                    // handover, or unreadable (which its next read reports), or its holder dead.
                    // Renewals wake nobody.
                    let fire = match state {
                        Ok(None) | Err(_) => changed,
                        Ok(Some((true, _))) => changed,
                        Ok(Some((false, true))) => !std::mem::replace(&mut gone, true),
                        Ok(Some((false, false))) => false,
                    };
                    if fire {
                        return Some(((), (last, gone)));
                    }
                }
            }
        });
        Ok(Some(Box::pin(stream)))
    }

    /// Takes the lease when it is absent, free, or held by a process that is gone (its term lock
    /// is free), unless a pending handover names another candidate; otherwise reports it held
    /// (also to this candidate's identity, S13), and the elector waits out the holder's lease
    /// on its own clock (S2).
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let desired = desired.clone();
        self.blocking(move |this| {
            let current = read(&this.dir)?;
            let mut record = desired;
            record.leader_transitions = match &current {
                Some(c) => crate::rules::next_token(&c.record)?,
                None => 1,
            }
            .max(record.leader_transitions);
            // The stored extensions, not the candidate's (only a holder writes them).
            record.extensions = current
                .as_ref()
                .map(|c| c.record.extensions.clone())
                .unwrap_or_default();
            match &current {
                Some(c)
                    if c.record.reserved_for_other_than(&record.holder_identity)
                        || (!c.record.is_free() && !this.holder_is_gone(c)) =>
                {
                    Ok(Some(Acquisition::Held {
                        observed: c.observed(),
                        expires_in: None,
                        renewed_in_store: false,
                    }))
                }
                _ => this
                    .write_next(current.as_ref(), record)
                    .map(|o| Some(Acquisition::Acquired(o))),
            }
        })
        .await
    }

    /// The term's `flock` (see [`FileLock`]): a dead holder's lease is taken at once, and a
    /// record found gone waited out.
    fn holder_check(&self) -> HolderCheck {
        HolderCheck::Process
    }
}

#[cfg(test)]
mod tests;
