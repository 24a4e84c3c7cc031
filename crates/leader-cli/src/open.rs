//! Opening the lock at start, so that a wrong URL, a server that is down or one that refuses us
//! is one clear line and an exit code; later outages are retried by the elector.

use std::time::Duration;

use leader::LockUrl;
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

/// Opens the lock and reads it once. Connecting and reading together answer within `timeout`,
/// whatever the server does. The file lock comes back as a [`FileLock`] too: its term lock is
/// handed to COMMAND.
pub(crate) async fn open_lock(
    args: &LockArgs,
    identity: &str,
    timeout: Duration,
) -> Result<(Box<dyn ResourceLock>, Option<FileLock>), u8> {
    let url = match args.lock.as_deref() {
        Some(url) => LockUrl::parse(url).map_err(|err| fail(exit::BAD_LOCK, err))?,
        None => LockUrl::file(leader::default_file(&args.name)),
    };
    let opened = async {
        let (lock, file): (Box<dyn ResourceLock>, _) = match url.file_lock(&args.name, identity) {
            Some(file) => {
                let file = file?;
                (Box::new(file.clone()), Some(file))
            }
            None => (url.open(&args.name, identity).await?, None),
        };
        lock.get().await?;
        Ok::<_, LockError>((lock, file))
    };
    match tokio::time::timeout(timeout, opened).await {
        Ok(Ok(opened)) => Ok(opened),
        Ok(Err(err)) => Err(fail(code_for(&err), err)),
        Err(_) => Err(fail(
            exit::UNREACHABLE,
            format!("{}: no answer within {timeout:?}", url.describe()),
        )),
    }
}
