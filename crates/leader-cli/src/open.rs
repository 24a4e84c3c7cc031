//! Opening the lock at start, so that a wrong URL, a server that is down or one that refuses us
//! is one clear line and an exit code; later outages are retried by the elector.

use std::time::Duration;

use leader::{LockUrl, OpenError};
use leader_core::{FileLock, LockError, ResourceLock};

use crate::args::LockArgs;
use crate::exit;

/// One clear line on stderr, and the code to exit with.
pub(crate) fn fail(code: u8, message: impl std::fmt::Display) -> u8 {
    eprintln!("leader: {message}");
    code
}

/// The exit code for a lock error at start.
pub(crate) fn code_for(err: &LockError) -> u8 {
    match err {
        LockError::Unavailable { .. } | LockError::Timeout { .. } => exit::UNREACHABLE,
        LockError::Misconfigured { .. } => exit::BAD_LOCK,
        _ => exit::REFUSED,
    }
}

/// The exit code and line for an error of [`LockUrl::open_checked`].
pub(crate) fn open_failed(err: OpenError) -> u8 {
    match err {
        OpenError::Lock(err) => fail(code_for(&err), err),
        OpenError::Url(err) => fail(exit::BAD_LOCK, err),
        err => fail(exit::BAD_LOCK, err),
    }
}

/// The lock URL of `--lock` (default: the file lock of `--name`), or the exit code of a URL
/// that is not one.
pub(crate) fn lock_url(lock: &LockArgs) -> Result<LockUrl, u8> {
    match lock.lock.as_deref() {
        Some(url) => LockUrl::parse(url).map_err(|err| fail(exit::BAD_LOCK, err)),
        None => Ok(LockUrl::file(leader::default_file(&lock.name))),
    }
}

/// Opens the lock and reads it once, as the library's `open` does: connecting and reading
/// together answer within `timeout`, whatever the server does. The file lock comes back as a
/// [`FileLock`] too: its term lock is handed to COMMAND.
pub(crate) async fn open_lock(
    args: &LockArgs,
    identity: &str,
    timeout: Duration,
) -> Result<(Box<dyn ResourceLock>, Option<FileLock>), u8> {
    let url = lock_url(args)?;
    let Some(file) = url.file_lock(&args.name, identity) else {
        let lock = url
            .open_checked(&args.name, identity, timeout)
            .await
            .map_err(open_failed)?;
        return Ok((lock, None));
    };
    let file = file.map_err(|err| fail(code_for(&err), err))?;
    match tokio::time::timeout(timeout, file.get()).await {
        Ok(Ok(_)) => Ok((Box::new(file.clone()), Some(file))),
        Ok(Err(err)) => Err(fail(code_for(&err), err)),
        Err(_) => Err(no_answer(&url, timeout)),
    }
}

/// The exit code and line for a store that did not answer within `after`.
pub(crate) fn no_answer(url: &LockUrl, after: Duration) -> u8 {
    fail(
        exit::UNREACHABLE,
        format!("{}: no answer within {after:?}", url.describe()),
    )
}
