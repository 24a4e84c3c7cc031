//! Electors on one real etcd: exactly one leads, a revoked etcd lease, a fast handover, the
//! waiting candidates a release hands the lease to.

mod common;

use leader_test_support::started_leading;
use std::time::Duration;

use common::{Factory, RETRY, Running, unique};
use leader_core::conformance;
use leader_core::{LeaderElectionRecord, ResourceLock};
use tokio::time::{Instant, sleep, timeout};

/// Two and ten electors each elect exactly one; a release wakes the followers (a watch), and
/// one takes over well within a retry period.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::electors(&Factory { store }, true).await;
}

/// The holder's etcd lease is revoked by hand (as `etcdctl lease revoke` would): its key is
/// gone, the holder steps down at its next renewal, and another takes over with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_lease_makes_the_holder_step_down_and_another_take_over() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("revoke");
    let holder_lock = store.lock(&name, "first");
    let lease_of = holder_lock.clone();
    let (holder, token) = started_leading(holder_lock).await;
    let term = holder.term().expect("leading");
    let mut follower = Running::start(store.lock(&name, "second"));
    sleep(RETRY * 3 / 2).await; // mid-way between two renewals
    let lease = lease_of
        .lease_id()
        .await
        .expect("the holder has an etcd lease");
    store
        .client()
        .await
        .expect("etcd client")
        .lease_revoke(lease)
        .await
        .expect("revoke");
    let revoked = Instant::now();
    timeout(RETRY * 2 + Duration::from_millis(200), term.cancelled())
        .await
        .expect("the holder steps down at its next renewal");
    eprintln!("stepped down {:?} after the revoke", revoked.elapsed());
    // The follower's watch sees the key vanish and takes over before the holder's next renewal.
    let next = follower.wait_leading(Duration::from_secs(5)).await;
    assert!(holder.leading_token().is_none(), "both lead");
    assert!(next > token, "fencing token {token} then {next}");
    holder.stop().await;
    follower.stop().await;
}

/// The messages etcd received so far (`grpc_server_msg_received_total`, every method).
fn received(port: u16) -> u64 {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics");
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").expect("request");
    let mut body = String::new();
    stream.read_to_string(&mut body).expect("metrics");
    body.lines()
        .filter(|line| line.starts_with("grpc_server_msg_received_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A renewal is the lease's keep-alive alone, one message, while nobody else wrote the key;
/// after someone did (a handover request), a renewal from before that write conflicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_is_one_message_while_the_key_is_untouched() {
    let Some(etcd) = common::PrivateEtcd::start() else {
        return;
    };
    let store = leader_etcd::EtcdStore::connect([etcd.endpoint()])
        .await
        .expect("store");
    let lock = store.lock("renewals", "a");
    let mut record = leader_core::conformance::record("a", 0);
    record.lease_duration = Duration::from_secs(5);
    let Some(leader_core::Acquisition::Acquired(mut held)) =
        lock.try_acquire(&record).await.expect("try_acquire")
    else {
        panic!("a free lease is taken");
    };
    // The holder's watch of its key starts in the background.
    sleep(Duration::from_millis(300)).await;
    let before = received(etcd.client_port);
    for _ in 0..20 {
        held = lock
            .renew(&held.version, &held.record)
            .await
            .expect("renew");
    }
    let messages = received(etcd.client_port) - before;
    assert!(
        messages <= 21,
        "{messages} messages for 20 renewals: a renewal must be one keep-alive"
    );
    let other = store.lock("renewals", "operator");
    leader_core::request_handover(&other, "b")
        .await
        .expect("request");
    sleep(Duration::from_millis(100)).await;
    let stale = lock.renew(&held.version, &held.record).await;
    assert!(
        stale
            .as_ref()
            .is_err_and(leader_core::LockError::is_conflict),
        "a renewal after someone else's write conflicts: {stale:?}"
    );
}

/// What etcd holds at `key`.
async fn read(store: &leader_etcd::EtcdStore, key: &str) -> etcd_client::GetResponse {
    store
        .client()
        .await
        .expect("etcd client")
        .get(key, None)
        .await
        .expect("read the key")
}

/// The record at `key`, parsed, or `None` when absent.
async fn record_at(store: &leader_etcd::EtcdStore, key: &str) -> Option<LeaderElectionRecord> {
    read(store, key)
        .await
        .kvs()
        .first()
        .map(|kv| LeaderElectionRecord::from_json("etcd", key, kv.value()).expect("a record"))
}

/// Waits until `key` exists (`present`) or is gone, for at most `within`.
async fn wait_for_key(store: &leader_etcd::EtcdStore, key: &str, present: bool, within: Duration) {
    let since = Instant::now();
    while read(store, key).await.kvs().is_empty() == present {
        assert!(
            since.elapsed() < within,
            "{key} still {} after {within:?}",
            if present { "absent" } else { "present" }
        );
        sleep(Duration::from_millis(20)).await;
    }
}

/// A release hands the lease to the candidate that has waited longest, in the release's own
/// transaction: the record names it, with a larger token, before it does anything, and the one
/// that came later keeps waiting. A candidate that stops takes its registration with it, and a
/// release with nobody waiting frees the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_hands_the_lease_to_the_longest_waiting_candidate() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("queue");
    let first = store.lock(&name, "a");
    let key = first.key().to_owned();
    let waiting = |identity: &str| format!("{key}.candidates/{identity}");
    let (a, token) = started_leading(first).await;
    // b registers while a leads, then c.
    let mut b = Running::start(store.lock(&name, "b"));
    wait_for_key(&store, &waiting("b"), true, Duration::from_secs(10)).await;
    let c = Running::start(store.lock(&name, "c"));
    wait_for_key(&store, &waiting("c"), true, Duration::from_secs(10)).await;

    a.stop().await;
    let handed = record_at(&store, &key).await.expect("the record");
    assert_eq!(handed.holder_identity, "b", "handed to the longest-waiting");
    assert!(handed.leader_transitions > token);
    let next = b.wait_leading(Duration::from_secs(5)).await;
    assert!(next > token, "fencing token {token} then {next}");
    assert!(c.leading_token().is_none());
    wait_for_key(&store, &waiting("b"), false, Duration::from_secs(1)).await;

    // c stops: it revokes its lease, and its registration goes at once (well before the lease
    // would run out), so b's release frees the lease.
    c.stop().await;
    wait_for_key(&store, &waiting("c"), false, common::LEASE / 3).await;
    b.stop().await;
    let released = record_at(&store, &key).await.expect("the record");
    assert!(released.is_free(), "released to nobody: {released:?}");
}

/// A follower's change stream ends when etcd cancels its watch, so that the elector watches
/// again instead of waiting on a watch that reports nothing more. etcd cancels a watcher that
/// fell behind revisions compacted since (`server/storage/mvcc/watchable_store.go`: a watcher
/// whose channel is full leaves the synced group; once behind the compacted revision it is sent
/// a compacted response and removed, which `v3rpc/watch.go` reports as canceled). Here the
/// stream is left unread while 400 writes of 32 KiB fill the watcher's channel, then the
/// server compacts. A server of the test's own, so that the compaction reaches no other test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_stream_ends_when_etcd_cancels_its_watch() {
    use futures_util::StreamExt;
    let Some(cluster) = leader_test_support::etcd_cluster::EtcdCluster::start(1) else {
        return;
    };
    let store = leader_etcd::EtcdStore::builder(cluster.endpoints())
        .build()
        .await
        .expect("a store on the server");
    let lock = store.lock(unique("canceled"), "follower");
    let mut changes = lock.watch().await.expect("watch").expect("a change stream");
    let mut client = store.client().await.expect("etcd client");
    // Not a record: the follower acts on every such write (its next read reports it).
    let value = vec![b'x'; 32 * 1024];
    let mut revision = 0;
    for _ in 0..400 {
        let put = client
            .put(lock.key(), value.clone(), None)
            .await
            .expect("a write");
        revision = put.header().expect("a header").revision();
    }
    client
        .compact(revision, None)
        .await
        .expect("compact the writes");
    let mut woken = 0;
    let ended = timeout(Duration::from_secs(30), async {
        while changes.next().await.is_some() {
            woken += 1;
        }
    })
    .await;
    assert!(
        ended.is_ok(),
        "the change stream goes on after etcd canceled its watch ({woken} changes reported)"
    );
}
