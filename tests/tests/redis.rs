//! The Redis lock through what a network does to a long-lived connection.

use std::time::Duration;

use leader_core::LeaderElector;
use leader_core::background::Candidate;
use leader_redis::RedisStore;
use leader_test_support::{connected_or_skip, redis_url, unique};
use leader_tests::harness::proxy::Proxy;
use redis::IntoConnectionInfo;
use tokio::time::sleep;

const LEASE: Duration = Duration::from_secs(4);
const RENEW: Duration = Duration::from_secs(3);
const RETRY: Duration = Duration::from_millis(500);

/// A proxy to the tests' Redis and the URL that goes through it; `None` (a skip outside CI)
/// without a server.
async fn through_a_proxy() -> Option<(Proxy, String)> {
    let url = redis_url();
    let client = redis::Client::open(url.as_str()).expect("REDIS_URL");
    let at = leader_core::redact_url(&url);
    connected_or_skip(
        client.get_multiplexed_async_connection().await,
        "Redis",
        &at,
        "REDIS_URL",
    )?;
    let info = url.as_str().into_connection_info().expect("REDIS_URL");
    let redis::ConnectionAddr::Tcp(host, port) = info.addr().clone() else {
        panic!("REDIS_URL is not a plain TCP address: {at}");
    };
    let upstream = tokio::net::lookup_host((host.as_str(), port))
        .await
        .expect("REDIS_URL's host")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await.expect("a proxy port");
    let server = if url.contains(&format!("{host}:{port}")) {
        format!("{host}:{port}")
    } else {
        host
    };
    let proxied = url.replacen(&server, &format!("127.0.0.1:{}", proxy.port()), 1);
    Some((proxy, proxied))
}

/// A candidate on `lock`, with the tests' timings.
fn candidate(lock: leader_redis::RedisLock) -> Candidate {
    Candidate::build(
        LeaderElector::builder(lock)
            .lease_duration(LEASE)
            .renew_deadline(RENEW)
            .retry_period(RETRY),
    )
}

/// A firewall or NAT between the leader and Redis drops the state of its connection: what the
/// leader sends vanishes, and no reset tells the driver. The request that went unanswered
/// replaces the connection, and the leader's next renewal goes on a new one: it goes on
/// leading (or, on a loaded machine, leads again), instead of failing every request until TCP
/// gives up on the old connection, a quarter of an hour later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_network_dropped_is_replaced() {
    let Some((proxy, url)) = through_a_proxy().await else {
        return;
    };
    let store = RedisStore::builder(url)
        .prefix(format!("{}:", unique("stranded")))
        .build()
        .await
        .expect("store");
    let mut candidate = candidate(store.lock("election", "a"));
    let first = candidate.wait_leading(Duration::from_secs(10)).await;
    let term = candidate.term().expect("leading");
    sleep(RETRY * 2).await;

    proxy.strand();
    sleep(LEASE * 2).await;
    if term.is_cancelled() {
        // Without a new connection it never leads again.
        let second = candidate.wait_leading(LEASE * 4).await;
        assert!(second > first, "fencing token {first} then {second}");
        eprintln!("the term ended, and the next began");
    } else {
        assert!(
            candidate.is_leading(),
            "the term went on, and it does not lead"
        );
        eprintln!("the term went on");
    }
    candidate.stop().await;
}

/// A NAT or firewall drops the state of the follower's pub/sub connection, which is idle while
/// nobody releases or takes the lease: no error reports it, and the follower would be woken by
/// nothing more. A `PING` every 10 s goes unanswered, the follower's change stream ends, and
/// the next watch, on a new connection, hears a release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pubsub_connection_the_network_dropped_is_replaced() {
    use futures_util::StreamExt;
    use leader_core::ResourceLock;
    let Some((proxy, url)) = through_a_proxy().await else {
        return;
    };
    let prefix = format!("{}:", unique("stranded-pubsub"));
    let follower = RedisStore::builder(url)
        .prefix(prefix.clone())
        .build()
        .await
        .expect("store");
    let lock = follower.lock("election", "b");
    let mut changes = lock.watch().await.expect("watch").expect("a change stream");
    proxy.strand();
    // The check's period and its PING's timeout, with a margin.
    let ended = tokio::time::timeout(Duration::from_secs(30), changes.next()).await;
    assert!(
        matches!(ended, Ok(None)),
        "the change stream of a stranded connection goes on"
    );
    let mut changes = lock.watch().await.expect("watch").expect("a change stream");
    let direct = RedisStore::builder(redis_url())
        .prefix(prefix)
        .build()
        .await
        .expect("store");
    let mut leader = candidate(direct.lock("election", "a"));
    leader.wait_leading(Duration::from_secs(10)).await;
    leader.stop().await;
    let woken = tokio::time::timeout(Duration::from_secs(10), changes.next()).await;
    assert!(
        matches!(woken, Ok(Some(()))),
        "a release on the new connection reached the follower: {woken:?}"
    );
}
