//! The shard set's batches against a real MySQL or MariaDB: a renewal batch with a stale version
//! in it renews the others and refuses that one, each as its own lock would.

mod common;

use leader_core::backend::Renewal;
use leader_core::conformance::record;
use leader_core::{LockSet, ResourceLock, Version};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_stale_version_renews_the_others_alone() {
    let Some(store) = common::store().await else {
        return;
    };
    let prefix = common::unique("batch");
    let set = store.lock_set("m");
    // Nine records (the statement is padded to sixteen rows), held by `m`.
    let mut held = Vec::new();
    for i in 0..9 {
        let key = format!("{prefix}-{i}");
        let stored = set
            .lock(&key)
            .create(&record("m", 1))
            .await
            .expect("create");
        held.push((key, stored));
    }
    let mut renewals: Vec<Renewal> = held
        .iter()
        .map(|(key, stored)| {
            let mut next = stored.record.clone();
            next.renew_time = chrono::Utc::now();
            Renewal {
                key: key.clone(),
                version: stored.version.clone(),
                record: next,
            }
        })
        .collect();
    // The fifth one renews from a version it never read.
    renewals[4].version = Version::from(7_i64);
    let results = set.renew_many(&renewals).await;
    assert_eq!(results.len(), 9);
    let keys: Vec<String> = held.iter().map(|(key, _)| key.clone()).collect();
    let read = set.get_many(&keys).await;
    for (i, (result, now)) in results.iter().zip(&read).enumerate() {
        let now = now.as_ref().expect("read").as_ref().expect("a record");
        if i == 4 {
            assert!(
                result
                    .as_ref()
                    .is_err_and(leader_core::LockError::is_conflict),
                "{result:?}"
            );
            assert_eq!(now.version, held[4].1.version, "the stale one was written");
        } else {
            let renewed = result.as_ref().expect("renewed");
            assert_eq!(renewed.version, now.version, "record {i}");
            assert_ne!(renewed.version, held[i].1.version, "record {i}");
        }
    }
    // All nine again, from what each now has: every one renewed, with no re-read needed.
    let again: Vec<Renewal> = keys
        .iter()
        .zip(&read)
        .map(|(key, now)| {
            let now = now.as_ref().expect("read").as_ref().expect("a record");
            Renewal {
                key: key.clone(),
                version: now.version.clone(),
                record: now.record.clone(),
            }
        })
        .collect();
    for result in set.renew_many(&again).await {
        result.expect("renewed");
    }
}
