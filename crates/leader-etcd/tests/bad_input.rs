//! Bad input against real etcd servers: a value that is not a record, wrong credentials, an
//! election named as another's own keys, and the server stopped and started again. Each gives a clear typed error, the elector keeps running
//! and recovers, nothing panics or overwrites what it cannot read.

mod common;

use std::time::Duration;

use common::{PrivateEtcd, Running, unique};
use leader_core::ResourceLock;
use leader_etcd::EtcdStore;
use leader_test_support::secrets::assert_wrong_password;
use leader_test_support::{assert_server_down, leader_and_follower, next_leader, unreadable};
use tokio::time::sleep;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_that_is_not_a_record_is_reported_never_overwritten_and_the_elector_recovers() {
    let Some(store) = common::store().await else {
        return;
    };
    let lock = store.lock(unique("garbage"), "a");
    let mut client = store.client().await.expect("etcd client");
    client
        .put(lock.key(), "{\"holderIdentity\": 42}", None)
        .await
        .expect("write garbage");
    let key = lock.key().to_owned();
    let mut elector = unreadable::reported_while_the_elector_waits(lock, "garbage", &key).await;
    let value = client.get(key.as_str(), None).await.expect("get");
    assert_eq!(
        value.kvs()[0].value(),
        b"{\"holderIdentity\": 42}",
        "the value was overwritten"
    );
    client.delete(key.as_str(), None).await.expect("delete");
    elector.wait_leading(Duration::from_secs(5)).await;
    elector.stop().await;
}

/// An election named as a key the lock keeps for another (`NAME.fence`, `NAME.extensions`,
/// `NAME.candidates/...`) is refused, and that election's keys are left as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_named_as_anothers_own_keys_is_refused() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("named");
    let holder = store.lock(&name, "a");
    holder
        .create(&leader_core::conformance::record("a", 1))
        .await
        .expect("a term");
    let client = store.client().await.expect("etcd client");
    let prefix = holder.key().to_owned();
    // Each of the election's keys, with the revision it was last written at.
    let keys = async || -> Vec<(Vec<u8>, i64)> {
        let read = client
            .clone()
            .get(
                prefix.as_str(),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .expect("read the election's keys");
        read.kvs()
            .iter()
            .map(|kv| (kv.key().to_vec(), kv.mod_revision()))
            .collect()
    };
    let before = keys().await;
    assert_eq!(before.len(), 2, "the record and its fence");
    for other in ["fence", "extensions", "candidates/b"] {
        let lock = store.lock(format!("{name}.{other}"), "b");
        let record = leader_core::conformance::record("b", 1);
        for answer in [
            lock.get().await.map(|_| ()),
            lock.create(&record).await.map(|_| ()),
            lock.try_acquire(&record).await.map(|_| ()),
        ] {
            leader_test_support::assert_misconfigured_saying(answer, &[other, "another election"]);
        }
    }
    assert_eq!(keys().await, before, "the election's keys changed");
    holder.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_a_clear_error_that_never_shows_the_password() {
    let Some(etcd) = PrivateEtcd::start() else {
        return;
    };
    etcd.enable_auth("root-password").await;

    let secret = "wr0ng-Pa55word";
    let builder = EtcdStore::builder([etcd.endpoint()]).user("root", secret);
    assert!(
        !format!("{builder:?}").contains(secret),
        "Debug shows the password"
    );
    assert_wrong_password(builder.build().await, secret);

    let store = EtcdStore::builder([etcd.endpoint()])
        .user("root", "root-password")
        .build()
        .await
        .expect("right password");
    let mut elector = Running::start(store.lock("auth", "a"));
    elector.wait_leading(Duration::from_secs(10)).await;
    elector.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn electors_step_down_while_etcd_is_down_and_recover_when_it_is_back() {
    let Some(mut etcd) = PrivateEtcd::start() else {
        return;
    };
    let store = EtcdStore::builder([etcd.endpoint()])
        .timeout(Duration::from_secs(1))
        .build()
        .await
        .expect("connect");
    let name = unique("restart");
    let (leader, token, term, follower) =
        leader_and_follower(store.lock(&name, "first"), store.lock(&name, "second")).await;
    sleep(Duration::from_secs(1)).await;

    etcd.stop();
    assert_server_down(store.lock(&name, "probe").get().await);
    tokio::time::timeout(common::RENEW + common::RETRY * 3, term.cancelled())
        .await
        .expect("the leader steps down by its renew deadline");
    sleep(Duration::from_secs(1)).await;
    for elector in [&leader, &follower] {
        assert!(
            elector.leading_token().is_none(),
            "leads while the server is down"
        );
        assert!(!elector.task.is_finished(), "an elector stopped");
    }

    etcd.resume();
    let next = next_leader(&[&leader, &follower], Duration::from_secs(30)).await;
    // etcd kept its data: revisions, and with them fencing tokens, keep growing.
    assert!(next > token, "fencing token {token} then {next}");
    assert!(leader.leading_token().is_none() || follower.leading_token().is_none());
    follower.stop().await;
    leader.stop().await;
}

/// S9 for the watch a term keeps of its key, which outlives a term that ended at its renew
/// deadline: while etcd is down it connects again after waits that grow, not at a fixed pace.
/// Through a proxy that closes every connection, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terms_watch_backs_off_while_etcd_is_down() {
    use leader_test_support::proxy::{Mode, Proxy};
    let Some(etcd) = PrivateEtcd::start() else {
        return;
    };
    let server = etcd
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .expect("an address");
    let proxy = Proxy::start(server).await.expect("a proxy");
    let store = EtcdStore::builder([format!("http://127.0.0.1:{}", proxy.port())])
        .timeout(Duration::from_secs(1))
        .build()
        .await
        .expect("connect");
    let lock = store.lock(unique("watch"), "a");
    leader_test_support::assert_acquired(
        lock.try_acquire(&leader_core::conformance::record("a", 0))
            .await,
    );
    sleep(Duration::from_millis(500)).await;
    proxy.set(Mode::Down);
    let before = proxy.accepted();
    sleep(Duration::from_secs(12)).await;
    let during = proxy.accepted() - before;
    // Waits from a quarter of the member timeout, doubling to eight member timeouts: 7 in
    // 12 s; at a fixed quarter, 48.
    assert!(during <= 14, "{during} connections in 12 s of an outage");
    drop(lock);
}
