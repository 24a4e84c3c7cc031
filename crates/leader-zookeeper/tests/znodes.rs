//! What the lock keeps in ZooKeeper, read back from the ensemble: the record znode ephemeral on
//! the holder's session, tokens that outlive the record and the election znode, a renewal that
//! is one request and moves the version, and a watch that fires for what followers act on and
//! not for renewals.

mod common;

use std::time::Duration;

use common::unique;
use leader_core::{LockError, ResourceLock, conformance, request_handover};
use leader_test_support::record_writes::{created, released};
use leader_test_support::zookeeper_ensemble::ZooKeeperEnsemble;
use leader_zookeeper::ZooKeeperStore;
use leader_zookeeper::zookeeper_client as zk;
use tokio::time::{sleep, timeout};

/// Waits until the znode at `path` is gone, for at most 10 s; `stayed` says what failed if not.
async fn wait_gone(client: &zk::Client, path: &str, stayed: &str) {
    let since = tokio::time::Instant::now();
    while client.check_stat(path).await.expect("stat").is_some() {
        assert!(since.elapsed() < Duration::from_secs(10), "{stayed}");
        sleep(Duration::from_millis(20)).await;
    }
}

/// Deletes `lock`'s record znode and its election znode, as an operator's `deleteall` does.
async fn delete_election(client: &zk::Client, lock: &leader_zookeeper::ZooKeeperLock) {
    client
        .delete(lock.record_path(), None)
        .await
        .expect("delete the record");
    client
        .delete(lock.path(), None)
        .await
        .expect("delete the election znode");
}

/// The holder's record znode is ephemeral on its session; the session's end (its store
/// dropped, as a process that exits) deletes it, and the next holder's token is still one more
/// than the last. An operator who deletes the election znode with its count does not take a
/// running lock's tokens back either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_outlive_the_record_znode_and_the_election_znode() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("tokens");
    let first_store = common::store().await.expect("store");
    let first = first_store.lock(&name, "a");
    let first_term = created(&first).await;
    let session = first_store.client().await.expect("session").session_id();
    let client = store.client().await.expect("session");
    let stat = client
        .check_stat(first.record_path())
        .await
        .expect("stat")
        .expect("the record znode");
    assert_eq!(
        stat.ephemeral_owner, session.0,
        "not ephemeral on the holder's session"
    );
    drop(first);
    drop(first_store);
    let record_path = store.lock(&name, "x").record_path().to_owned();
    wait_gone(&client, &record_path, "the record outlived its session").await;
    let second = store.lock(&name, "b");
    assert_eq!(second.get().await.expect("get"), None);
    let taken = created(&second).await;
    assert_eq!(
        taken.record.leader_transitions,
        first_term.record.leader_transitions + 1
    );

    // An operator deletes the whole election (deleteall): this lock object still gives out
    // larger tokens.
    delete_election(&client, &second).await;
    let again = created(&second).await;
    assert!(again.record.leader_transitions > taken.record.leader_transitions);
}

/// A renewal is one request (a `multi`) that moves the version, also when it writes the same
/// bytes; after a handover request written by someone else, a renewal from before it conflicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_is_one_request_and_moves_the_version() {
    let Some((ensemble, store)) = common::private_store().await else {
        return;
    };
    let lock = store.lock("renewals", "a");
    let mut held = created(&lock).await;
    let count = ensemble.count_requests();
    for _ in 0..20 {
        let version = held.version.clone();
        held = lock
            .renew(&held.version, &held.record)
            .await
            .expect("renew");
        assert_ne!(
            held.version, version,
            "a renewal of the same bytes left the version"
        );
    }
    let requests = ensemble.requests(&count);
    assert!(
        requests <= 22,
        "{requests} requests for 20 renewals: a renewal must be one multi"
    );
    let other = store.lock("renewals", "operator");
    request_handover(&other, "b").await.expect("request");
    let stale = lock.renew(&held.version, &held.record).await;
    conformance::assert_conflict("a renewal after someone else's write conflicts", &stale);
}

/// A follower's watch fires when the record is released and when a handover is requested,
/// and not for renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_fires_for_releases_and_handover_requests_not_renewals() {
    use futures_util::StreamExt;
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("watch");
    let holder = store.lock(&name, "a");
    let mut held = created(&holder).await;
    let follower = common::store().await.expect("store").lock(&name, "b");
    let mut changes = follower.watch().await.expect("watch").expect("a stream");
    for _ in 0..5 {
        held = holder
            .renew(&held.version, &held.record)
            .await
            .expect("renew");
    }
    assert!(
        timeout(Duration::from_millis(500), changes.next())
            .await
            .is_err(),
        "a renewal woke the follower"
    );
    request_handover(&follower, "b").await.expect("request");
    timeout(Duration::from_secs(5), changes.next())
        .await
        .expect("a handover request wakes the followers");
    // The holder's session may be on another server of the ensemble, which may not have
    // applied the request yet (ZooKeeper's reads are not linearizable): release what it reads
    // once it reads the request.
    let held = timeout(Duration::from_secs(5), async {
        loop {
            let held = holder.get().await.expect("get").expect("the record");
            if held.record.handover_to() == Some("b") {
                break held;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the holder reads the request");
    released(&holder, &held).await;
    timeout(Duration::from_secs(5), changes.next())
        .await
        .expect("a release wakes the followers");
    let client = store.client().await.expect("session");
    let stat = client
        .check_stat(holder.record_path())
        .await
        .expect("stat")
        .expect("the released record");
    assert_eq!(stat.ephemeral_owner, 0, "a released record is persistent");
}

/// A shard set reads many records in one request and renews them in one: a renewal that lost
/// its compare-and-set (someone asked its holder to hand over) is answered as a conflict, and
/// the others are renewed in one more request; a batch stale whole is answered in a few.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_reads_and_renews_many_records_a_request_at_a_time() {
    use leader_core::LockSet;
    use leader_core::backend::Renewal;
    let Some((ensemble, store)) = common::private_store().await else {
        return;
    };
    let set = store.lock_set("a");
    let keys: Vec<String> = (0..100).map(|i| format!("shard-{i}")).collect();
    let mut renewals = Vec::new();
    for key in &keys {
        let held = created(&set.lock(key)).await;
        renewals.push(Renewal {
            key: key.clone(),
            version: held.version,
            record: held.record,
        });
    }
    request_handover(&store.lock("shard-50", "operator"), "b")
        .await
        .expect("request");

    let count = ensemble.count_requests();
    let read = set.get_many(&keys).await;
    let reads = ensemble.requests(&count);
    assert!(read.iter().all(|r| matches!(r, Ok(Some(_)))), "{read:?}");
    assert!(reads <= 1, "{reads} requests to read 100 records");

    let count = ensemble.count_requests();
    let renewed = set.renew_many(&renewals).await;
    let requests = ensemble.requests(&count);
    assert!(requests <= 2, "{requests} requests to renew 100 records");
    for (i, (answer, renewal)) in renewed.iter().zip(&renewals).enumerate() {
        if i == 50 {
            conformance::assert_conflict("shard 50", answer);
        } else {
            let answer = answer.as_ref().expect("renewed");
            assert_ne!(answer.version, renewal.version, "shard {i} not renewed");
            let stored = set
                .lock(&renewal.key)
                .get()
                .await
                .expect("get")
                .expect("record");
            assert_eq!(stored.version, answer.version, "shard {i}");
        }
    }

    // The same renewals again, every version stale now, as after a round whose answer was
    // lost: conflicts, which the set reads again, after a few requests, not one per renewal.
    let count = ensemble.count_requests();
    let stale = set.renew_many(&renewals).await;
    let requests = ensemble.requests(&count);
    assert!(
        requests <= 4,
        "{requests} requests to answer 100 stale renewals"
    );
    for answer in &stale {
        conformance::assert_conflict("a stale renewal", answer);
    }
}

/// In a batch read, an election whose znode cannot be read is answered so, and the elections
/// read after it in the same request are answered as their own locks would answer them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_election_in_a_batch_read_leaves_the_others_theirs() {
    use leader_core::LockSet;
    let Some(store) = common::store().await else {
        return;
    };
    let set = store.lock_set("a");
    let keys: Vec<String> = (0..3).map(|i| unique(&format!("batch-{i}"))).collect();
    for key in &keys {
        created(&set.lock(key)).await;
    }
    let broken = store.lock(&keys[0], "x");
    let client = store.client().await.expect("session");
    client
        .set_data(broken.path(), b"not a count", None)
        .await
        .expect("an operator's write");
    let read = set.get_many(&keys).await;
    assert!(
        matches!(read[0], Err(LockError::InvalidRecord { .. })),
        "{:?}",
        read[0]
    );
    for (key, answer) in keys.iter().zip(&read).skip(1) {
        let alone = store.lock(key, "a").get().await.expect("get");
        assert_eq!(answer.as_ref().expect("read"), &alone, "{key}");
    }
}

/// A renewal never starts a term: the holder's record znode owned by another session (the
/// same identity elsewhere) is a conflict, and the record stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_of_a_record_another_session_owns_conflicts() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("renew-other");
    let held = created(&store.lock(&name, "a")).await;
    let elsewhere = common::store().await.expect("store").lock(&name, "a");
    let renewed = elsewhere.renew(&held.version, &held.record).await;
    conformance::assert_conflict("a renewal from another session", &renewed);
    assert_eq!(store.lock(&name, "a").get().await.expect("get"), Some(held));
}

/// A prefix an operator deleted is made again by the next creation, instead of every creation
/// failing as if another had won it. The deletion is made through one server and the creation
/// through another, many times over: the second may not have applied a deletion the first
/// already answered, which once failed the creation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_prefix_is_made_again() {
    let Some(client) = common::raw().await else {
        return;
    };
    common::make_chroot(&client, "").await;
    let ensemble = common::zookeeper_ensemble();
    let servers: Vec<&str> = ensemble.split(',').collect();
    let operator = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .connect(servers[servers.len() - 1])
        .await
        .expect("a session on the last server");
    for round in 0..20 {
        let prefix = format!("/{}", unique("prefix"));
        let store = ZooKeeperStore::builder(servers[0])
            .chroot(common::zookeeper_chroot())
            .prefix(&prefix)
            .build()
            .await
            .expect("store");
        // The operator's server may not have applied the prefix's creation yet.
        operator.sync("/").await.expect("sync");
        operator
            .delete(&format!("{}{prefix}", common::zookeeper_chroot()), None)
            .await
            .expect("delete the prefix");
        store
            .lock("again", "a")
            .create(&conformance::record("a", 1))
            .await
            .unwrap_or_else(|err| {
                panic!("round {round}: created under the prefix made again: {err:?}")
            });
    }
}

/// Tokens never repeat: with the count one below `u64::MAX`, an acquisition gets `u64::MAX`,
/// and the next one is refused (an invalid record, reported) instead of getting it again; an
/// election whose count is `u64::MAX` is refused its first acquisition too. Nothing is
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_refused_rather_than_repeated_at_the_top() {
    let Some(store) = common::store().await else {
        return;
    };
    let client = store.client().await.expect("session");
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let name = unique("top");
    let a = store.lock(&name, "a");
    client
        .create(a.path(), (u64::MAX - 1).to_string().as_bytes(), &persistent)
        .await
        .expect("an election znode near the top");
    let held = a
        .create(&conformance::record("a", 1))
        .await
        .expect("the last token");
    assert_eq!(held.record.leader_transitions, u64::MAX);
    let free = released(&a, &held).await;
    let b = common::store().await.expect("store").lock(&name, "b");
    let err = b
        .update(&free.version, &conformance::record("b", 1))
        .await
        .expect_err("no token above u64::MAX");
    assert!(matches!(err, LockError::InvalidRecord { .. }), "{err:?}");
    assert!(err.to_string().contains("used up"), "{err}");
    assert_eq!(b.get().await.expect("get"), Some(free), "it wrote");

    let name = unique("top");
    let c = store.lock(&name, "c");
    client
        .create(c.path(), u64::MAX.to_string().as_bytes(), &persistent)
        .await
        .expect("an election znode at the top");
    let err = c
        .create(&conformance::record("c", 1))
        .await
        .expect_err("no token above u64::MAX");
    assert!(matches!(err, LockError::InvalidRecord { .. }), "{err:?}");
    assert_eq!(c.get().await.expect("get"), None, "it wrote");
}

/// An operator deletes an election's znodes (deleteall): a process started after that, which
/// never saw the old tokens, still gives out a larger one (the count is seeded from the
/// prefix's pzxid, a zxid at or above the deletion's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_counts_on_after_the_election_znode_is_deleted() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("deleted");
    let a = store.lock(&name, "a");
    let mut held = created(&a).await;
    for _ in 0..3 {
        let free = released(&a, &held).await;
        let mut again = conformance::record("a", free.record.leader_transitions + 1);
        again.acquire_time = free.record.renew_time;
        held = a.update(&free.version, &again).await.expect("acquire");
    }
    let client = store.client().await.expect("session");
    delete_election(&client, &a).await;
    let fresh = common::store().await.expect("store").lock(&name, "b");
    let taken = created(&fresh).await;
    assert!(
        taken.record.leader_transitions > held.record.leader_transitions,
        "token {} after {}",
        taken.record.leader_transitions,
        held.record.leader_transitions
    );
}

/// An update from another session of the same identity, with the stored term's token, is no
/// renewal of that term (its record znode is another session's) and starts none either: a
/// conflict, as a renewal gets, and the record stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_of_another_sessions_term_with_its_token_conflicts() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("update-other");
    let held = created(&store.lock(&name, "a")).await;
    let elsewhere = common::store().await.expect("store").lock(&name, "a");
    let mut record = held.record.clone();
    record.renew_time = record.renewal_time(record.renew_time);
    record
        .extensions
        .insert("note".to_owned(), "elsewhere".to_owned());
    let updated = elsewhere.update(&held.version, &record).await;
    conformance::assert_conflict("an update from another session", &updated);
    let renewed = elsewhere.renew(&held.version, &record).await;
    conformance::assert_conflict("a renewal from another session", &renewed);
    assert_eq!(store.lock(&name, "a").get().await.expect("get"), Some(held));
}

/// Election znodes are containers: once a holder's session ends and nobody takes its place,
/// the ensemble deletes the empty election znode (here within a second; a minute by default),
/// and the next acquisition's token is still larger. A released record (persistent, like a
/// shard set's roster) keeps its election znode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_election_znodes_are_removed_and_tokens_still_grow() {
    let Some(ensemble) =
        ZooKeeperEnsemble::start_with(1, "", &["znode.container.checkIntervalMs=200"])
    else {
        return;
    };
    let open = || async {
        ZooKeeperStore::builder(ensemble.connect_string())
            .build()
            .await
            .expect("store")
    };
    let store = open().await;
    let client = store.client().await.expect("session");

    let gone = open().await;
    let first = created(&gone.lock("member-1", "a")).await;
    let kept = store.lock("roster", "a");
    let held = created(&kept).await;
    released(&kept, &held).await;
    // The member's process ends: its session closes, its record znode goes.
    drop(gone);
    let path = store.lock("member-1", "x").path().to_owned();
    wait_gone(&client, &path, "the empty election znode stayed").await;
    assert!(
        client
            .check_stat(kept.path())
            .await
            .expect("stat")
            .is_some(),
        "a released record's election znode was removed"
    );
    let next = created(&open().await.lock("member-1", "b")).await;
    assert!(
        next.record.leader_transitions > first.record.leader_transitions,
        "token {} after {}",
        next.record.leader_transitions,
        first.record.leader_transitions
    );
}
