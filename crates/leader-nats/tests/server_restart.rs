//! A server of the test's own killed and started again under running electors (S9): the
//! leader steps down by its renew deadline, nobody leads while the server is down, the
//! electors keep trying (backing off) and one leads again once it is back, with a token above
//! the one before (the bucket is on disk).

mod common;

use std::time::Duration;

use common::{RETRY, Running, Server, unique};
use leader_core::ResourceLock;
use leader_nats::NatsStore;
use leader_test_support::{assert_outage_handled, next_leader};
use tokio::time::{Instant, sleep};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_step_down_while_nats_is_down_and_recover_when_it_is_back() {
    let Some(mut server) = Server::start(None) else {
        return;
    };
    let store = NatsStore::builder(server.url())
        .create_bucket(true)
        .request_timeout(Duration::from_secs(1))
        .build()
        .await
        .expect("store");
    let name = unique("restart");
    let mut leader = Running::start(store.lock(&name, "first"));
    let token = leader.wait_leading(Duration::from_secs(10)).await;
    let term = leader.term().expect("leading");
    let follower = Running::start(store.lock(&name, "second"));
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
