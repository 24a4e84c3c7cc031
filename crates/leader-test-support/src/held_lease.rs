//! A lease held on a real server, for the tests that move a session's clock (or its time zone,
//! or leave it inside a transaction): the server's clock decides the lease, so a candidate
//! whose session reads another time still finds it held.

use std::time::Duration;

use leader_core::conformance::record;
use leader_core::{Acquisition, LeaderElectionRecord, Observed, ResourceLock};

/// A record of `holder` with a 30 s lease.
pub fn lease(holder: &str) -> LeaderElectionRecord {
    let mut record = record(holder, 1);
    record.lease_duration = Duration::from_secs(30);
    record
}

/// Acquires the new election of `holder` (named "holder") with a 30 s [`lease`]; panics
/// unless it was free.
pub async fn take(holder: &dyn ResourceLock) -> Observed {
    let Some(Acquisition::Acquired(held)) =
        holder.try_acquire(&lease("holder")).await.expect("acquire")
    else {
        panic!("a new election is free");
    };
    held
}

/// Renews `held` through `holder`, with the renewal time of now.
pub async fn renew(holder: &dyn ResourceLock, held: &Observed) -> Observed {
    let mut renewal = held.record.clone();
    renewal.renew_time = chrono::Utc::now();
    holder.update(&held.version, &renewal).await.expect("renew")
}

/// Renews `held` through `holder`, whose pooled connection another user of the pool left
/// inside a transaction: panics unless that renewal fails saying so and writes nothing
/// (`reader`, a lock of the same election on a connection of its own, still reads `held`), and
/// the same renewal sent again, on a new connection, is committed.
pub async fn assert_renewal_in_an_open_transaction_commits_nothing(
    holder: &dyn ResourceLock,
    held: &Observed,
    reader: &dyn ResourceLock,
) {
    let mut renewal = held.record.clone();
    renewal.renew_time = chrono::Utc::now();
    let err = holder
        .update(&held.version, &renewal)
        .await
        .expect_err("a renewal inside a transaction left open");
    assert!(err.to_string().contains("transaction"), "{err}");
    let seen = async || reader.get().await.expect("get").expect("a record").version;
    assert_eq!(
        seen().await,
        held.version,
        "the failed renewal was not committed"
    );
    let renewed = holder
        .update(&held.version, &renewal)
        .await
        .expect("renewed on a new connection");
    assert_eq!(
        seen().await,
        renewed.version,
        "committed on a new connection"
    );
}

/// [`take`]s the election of `holder` and [`renew`]s it once.
pub async fn hold(holder: &dyn ResourceLock) {
    let held = take(holder).await;
    renew(holder, &held).await;
}

/// Panics unless `candidate` finds its election held, for most of a 30 s lease: its attempt
/// is told the time left, and so is its own reading of it.
pub async fn assert_held(candidate: &dyn ResourceLock) {
    match candidate.try_acquire(&lease("candidate")).await {
        Ok(Some(Acquisition::Held { expires_in, .. })) => {
            let left = expires_in.expect("the server tells the time left");
            assert!(
                left > Duration::from_secs(20) && left <= Duration::from_secs(30),
                "time left by the lock's clock: {left:?}"
            );
        }
        other => panic!("a candidate took or broke a held lease: {other:?}"),
    }
    let left = candidate
        .time_left()
        .await
        .expect("time left")
        .expect("held");
    assert!(left > Duration::from_secs(20), "time left: {left:?}");
}
