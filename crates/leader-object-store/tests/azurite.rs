//! The object storage lock on Azure Blob Storage, against Azurite (Microsoft's emulator, from
//! the npm registry, started on loopback by `scripts/setup`; `AZURITE_BLOB_STORAGE_URL`, default
//! `http://127.0.0.1:10000`), each test on a container of its own: the conformance suite and
//! electors (conditional create with `If-None-Match: *`, conditional update with `If-Match` on
//! the ETag), the conditional read (`304`), the precondition check at open, a missing container
//! and a wrong account key.

mod common;

use std::sync::Arc;

use common::Factory;
use leader_core::{LockError, ResourceLock, conformance};
use leader_object_store::BucketStore;
use leader_object_store::object_store::azure::MicrosoftAzureBuilder;
use leader_object_store::object_store::{ObjectStore, ObjectStoreExt};
use leader_test_support::assert_misconfigured_saying;
use leader_test_support::object_store_counting::Counting;
use leader_test_support::record_writes::{created, renewal};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_azure_lock_conforms_on_azurite() {
    let Some(store) = common::azurite_or_skip_store() else {
        return;
    };
    conformance::run_all(&Factory { store }).await;
}

/// Two and ten electors on Azurite each elect exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform_on_azurite() {
    let Some(store) = common::azurite_or_skip_store() else {
        return;
    };
    conformance::electors(&Factory { store }, false).await;
}

/// Azurite keeps preconditions: the check before the first write passes and writes nothing, a
/// create over an existing blob and an update on an old ETag are conflicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azurite_keeps_preconditions() {
    let Some(store) = common::azurite_or_skip_store() else {
        return;
    };
    store
        .check_conditional_writes()
        .await
        .expect("Azurite keeps If-Match");
    let written: Vec<_> = futures_util::TryStreamExt::try_collect::<Vec<_>>(
        store.object_store().list(Some(&store.prefix().into())),
    )
    .await
    .expect("list");
    assert!(
        written.iter().all(|meta| !meta
            .location
            .as_ref()
            .contains(leader_object_store::PROBE_NAME)),
        "the check wrote its probe: {written:?}"
    );
    let a = store.lock("app", "a");
    let created = created(&a).await;
    let err = store
        .lock("app", "b")
        .create(&conformance::record("b", 1))
        .await
        .expect_err("the blob exists");
    assert!(err.is_conflict(), "{err:?}");
    let renewed = renewal(&created.record);
    let first = a.update(&created.version, &renewed).await.expect("renew");
    assert_ne!(first.version, created.version, "the ETag moves");
    let err = a
        .update(&created.version, &renewed)
        .await
        .expect_err("an old ETag");
    assert!(err.is_conflict(), "{err:?}");
    // A blob deleted by hand: an update on the ETag read before is a conflict, not a write.
    let path = format!("{}app", store.prefix());
    store
        .object_store()
        .delete(&path.as_str().into())
        .await
        .expect("a delete");
    let err = a
        .update(&first.version, &renewed)
        .await
        .expect_err("the blob is gone");
    assert!(err.is_conflict(), "{err:?}");
    assert_eq!(a.get().await.expect("get"), None);
}

/// A lease another tool took on the record's blob (the lock takes none) makes Azure refuse
/// every write with `412 LeaseIdMissing`: a misconfiguration that says so, never a lost race,
/// which would leave the election without a leader and without a word. Once the lease is
/// broken, writes go through again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_on_the_blob_is_reported_not_taken_for_a_lost_race() {
    let Some(container) = common::azurite_container_or_skip() else {
        return;
    };
    let store = common::azurite_builder(&container, "locks/", None)
        .build()
        .expect("a store");
    let lock = store.lock("app", "a");
    let first = created(&lock).await;
    let lease = |headers: &[(&str, &str)]| {
        common::azurite_request(&container, "locks/app", "comp=lease", headers)
    };
    let status = lease(&[
        ("x-ms-lease-action", "acquire"),
        ("x-ms-lease-duration", "-1"),
    ]);
    assert!(status.contains(" 201 "), "no lease taken: {status}");
    let renewed = renewal(&first.record);
    leader_test_support::assert_misconfigured_saying(
        lock.update(&first.version, &renewed).await,
        &["LeaseIdMissing", "lease on the blob"],
    );
    let status = lease(&[
        ("x-ms-lease-action", "break"),
        ("x-ms-lease-break-period", "0"),
    ]);
    assert!(status.contains(" 202 "), "the lease not broken: {status}");
    lock.update(&first.version, &renewed)
        .await
        .expect("written once the lease is broken");
}

/// While the record does not change, a follower's reads are answered `304 Not Modified`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_record_is_answered_not_modified_by_azurite() {
    let Some(container) = common::azurite_container_or_skip() else {
        return;
    };
    leader_object_store::ensure_crypto_provider();
    let azure: Arc<dyn ObjectStore> = Arc::new(
        MicrosoftAzureBuilder::new()
            .with_use_emulator(true)
            .with_container_name(&container)
            .build()
            .expect("an Azure client"),
    );
    let counting = Counting::new(azure);
    let store = BucketStore::builder(counting.clone(), format!("az://{container}"))
        .build()
        .expect("a store");
    common::assert_unchanged_reads_not_modified(&store, &counting, 3).await;
}

/// A container that does not exist is a misconfiguration naming it, at the check and at every
/// read and write; it is never taken for an absent record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_container_is_reported() {
    if !common::azurite_or_skip() {
        return;
    }
    let store = common::azurite_builder(&common::unique_container(), "locks/", None)
        .build()
        .expect("built: only a request can tell");
    assert_misconfigured_saying(store.check_conditional_writes().await, &["does not exist"]);
    let lock = store.lock("app", "a");
    let err = lock.get().await.expect_err("no container");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    let err = lock
        .create(&conformance::record("a", 1))
        .await
        .expect_err("no container");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
}

/// A wrong account key is refused by the store, said as such, and never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_is_refused_without_being_shown() {
    let Some(container) = common::azurite_container_or_skip() else {
        return;
    };
    // A valid base64 key that is not the account's.
    let wrong = "bm90LXRoZS1hY2NvdW50LWtleS1ub3QtdGhlLWFjY291bnQta2V5LXdyb25nLWtleQ==";
    let store = common::azurite_builder(&container, "locks/", Some(wrong))
        .build()
        .expect("built: only a request can tell");
    assert!(!format!("{store:?}").contains(wrong));
    let err = store
        .check_conditional_writes()
        .await
        .expect_err("a wrong key");
    let text = format!("{err} {err:?}");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    assert!(!text.contains(wrong), "{text}");
    let err = store.lock("app", "a").get().await.expect_err("a wrong key");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
}
