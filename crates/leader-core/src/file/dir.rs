//! The lock directory on disk: version file names, the check that the directory is this user's
//! own, and reading the newest version.

use std::path::Path;
use std::{fs, io};

use super::{BACKEND, READ_TRIES, Stored};
use crate::error::LockError;

pub(super) fn version_name(version: u64) -> String {
    format!("v{version:020}.json")
}

pub(super) fn parse_version_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix('v')?.strip_suffix(".json")?;
    if digits.len() != 20 {
        return None;
    }
    digits.parse().ok()
}

/// Refuses a lock directory another user could write to: a symbolic link, one owned by another
/// user, or one writable by group or others. `Ok` when it does not exist (yet).
pub(super) fn check_dir(dir: &Path) -> Result<(), LockError> {
    let metadata = match fs::symlink_metadata(dir) {
        Ok(metadata) => metadata,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(io_error(dir, err)),
    };
    let refuse = |why: String| LockError::Misconfigured {
        backend: BACKEND,
        message: format!(
            "{}: {why}; another user could block this election or take it over",
            dir.display()
        ),
    };
    if metadata.file_type().is_symlink() {
        return Err(refuse(
            "is a symbolic link: use the directory it points to, if it is yours".to_owned(),
        ));
    }
    if !metadata.is_dir() {
        return Err(not_a_directory(dir));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let me = nix::unistd::geteuid().as_raw();
        if metadata.uid() != me {
            return Err(refuse(format!(
                "is owned by user {}, not by this user ({me}): remove it if it is not in use, \
                 or use a lock directory of your own",
                metadata.uid()
            )));
        }
        let mode = metadata.mode() & 0o7777;
        if mode & 0o022 != 0 {
            return Err(refuse(format!(
                "is writable by other users (mode {mode:o}): make it private (chmod go-w) or use \
                 a lock directory of your own"
            )));
        }
    }
    Ok(())
}

/// The version numbers in `dir`, newest first; empty when the directory does not exist.
pub(super) fn newest_versions(dir: &Path) -> Result<Vec<u64>, LockError> {
    check_dir(dir)?;
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return match dir.parent() {
                Some(parent) if !parent.as_os_str().is_empty() && !parent.is_dir() => {
                    Err(io_error(dir, err))
                }
                _ => Ok(Vec::new()),
            };
        }
        Err(err) if err.kind() == io::ErrorKind::NotADirectory => {
            return Err(not_a_directory(dir));
        }
        Err(err) => return Err(io_error(dir, err)),
    };
    let mut versions: Vec<u64> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(parse_version_name))
        .collect();
    versions.sort_unstable_by(|a, b| b.cmp(a));
    Ok(versions)
}

/// The newest version, or `None` when there is none.
pub(super) fn read(dir: &Path) -> Result<Option<Stored>, LockError> {
    read_listed(dir).1
}

/// The newest version, with the number of the newest version file listed (known even when that
/// file cannot be read).
pub(super) fn read_listed(dir: &Path) -> (Option<u64>, Result<Option<Stored>, LockError>) {
    let mut listed = None;
    for _ in 0..READ_TRIES {
        let newest = match newest_versions(dir) {
            Ok(versions) => versions.first().copied(),
            Err(err) => return (listed, Err(err)),
        };
        listed = newest;
        let Some(newest) = newest else {
            return (None, Ok(None));
        };
        let path = dir.join(version_name(newest));
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            // Collected after newer versions were written since the listing: list again.
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return (listed, Err(io_error(&path, err))),
        };
        let stored = serde_json::from_slice::<Stored>(&bytes)
            .map_err(|err| {
                LockError::invalid_record(
                    BACKEND,
                    format!("{}: not a lock record file: {err}", path.display()),
                )
            })
            .and_then(|stored| {
                if stored.version == newest {
                    Ok(Some(stored))
                } else {
                    Err(LockError::invalid_record(
                        BACKEND,
                        format!(
                            "{}: holds version {}, not {newest}",
                            path.display(),
                            stored.version
                        ),
                    ))
                }
            });
        return (listed, stored);
    }
    let err = LockError::unavailable(
        BACKEND,
        format!("{}: the record changed too fast to be read", dir.display()),
    );
    (listed, Err(err))
}

pub(super) fn not_a_directory(dir: &Path) -> LockError {
    LockError::invalid_record(
        BACKEND,
        format!(
            "{} is not a directory: a file lock is a directory of record versions (a file there \
             may be from an older layout; remove it if no process uses it)",
            dir.display()
        ),
    )
}

/// Creates directory `dir` for this user alone (0700), or checks the one there: this user's
/// own, and nobody else may write to it.
pub(crate) fn ensure_private_dir(dir: &Path) -> Result<(), LockError> {
    let mut builder = fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    match builder.create(dir) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => check_dir(dir),
        Err(err) => Err(io_error(dir, err)),
    }
}

pub(super) fn io_error(path: &Path, err: io::Error) -> LockError {
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
