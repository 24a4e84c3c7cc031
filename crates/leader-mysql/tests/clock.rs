//! The server's clock as the locks read it: a session whose time was set with `SET timestamp`
//! (which moves `NOW()`, `UTC_TIMESTAMP()` and `CURRENT_TIMESTAMP` for that session) never
//! reaches the lock through the store's pool, whether its clock runs ahead (a candidate would
//! take a lease that is held) or behind (a holder would renew into the past).

mod common;

use std::time::Duration;

use common::{one_connection_store, unique};
use leader_core::{Acquisition, LockError, ResourceLock};
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_test_support::held_lease::{assert_held, hold, lease, renew, take};

/// Takes `store`'s pooled connection, moves its session's clock by `seconds`, and returns it.
async fn set_session_clock(store: &MysqlStore, seconds: i64) {
    let mut conn = store.pool().get_conn().await.expect("pooled");
    conn.query_drop(format!("SET timestamp = UNIX_TIMESTAMP() + ({seconds})"))
        .await
        .expect("SET timestamp");
    let moved: i64 = conn
        .query_first("SELECT TIMESTAMPDIFF(SECOND, SYSDATE(), NOW())")
        .await
        .expect("read the session clock")
        .expect("a row");
    assert!(
        (moved - seconds).abs() <= 1,
        "the session's clock moved {moved} s"
    );
    drop(conn);
}

/// The holder's lease as another store reads it, by the server's own clock.
async fn time_left(name: &str) -> Duration {
    let store = MysqlStore::connect(common::mysql_url())
        .await
        .expect("store");
    store
        .lock(name, "reader")
        .time_left()
        .await
        .expect("time left")
        .expect("held")
}

/// A candidate whose pooled connection had its session clock set an hour ahead by another user
/// of the pool does not take a lease that its holder acquired and renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_clock_set_ahead_takes_no_held_lease() {
    let Some(holder_store) = common::store().await else {
        return;
    };
    let name = unique("clock-ahead");
    hold(&holder_store.lock(&name, "holder")).await;
    let candidate_store = one_connection_store().await;
    set_session_clock(&candidate_store, 3600).await;
    assert_held(&candidate_store.lock(&name, "candidate")).await;
}

/// A holder whose pooled connection had its session clock set an hour behind renews for its
/// full lease: a candidate on another store still finds the lease held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_clock_set_behind_renews_no_lease_into_the_past() {
    let Some(candidate_store) = common::store().await else {
        return;
    };
    let holder_store = one_connection_store().await;
    let name = unique("clock-behind");
    let holder = holder_store.lock(&name, "holder");
    let held = take(&holder).await;
    set_session_clock(&holder_store, -3600).await;
    renew(&holder, &held).await;
    let left = time_left(&name).await;
    assert!(
        left > Duration::from_secs(20),
        "the renewal left {left:?} of a 30 s lease"
    );
    let candidate = candidate_store.lock(&name, "candidate");
    let attempt = candidate.try_acquire(&lease("candidate")).await;
    assert!(
        matches!(attempt, Ok(Some(Acquisition::Held { .. }))),
        "a candidate took the lease its holder had just renewed: {attempt:?}"
    );
}

/// `reset_connection=false` would let the pool hand the lock a session another user changed:
/// the store refuses it, naming the setting.
#[tokio::test]
async fn a_pool_without_reset_is_refused() {
    if common::admin().await.is_none() {
        return;
    }
    let mut url = url::Url::parse(&common::mysql_url()).expect("MYSQL_URL");
    url.query_pairs_mut()
        .append_pair("reset_connection", "false");
    let err = MysqlStore::connect(url.as_str())
        .await
        .expect_err("a pool that does not reset returned connections");
    assert!(
        matches!(&err, LockError::Misconfigured { message, .. } if message.contains("reset_connection")),
        "{err}"
    );
    url.query_pairs_mut().clear();
    url.query_pairs_mut()
        .append_pair("reset_connection", "true");
    MysqlStore::connect(url.as_str())
        .await
        .expect("reset_connection=true is the default");
}
