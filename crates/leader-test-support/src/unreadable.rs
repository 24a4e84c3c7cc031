//! S8 against a real server: a record that cannot be read is reported, never overwritten, and
//! the elector on it keeps running until it is gone.

use std::time::Duration;

use leader_core::conformance::record;
use leader_core::{LockError, ResourceLock};

use crate::Candidate;

/// `lock`'s record cannot be read (`what` is wrong with it): `get` and `try_acquire` both
/// report it as [`LockError::InvalidRecord`], `get`'s error naming `expected`, and an elector
/// started on it stays alive without leading for 1.5 s. That elector is returned, for the test
/// to check that the record is as it wrote it, remove it and see the elector lead.
pub async fn reported_while_the_elector_waits(
    lock: impl ResourceLock + 'static,
    what: &str,
    expected: &str,
) -> Candidate {
    let err = lock.get().await.expect_err(what);
    assert!(
        matches!(err, LockError::InvalidRecord { .. }),
        "{what}: {err:?}"
    );
    assert!(err.to_string().contains(expected), "{what}: {err}");
    let err = lock.try_acquire(&record("a", 0)).await.expect_err(what);
    assert!(
        matches!(err, LockError::InvalidRecord { .. }),
        "{what}: {err:?}"
    );
    let elector = Candidate::start(lock);
    elector
        .stays_alive_without_leading(Duration::from_millis(1500))
        .await;
    elector
}
