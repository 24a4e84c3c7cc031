//! After the server forgets its scripts (a restart, `SCRIPT FLUSH`), an operation costs one
//! failed `EVALSHA` and one `EVAL`, which caches the script again; the next is one `EVALSHA`.
//! On a private `redis-server`, so no other test's commands mix into the server's counters.

mod common;

use leader_core::ResourceLock;
use leader_core::conformance::record;
use leader_redis::RedisStore;

async fn calls(admin: &mut redis::aio::MultiplexedConnection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .expect("INFO");
    info.lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_flushed_script_is_sent_again_with_eval_once() {
    let Some(server) = common::PrivateServer::start().await else {
        return;
    };
    let store = RedisStore::connect(server.url.clone())
        .await
        .expect("store");
    let mut admin = server.admin().await.expect("server");
    let lock = store.lock(common::unique("script-cache"), "a");
    let created = lock.create(&record("a", 1)).await.expect("create");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut admin)
        .await
        .expect("SCRIPT FLUSH");
    let (evalsha, eval) = (
        calls(&mut admin, "evalsha").await,
        calls(&mut admin, "eval").await,
    );
    let renewed = lock
        .update(&created.version, &record("a", 1))
        .await
        .expect("update after a flush");
    assert_eq!(
        calls(&mut admin, "evalsha").await - evalsha,
        1,
        "one EVALSHA, answered NOSCRIPT"
    );
    assert_eq!(calls(&mut admin, "eval").await - eval, 1, "one EVAL");
    lock.update(&renewed.version, &record("a", 1))
        .await
        .expect("next update");
    assert_eq!(
        calls(&mut admin, "evalsha").await - evalsha,
        2,
        "the next is one EVALSHA"
    );
    assert_eq!(calls(&mut admin, "eval").await - eval, 1, "and no EVAL");
}
