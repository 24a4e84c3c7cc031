//! A Redis that evicts keys when its memory is full is refused (S15): when the store is built,
//! and at a term's start once `CONFIG SET` made it so on a running server. On a private
//! `redis-server` of its own, so that changing its settings touches no other test.

mod common;

use std::time::Duration;

use leader_core::ResourceLock;
use leader_core::conformance::record;
use leader_redis::RedisStore;
use leader_test_support::assert_misconfigured_saying;

async fn config_set(url: &str, name: &str, value: &str) {
    let mut admin = redis::Client::open(url)
        .expect("URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async(&mut admin)
        .await
        .expect("CONFIG SET");
}

#[tokio::test]
async fn a_server_that_evicts_keys_is_refused_when_built_and_at_a_terms_start() {
    let Some(server) = common::PrivateServer::start().await else {
        return;
    };
    // No memory limit: nothing is ever evicted, whatever the policy.
    config_set(&server.url, "maxmemory-policy", "allkeys-lru").await;
    let store = RedisStore::connect(server.url.clone())
        .await
        .expect("no limit, no eviction");
    let lock = store.lock("evicted", "a");
    let taken = lock
        .try_acquire(&record("a", 0))
        .await
        .expect("try_acquire");
    assert!(taken.and_then(|a| a.acquired().cloned()).is_some());
    lock.update(
        &lock.get().await.expect("get").expect("held").version,
        &record("", 1),
    )
    .await
    .expect("release");

    // A limit with an evicting policy, set on the running server.
    config_set(&server.url, "maxmemory", "1gb").await;
    for policy in ["allkeys-lru", "volatile-ttl"] {
        config_set(&server.url, "maxmemory-policy", policy).await;
        // Past the second a passed check stands for.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        // A term's start on a server that evicts keys.
        assert_misconfigured_saying(
            lock.try_acquire(&record("a", 0)).await,
            &[policy, "noeviction"],
        );
        // The lease taken for the check is given back at once.
        let stored = lock.get().await.expect("get").expect("the record");
        assert!(stored.record.is_free(), "{:?}", stored.record);

        // Built on a server that evicts keys.
        assert_misconfigured_saying(RedisStore::connect(server.url.clone()).await, &[policy]);
    }
    config_set(&server.url, "maxmemory-policy", "noeviction").await;
    RedisStore::connect(server.url.clone())
        .await
        .expect("noeviction");
}
