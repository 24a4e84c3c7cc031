//! A Redis that evicts keys when its memory is full is refused (S15): when the store is built,
//! and at a term's start once `CONFIG SET` made it so on a running server. On a private
//! `redis-server` of its own, so that changing its settings touches no other test.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use leader_core::conformance::record;
use leader_core::{LockError, ResourceLock};
use leader_redis::RedisStore;

/// A `redis-server` on a free loopback port, stopped when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn server() -> Server {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args(["--save", "", "--appendonly", "no", "--dir", "/tmp"])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server");
    let url = format!("redis://127.0.0.1:{port}");
    let server = Server { child, url };
    let client = redis::Client::open(server.url.as_str()).expect("URL");
    for _ in 0..100 {
        if client.get_multiplexed_async_connection().await.is_ok() {
            return server;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the private redis-server did not start");
}

async fn config_set(url: &str, name: &str, value: &str) {
    let client = redis::Client::open(url).expect("URL");
    let mut admin = client
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
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        leader_test_support::skip_or_fail!("no redis-server on the PATH to start a private server");
    }
    let server = server().await;
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
        let err = lock
            .try_acquire(&record("a", 0))
            .await
            .expect_err("a term's start on a server that evicts keys");
        assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains(policy) && message.contains("noeviction"),
            "{message}"
        );
        // The lease taken for the check is given back at once.
        let stored = lock.get().await.expect("get").expect("the record");
        assert!(stored.record.is_free(), "{:?}", stored.record);

        let err = RedisStore::connect(server.url.clone())
            .await
            .expect_err("built on a server that evicts keys");
        assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
        assert!(err.to_string().contains(policy), "{err}");
    }
    config_set(&server.url, "maxmemory-policy", "noeviction").await;
    RedisStore::connect(server.url.clone())
        .await
        .expect("noeviction");
}
