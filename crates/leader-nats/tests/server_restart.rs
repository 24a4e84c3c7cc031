//! A server of the test's own killed and started again under running electors (S9): the
//! leader steps down by its renew deadline, nobody leads while the server is down, the
//! electors keep trying (backing off) and one leads again once it is back, with a token above
//! the one before (the bucket is on disk).

mod common;

use std::time::Duration;

use common::{RETRY, Server, unique};
use leader_core::ResourceLock;
use leader_nats::NatsStore;
use leader_test_support::{assert_outage_handled, leader_and_follower, next_leader};
use tokio::time::{Instant, sleep};

/// A server of the test's own and a store on it that waits a second for an answer; `None`
/// (outside CI) without a `nats-server` binary.
async fn server_and_store() -> Option<(Server, NatsStore)> {
    let server = Server::start(None)?;
    let store = common::builder(&server.url())
        .create_bucket(true)
        .build()
        .await
        .expect("store");
    Some((server, store))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_step_down_while_nats_is_down_and_recover_when_it_is_back() {
    let Some((mut server, store)) = server_and_store().await else {
        return;
    };
    let name = unique("restart");
    let (leader, token, term, follower) =
        leader_and_follower(store.lock(&name, "first"), store.lock(&name, "second")).await;
    sleep(RETRY * 2).await;

    let stopped = Instant::now();
    server.kill();
    let probe = store.lock(&name, "probe").get().await;
    assert_outage_handled(probe, term, stopped, &[&leader, &follower]).await;

    server.restart();
    let next = next_leader(&[&leader, &follower], Duration::from_secs(30)).await;
    assert!(
        next > token,
        "token {next} after the restart, {token} before"
    );
    assert!(leader.leading_token().is_none() || follower.leading_token().is_none());
    follower.stop().await;
    leader.stop().await;
}

/// A change stream opened while the client is cut off waits for it to connect again, then
/// fires once: a follower backing off during an outage tries again as soon as the server is
/// back, not at the end of its back-off (a lease, at the longest) plus the client's reconnect
/// delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_stream_opened_during_an_outage_fires_when_the_client_is_back() {
    use futures_util::StreamExt;
    let Some((mut server, store)) = server_and_store().await else {
        return;
    };
    let lock = store.lock(unique("outage-watch"), "follower");
    lock.get().await.expect("the bucket");
    server.kill();
    // The client notices the lost connection.
    sleep(Duration::from_millis(500)).await;
    let mut changes = tokio::time::timeout(Duration::from_secs(1), lock.watch())
        .await
        .expect("no request is made while the client is cut off")
        .expect("a stream, not an error")
        .expect("NATS has change notifications");
    let early = tokio::time::timeout(Duration::from_secs(2), changes.next()).await;
    assert!(early.is_err(), "it fired while the server was down");
    server.restart();
    let back = Instant::now();
    let woken = tokio::time::timeout(Duration::from_secs(10), changes.next())
        .await
        .expect("fired once the client was back");
    assert_eq!(woken, Some(()));
    // The client's reconnect delay (at most MAX_RECONNECT_DELAY) and the server's start.
    eprintln!("fired {:?} after the restart", back.elapsed());
    assert!(back.elapsed() < leader_nats::MAX_RECONNECT_DELAY + Duration::from_secs(5));
}
