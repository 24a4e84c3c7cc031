//! The lock after its session lost its connection and came back: followers are woken by their
//! watch again, and how long the client takes to come back after an outage.

mod common;

use std::time::Duration;

use leader_core::LeaderElector;
use leader_core::background::Candidate;
use leader_test_support::proxy::{Mode, Proxy};
use leader_test_support::zookeeper_ensemble::{ZooKeeperEnsemble, watches};
use leader_zookeeper::ZooKeeperStore;
use leader_zookeeper::zookeeper_client as zk;
use tokio::time::{Instant, sleep};

/// Waits until server `port` keeps a watch for a client; panics with `what` after `within`.
async fn wait_for_a_watch(port: u16, within: Duration, what: &str) {
    let since = Instant::now();
    while watches(port).unwrap_or(0) == 0 {
        assert!(since.elapsed() < within, "{what} within {within:?}");
        sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `client`'s session is connected again; panics after `within`.
async fn wait_connected(client: &zk::Client, within: Duration) -> Duration {
    let since = Instant::now();
    while client.state() != zk::SessionState::SyncConnected {
        assert!(
            since.elapsed() < within,
            "the session did not come back within {within:?}: {}",
            client.state()
        );
        sleep(Duration::from_millis(5)).await;
    }
    since.elapsed()
}

/// The server a follower's session is on restarts: the server drops the follower's persistent
/// watch with the connection, and the client does not set it again when the session comes
/// back. The lock's change stream ends then, the elector subscribes again, and a release
/// after the reconnect wakes the follower at once, not at its next retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_after_a_reconnect_wakes_the_follower_at_once() {
    let Some(mut ensemble) = ZooKeeperEnsemble::start() else {
        return;
    };
    // A server that does not lead the ensemble: its restart leaves the others serving.
    let restarted = (0..3)
        .find(|i| Some(*i) != ensemble.leader())
        .expect("a follower server");
    let others: Vec<String> = (0..3)
        .filter(|i| *i != restarted)
        .map(|i| format!("127.0.0.1:{}", ensemble.client_port(i)))
        .collect();
    let port = ensemble.client_port(restarted);
    let holder_store = ZooKeeperStore::builder(others.join(","))
        .build()
        .await
        .expect("store");
    let follower_store = ZooKeeperStore::builder(format!("127.0.0.1:{port}"))
        .build()
        .await
        .expect("store");
    let mut holder = Candidate::start_with(
        holder_store.lock("reconnect", "holder"),
        Duration::from_millis(500),
    );
    holder.wait_leading(Duration::from_secs(20)).await;
    // A long retry period: a release seen only at the next retry would take seconds.
    let retry = Duration::from_secs(3);
    let mut follower = Candidate::build(
        LeaderElector::builder(follower_store.lock("reconnect", "follower"))
            .lease_duration(retry * 4)
            .renew_deadline(retry * 3)
            .retry_period(retry),
    );
    wait_for_a_watch(port, Duration::from_secs(10), "the follower watches").await;

    ensemble.restart(restarted);
    let client = follower_store.client().await.expect("session");
    wait_connected(&client, Duration::from_secs(30)).await;
    wait_for_a_watch(
        port,
        retry * 2 + Duration::from_secs(2),
        "the follower's watch is set again after its session came back",
    )
    .await;
    assert!(!follower.is_leading());

    let released = Instant::now();
    holder.stop().await;
    follower.wait_leading(retry).await;
    assert!(
        released.elapsed() < Duration::from_secs(1),
        "the follower took {:?} to see the release",
        released.elapsed()
    );
    follower.stop().await;
}

/// How long the client takes to come back after every server was unreachable (connections
/// refused) for a while: it tries the servers in turn, and waits before each pass over them
/// twice as long as before the last (300 ms for three servers, then 600 ms, 1.2 s, ...), so
/// the session comes back about as long again as the outage lasted, at times more (passes
/// start about 0.3, 1.2, 2.7, 5.3, 10.4 and 20 s after the connection was lost), on the same
/// session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_the_session_comes_back_within_as_long_again() {
    let Some(raw) = common::raw().await else {
        return;
    };
    drop(raw);
    let mut proxies = Vec::new();
    for server in common::zookeeper_ensemble().split(',') {
        let upstream = server.trim().parse().expect("host:port of the ensemble");
        proxies.push(Proxy::start(upstream).await.expect("a proxy port"));
    }
    let connect: Vec<String> = proxies
        .iter()
        .map(|p| format!("127.0.0.1:{}", p.port()))
        .collect();
    let store = ZooKeeperStore::builder(connect.join(","))
        .build()
        .await
        .expect("store");
    let client = store.client().await.expect("session");
    let session = client.session_id();
    for outage in [Duration::from_secs(2), Duration::from_secs(5)] {
        for proxy in &proxies {
            proxy.set(Mode::Down);
        }
        sleep(outage).await;
        for proxy in &proxies {
            proxy.set(Mode::Open);
        }
        let back = wait_connected(&client, Duration::from_secs(20)).await;
        eprintln!("an outage of {outage:?}: the session came back {back:?} after it");
        assert!(
            back < outage * 2 + Duration::from_secs(1),
            "an outage of {outage:?}: the session came back {back:?} after it"
        );
        assert_eq!(client.session_id(), session, "the session was replaced");
    }
}
