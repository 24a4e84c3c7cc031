//! What operators do to running locks: a user with exactly the permissions of `deploy/nats`
//! whose watches carry megabytes of renewals, and a bucket deleted (and created again) while
//! locks use it.

mod common;

use leader_test_support::started_leading;
use std::time::{Duration, Instant};

use common::{Server, builder as store, create_bucket, unique};
use futures_util::StreamExt;
use leader_core::{LockError, Observed, ResourceLock, conformance};
use leader_nats::async_nats::{self, jetstream};
use leader_nats::{DEFAULT_BUCKET, NatsStore};
use leader_test_support::record_writes::created;
use tokio::time::{sleep, timeout};

const STREAM: &str = "KV_leader";

/// A server of the test's own, its URL, and JetStream on it for an operator's changes; `None`
/// (outside CI) without a `nats-server` binary.
async fn server_and_admin() -> Option<(Server, String, jetstream::Context)> {
    let server = Server::start(None)?;
    let url = server.url();
    let admin = jetstream::new(async_nats::connect(&url).await.expect("client"));
    Some((server, url, admin))
}

async fn delete_bucket(admin: &jetstream::Context) {
    admin
        .delete_stream(STREAM)
        .await
        .expect("delete the bucket's stream");
}

/// `count` writes to another key of the bucket, so that its sequence (and the tokens of
/// records created in it) runs well ahead of a bucket created afresh.
async fn write_elsewhere(url: &str, count: usize) {
    let store = store(url).build().await.expect("store");
    let kv = store.kv().await.expect("bucket");
    for i in 0..count {
        kv.put("elsewhere", i.to_string().into())
            .await
            .expect("write another key");
    }
}

/// `observed` renewed by its holder, carrying `padding`.
fn renewal(observed: &Observed, padding: String) -> leader_core::LeaderElectionRecord {
    let mut record = leader_test_support::record_writes::renewal(&observed.record);
    record.extensions.insert("padding".to_owned(), padding);
    record
}

/// A follower's KV watch is an ordered consumer with flow control: after a window of bytes
/// (a few hundred kilobytes to a few megabytes, by server version) the server sends a
/// flow-control request and delivers nothing more until the client answers it on
/// `$JS.FC.<stream>.>`. 3 MiB of renewals (32 KiB records) cross that window, at the holder's
/// usual pace in about an hour and a half at 2 s per renewal; the change of holder after them
/// must still wake the follower, whose user has exactly the permissions of `deploy/nats`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watch_keeps_delivering_past_flow_control_with_the_documented_permissions() {
    let Some(server) = common::documented_server().await else {
        return;
    };
    let app = server.url_as("app", "app-secret");
    let holder_store = store(&app).build().await.expect("store");
    let follower_store = store(&app).build().await.expect("store");
    let name = unique("flow");
    let holder = holder_store.lock(&name, "holder");
    let mut observed = created(&holder).await;
    let mut changes = follower_store
        .lock(&name, "follower")
        .watch()
        .await
        .expect("watch")
        .expect("a watch");
    // The follower reads its watch all along, as an elector does.
    let (woken, mut wakes) = tokio::sync::mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while changes.next().await.is_some() {
            if woken.send(Instant::now()).is_err() {
                break;
            }
        }
    });
    let padding = "x".repeat(32 * 1024);
    for i in 0..96 {
        observed = holder
            .update(
                &observed.version,
                &renewal(&observed, format!("{i}{padding}")),
            )
            .await
            .expect("renew");
    }
    assert!(wakes.try_recv().is_err(), "a renewal woke the follower");
    holder_store
        .lock(&name, "next")
        .update(
            &observed.version,
            &conformance::record("next", observed.record.leader_transitions + 1),
        )
        .await
        .expect("take over");
    timeout(Duration::from_secs(10), wakes.recv())
        .await
        .expect("the watch delivered nothing after 3 MiB of renewals: its flow control stalled")
        .expect("the watch ended");
    reader.abort();
}

/// An operator deletes the bucket under a leader whose store may create it: the lock notices
/// that the stream is gone, looks the bucket up again and creates it, and the elector leads
/// again, with a token above the one before although the new bucket's sequence starts over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bucket_deleted_under_a_leader_is_created_again() {
    let Some((_server, url, admin)) = server_and_admin().await else {
        return;
    };
    let lock_store = store(&url)
        .create_bucket(true)
        .build()
        .await
        .expect("store");
    lock_store.kv().await.expect("bucket");
    write_elsewhere(&url, 50).await;
    let (elector, before) = started_leading(lock_store.lock(unique("deleted"), "a")).await;
    assert!(before > 50, "token {before}");

    delete_bucket(&admin).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let next = loop {
        if let Some(now) = elector.leading_token()
            && now != before
        {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "no new term after the bucket was deleted"
        );
        sleep(Duration::from_millis(50)).await;
    };
    assert!(next > before, "token {next} after {before}: not above");
    let info = admin
        .get_stream(STREAM)
        .await
        .expect("the bucket was created again")
        .cached_info()
        .clone();
    assert_eq!(info.config.max_messages_per_subject, 1);
    elector.stop().await;
}

/// Without the right to create it, a deleted bucket is reported at the caller's pace (one
/// lookup per request, nothing in between) and used again once an operator creates it again;
/// the same lock object's next acquisitions, by a creation or by an update over another
/// candidate's record, get tokens above every one it saw in the bucket deleted, and its
/// renewals keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bucket_created_again_is_used_again_with_tokens_above_the_old_ones() {
    let Some((_server, url, admin)) = server_and_admin().await else {
        return;
    };
    let client = admin.client();
    create_bucket(&url).await;
    write_elsewhere(&url, 50).await;
    let lock_store = store(&url).build().await.expect("store");
    assert_eq!(lock_store.bucket(), DEFAULT_BUCKET);
    let name = unique("again");
    let lock = lock_store.lock(&name, "a");
    let first = created(&lock).await;
    let first_token = first.record.leader_transitions;
    assert!(first_token > 50, "token {first_token}");

    delete_bucket(&admin).await;
    let mut lookups = client
        .subscribe(format!("$JS.API.STREAM.INFO.{STREAM}"))
        .await
        .expect("subscribe");
    client.flush().await.expect("flush");
    let mut last = None;
    for _ in 0..5 {
        last = Some(lock.get().await.expect_err("no bucket"));
    }
    let last = last.expect("an error");
    assert!(matches!(last, LockError::Misconfigured { .. }), "{last:?}");
    assert!(last.to_string().contains("create the bucket"), "{last}");
    // Nothing more while nobody calls.
    sleep(Duration::from_secs(1)).await;
    let mut seen = 0;
    while timeout(Duration::from_millis(100), lookups.next())
        .await
        .is_ok_and(|m| m.is_some())
    {
        seen += 1;
    }
    assert!(
        (1..=5).contains(&seen),
        "{seen} lookups of the bucket for 5 requests"
    );

    create_bucket(&url).await;
    assert_eq!(lock.get().await.expect("get"), None);
    let again = created(&lock).await;
    let second_token = again.record.leader_transitions;
    assert!(
        second_token > first_token,
        "token {second_token} in the bucket created again, after {first_token}"
    );
    // A renewal of that term keeps its token.
    let renewed = lock
        .update(&again.version, &renewal(&again, String::new()))
        .await
        .expect("renew");
    assert_eq!(renewed.record.leader_transitions, second_token);

    // Again, and this time another candidate, which never saw the old bucket, creates the
    // record first; this lock takes it over as an elector does, asking for the next token.
    delete_bucket(&admin).await;
    let _ = lock.get().await;
    create_bucket(&url).await;
    let other = created(&lock_store.lock(&name, "b")).await;
    assert!(other.record.leader_transitions < second_token);
    let seen = lock.get().await.expect("get").expect("b's record");
    let taken = lock
        .update(
            &seen.version,
            &conformance::record("a", seen.record.leader_transitions + 1),
        )
        .await
        .expect("take over");
    assert!(
        taken.record.leader_transitions > second_token,
        "token {} after {second_token}",
        taken.record.leader_transitions
    );
}

/// An operator deletes the bucket and creates it again, and the election's record comes back
/// at the revision it had: a candidate's compare-and-swap on the version it read from the old
/// bucket conflicts (its store had not noticed the deletion: no request of it failed), the
/// record written in the new bucket stays, and a read names it with another version, so that
/// the candidate's wait for the holder's lease starts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_version_of_a_bucket_deleted_and_created_again_matches_no_record_of_the_new_one() {
    let Some((_server, url, admin)) = server_and_admin().await else {
        return;
    };
    create_bucket(&url).await;
    write_elsewhere(&url, 20).await;
    let name = unique("recreated");
    let holder = store(&url).build().await.expect("store");
    let held = created(&holder.lock(&name, "a")).await;
    let candidate = store(&url).build().await.expect("store");
    let candidate_lock = candidate.lock(&name, "b");
    let read = candidate_lock
        .get()
        .await
        .expect("get")
        .expect("a's record");
    assert_eq!(read, held);
    let old = revision(&holder, &name).await;

    delete_bucket(&admin).await;
    create_bucket(&url).await;
    // The key's record comes back at the revision it had: 20 other writes, then the record.
    write_elsewhere(&url, 20).await;
    let newcomer = store(&url).build().await.expect("store");
    let new_record = newcomer
        .lock(&name, "c")
        .create(&conformance::record("c", 1))
        .await
        .expect("create in the new bucket");
    assert_eq!(
        revision(&newcomer, &name).await,
        old,
        "the record is not back at its revision"
    );

    let taken = candidate_lock
        .update(
            &read.version,
            &conformance::record("b", read.record.leader_transitions + 1),
        )
        .await;
    assert!(
        matches!(taken, Err(LockError::Conflict { .. })),
        "a version of the deleted bucket was taken for a record of the new one: {taken:?}"
    );
    assert_eq!(
        newcomer.lock(&name, "c").get().await.expect("get"),
        Some(new_record.clone())
    );
    let seen = candidate_lock
        .get()
        .await
        .expect("get")
        .expect("c's record");
    assert_eq!(seen.record, new_record.record);
    assert_ne!(
        seen.version, read.version,
        "the record of the new bucket has the version of the old one's"
    );
}

/// The revision of election `name`'s key in the bucket of `store`.
async fn revision(store: &NatsStore, name: &str) -> u64 {
    store
        .kv()
        .await
        .expect("bucket")
        .entry(leader_nats::key_of(name))
        .await
        .expect("read")
        .expect("a record")
        .revision
}

/// A record freed by hand with a lower token (`nats kv put` of a free record with
/// `leaderTransitions` 0, or another client's write) does not take tokens back: the next term,
/// taken by a process that never saw the old token, gets one above every revision written
/// (S5), as a record created afresh does.
#[tokio::test]
async fn a_record_rewritten_with_a_lower_token_does_not_take_tokens_back() {
    let Some((_server, url, _admin)) = server_and_admin().await else {
        return;
    };
    let name = unique("rewritten");
    let first = store(&url)
        .create_bucket(true)
        .build()
        .await
        .expect("store");
    let held = created(&first.lock(&name, "a")).await;
    let mut freed = conformance::record("", 0);
    freed.leader_transitions = 0;
    first
        .kv()
        .await
        .expect("bucket")
        .put(leader_nats::key_of(&name), freed.to_json().into())
        .await
        .expect("an operator's write");
    let fresh = store(&url).build().await.expect("another process's store");
    let lock = fresh.lock(&name, "b");
    let read = lock.get().await.expect("get").expect("the freed record");
    assert_eq!(read.record.leader_transitions, 0);
    let taken = lock
        .update(&read.version, &conformance::record("b", 1))
        .await
        .expect("a takeover of a free record");
    assert!(
        taken.record.leader_transitions > held.record.leader_transitions,
        "token {} after {}",
        taken.record.leader_transitions,
        held.record.leader_transitions
    );
}
