//! A server whose `wait_timeout` is shorter than the retry period, so that it drops every idle
//! session between two renewals: a MariaDB of the test's own, started with `--wait-timeout=1`
//! (the shared server's global settings stay as they are). The table lock's leader keeps its
//! term, since the driver reads each session's `wait_timeout` and never hands out a pooled
//! connection idle for longer; the `GET_LOCK` lock's holder keeps its term, since it sets its
//! own session's timeouts. Skipped without `mariadbd`, a failure under `CI=true`.

mod common;

use std::time::Duration;

use common::Running;
use common::private::PrivateServer;
use leader_core::ResourceLock;
use leader_mysql::mysql_async::prelude::Queryable;

/// Leads with `lock`, renewing every 1.5 s, past its renew deadline (4.5 s): the same term
/// throughout, and no failed request.
async fn keeps_its_term(lock: impl ResourceLock + 'static) {
    let mut leader = Running::start_with(lock, Duration::from_millis(1500));
    let token = leader.wait_leading(Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        leader.leading_token(),
        Some(token),
        "{:?}",
        leader.stopped()
    );
    assert!(
        leader.status.last_error().is_none(),
        "{:?}",
        leader.status.last_error()
    );
    assert!(
        leader.stop().await.len() == 1,
        "one term, ended by the shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_wait_timeout_below_the_retry_period_costs_no_term() {
    let args = ["--wait-timeout=1".to_owned()];
    let Some((_server, _admin, store)) = PrivateServer::with_store("wait-timeout", &args).await
    else {
        return;
    };
    let mut conn = store.pool().get_conn().await.expect("a pooled connection");
    let timeout: Option<u64> = conn
        .query_first("SELECT @@SESSION.wait_timeout")
        .await
        .expect("wait_timeout");
    assert_eq!(timeout, Some(1), "the case at hand");
    drop(conn);

    keeps_its_term(store.lock("table", "a")).await;
    keeps_its_term(store.named_lock("named", "a")).await;
}
