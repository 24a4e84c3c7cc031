//! A Redis in cluster mode (Redis Cluster, MemoryDB, ElastiCache or Valkey with cluster mode
//! on, even with a single shard) runs a script only over keys of one hash slot, and refuses
//! others with `CROSSSLOT`. One election's keys share a slot; a shard set's batches span many,
//! so the set falls back to a request per record. On a private `redis-server` in cluster mode
//! that serves every slot itself.

mod common;

use std::time::{Duration, Instant};

use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn locks_and_lock_sets_conform_on_a_server_in_cluster_mode() {
    let nodes = format!("leader-redis-cluster-{:08x}.conf", fastrand::u32(..));
    // The cluster bus on a free port of its own (by default the port plus 10000, which may be
    // taken).
    let bus = leader_test_support::free_port().to_string();
    let Some(server) = common::PrivateServer::start_with(|_| {
        [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &nodes,
            "--cluster-port",
            &bus,
        ]
        .map(str::to_owned)
        .to_vec()
    })
    .await
    else {
        return;
    };
    let _nodes_file = RemovedOnDrop(std::path::Path::new("/tmp").join(&nodes));
    let mut admin = server.admin().await.expect("connect");
    let _: () = redis::cmd("CLUSTER")
        .arg("ADDSLOTSRANGE")
        .arg(0)
        .arg(16383)
        .query_async(&mut admin)
        .await
        .expect("CLUSTER ADDSLOTSRANGE");
    let started = Instant::now();
    loop {
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut admin)
            .await
            .expect("CLUSTER INFO");
        if info.contains("cluster_state:ok") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the cluster never served its slots: {info}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let store = leader_redis::RedisStore::connect(server.url.clone())
        .await
        .expect("store");
    let factory = common::Factory {
        store,
        server: Some(server.url.clone()),
    };
    conformance::run_all(&factory).await;
}

/// Removes the cluster's node file when the test ends.
struct RemovedOnDrop(std::path::PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
