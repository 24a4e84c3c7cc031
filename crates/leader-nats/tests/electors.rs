//! Electors on one real NATS server: exactly one leads, a release is taken over at once, a
//! deleted key keeps the fencing tokens growing.

mod common;

use leader_test_support::started_leading;
use std::time::Duration;

use common::{Factory, unique};
use leader_core::{ResourceLock, conformance};
use leader_nats::key_of;
use tokio::time::sleep;

/// Two and ten electors each elect exactly one; a follower woken by the KV watch takes a
/// released lease well within a retry period.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::electors(&Factory { store }, true).await;
}

/// Someone deletes (or purges) the key under a leader: the leader loses its term at its next
/// renewal, and the next term's token is above every token before, though the record that
/// counted them is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_key_keeps_the_tokens_growing() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("deleted");
    let (first, token) = started_leading(store.lock(&name, "first")).await;
    let kv = store.kv().await.expect("bucket");
    let probe = store.lock(&name, "probe");
    for purge in [false, true] {
        let before = first.leading_token().unwrap_or(token);
        if purge {
            kv.purge(key_of(&name)).await.expect("purge");
        } else {
            kv.delete(key_of(&name)).await.expect("delete");
        }
        // The key is gone, or the leader, which retries every RETRY, has already started a
        // term again on the empty key: never the term that was removed.
        if let Some(left) = probe.get().await.expect("get") {
            assert!(
                left.record.leader_transitions > before,
                "token {} still there after the key was removed (term {before})",
                left.record.leader_transitions
            );
        }
        // The leader's next renewal fails (nothing at its revision); a term starts again.
        let mut next = None;
        for _ in 0..100 {
            sleep(Duration::from_millis(100)).await;
            if let Some(now) = first.leading_token()
                && now != before
            {
                next = Some(now);
                break;
            }
        }
        let next = next.expect("a new term after the key was removed");
        assert!(next > before, "token {next} after {before}: not above");
    }
    first.stop().await;
}
