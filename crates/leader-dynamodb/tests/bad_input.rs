//! Unhappy paths on moto's DynamoDB: a missing table, a table of another key, records written
//! by others, deleted items, and what errors show.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use leader_core::conformance::record;
use leader_core::{LockError, ResourceLock, Version};
use leader_dynamodb::aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType,
};
use leader_dynamodb::{DynamoStore, FLOOR_PREFIX, LockUrl};
use leader_test_support::assert_misconfigured_saying;

/// A missing table is an error that names it and says how to create it, until it exists;
/// then the candidate leads. The lock creates nothing unless asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_reported_until_it_exists() {
    let Some(table) = common::table_or_skip() else {
        return;
    };
    let store = common::store_on(&table, false).await;
    assert_misconfigured_saying(
        store.check_table().await,
        &[&table, "does not exist", "create_table=true"],
    );
    let creator = common::store_on(&table, true).await;
    let lock = store.lock("app", "a");
    assert_misconfigured_saying(lock.get().await, &["does not exist"]);
    let mut elector = leader_test_support::Candidate::start(lock);
    elector
        .stays_alive_without_leading(Duration::from_millis(1500))
        .await;
    let described = store
        .client()
        .describe_table()
        .table_name(&table)
        .send()
        .await;
    assert!(described.is_err(), "the lock created the table unasked");
    creator.check_table().await.expect("the table is created");
    elector.wait_leading(Duration::from_secs(10)).await;
    elector.stop().await;
}

/// A table whose key is not the lock's is refused at open, and left as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_of_another_key_is_refused_and_left_alone() {
    let Some(table) = common::table_or_skip() else {
        return;
    };
    let store = common::store_on(&table, true).await;
    store
        .client()
        .create_table()
        .table_name(&table)
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("LockID")
                .key_type(KeyType::Hash)
                .build()
                .expect("a key"),
        )
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("LockID")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("an attribute"),
        )
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await
        .expect("a table of another key");
    assert_misconfigured_saying(
        store.check_table().await,
        &["HASH LockID (S)", "never alters"],
    );
    // Writes are refused too, before they are sent.
    let lock = store.lock("app", "a");
    let err = lock.create(&record("a", 1)).await.expect_err("refused");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    let described = store
        .client()
        .describe_table()
        .table_name(&table)
        .send()
        .await
        .expect("describe");
    let keys = described
        .table
        .expect("a table")
        .key_schema
        .unwrap_or_default();
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].attribute_name, "LockID", "the table was altered");
}

/// S5: after the record's item is deleted (by hand, or by a TTL someone set), the next term's
/// token is still above every token issued, and a writer holding a version from before the
/// deletion cannot write over the new item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_after_the_item_is_deleted() {
    let Some(store) = common::store_or_skip().await else {
        return;
    };
    let a = store.lock("app", "a");
    let first = a.create(&record("a", 1)).await.expect("create");
    assert_eq!(first.record.leader_transitions, 1);
    let mut next = first.record.clone();
    next.leader_transitions = 7;
    let seventh = a.update(&first.version, &next).await.expect("a new term");
    assert_eq!(seventh.record.leader_transitions, 7);
    common::raw_delete(&store, "app").await;
    assert_eq!(a.get().await.expect("get"), None);
    let b = store.lock("app", "b");
    let again = b.create(&record("b", 1)).await.expect("create again");
    assert!(
        again.record.leader_transitions > 7,
        "a term after the deletion got token {}",
        again.record.leader_transitions
    );
    assert_eq!(
        b.get().await.expect("get").expect("a record").record,
        again.record,
        "the raised token is the one stored"
    );
    // The version before the deletion names nothing any more.
    let mut stale = seventh.record.clone();
    stale.renew_time = stale.renewal_time(chrono_now());
    let err = a.update(&seventh.version, &stale).await.expect_err("stale");
    assert!(err.is_conflict(), "{err:?}");
    // A term that asks for a token below the stored one gets one above it.
    let mut lower = again.record.clone();
    lower.holder_identity = "c".to_owned();
    lower.leader_transitions = 2;
    let c = store.lock("app", "c");
    let taken = c.update(&again.version, &lower).await.expect("a new term");
    assert!(taken.record.leader_transitions > again.record.leader_transitions);
}

fn chrono_now() -> chrono::DateTime<chrono::Utc> {
    chrono::Utc::now()
}

/// A renewal of the stored record is one conditional write of a new version; a write on a
/// version never issued is a conflict; the floor item cannot be named as an election.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_are_conditional_and_names_are_checked() {
    let Some(store) = common::store_or_skip().await else {
        return;
    };
    let a = store.lock("app", "a");
    let created = a.create(&record("a", 1)).await.expect("create");
    let mut renewed = created.record.clone();
    renewed.renew_time = renewed.renewal_time(chrono_now());
    let first = a.update(&created.version, &renewed).await.expect("renew");
    assert_ne!(
        first.version, created.version,
        "every write moves the version"
    );
    for version in ["garbage", "12345"] {
        let err = a
            .update(&Version::new(version), &renewed)
            .await
            .expect_err(version);
        assert!(err.is_conflict(), "{version}: {err:?}");
    }
    let floor = store.lock(format!("{FLOOR_PREFIX}app"), "a");
    let err = floor.get().await.expect_err("a floor item");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    // A record written by another client without the lock's attributes is read as invalid
    // and never overwritten.
    common::raw_put(
        &store,
        HashMap::from([
            ("name".to_owned(), AttributeValue::S("other".to_owned())),
            ("record".to_owned(), AttributeValue::S("{}".to_owned())),
        ]),
    )
    .await;
    let err = store
        .lock("other", "a")
        .get()
        .await
        .expect_err("no version");
    assert!(matches!(err, LockError::InvalidRecord { .. }), "{err:?}");
}

/// Credentials that cannot be had fail the request before it is sent. None anywhere (or an
/// invalid configuration) is `Forbidden`, saying so; a provider that timed out or failed (an
/// instance metadata service slow under load) is an outage that names the credentials.
#[tokio::test]
async fn credentials_that_cannot_be_had_are_told_apart() {
    use aws_credential_types::provider::error::CredentialsError;
    use leader_dynamodb::aws_sdk_dynamodb::config::{
        ProvideCredentials, SharedCredentialsProvider,
    };

    #[derive(Debug)]
    struct Failing(fn() -> CredentialsError);

    impl ProvideCredentials for Failing {
        fn provide_credentials<'a>(
            &'a self,
        ) -> aws_credential_types::provider::future::ProvideCredentials<'a>
        where
            Self: 'a,
        {
            aws_credential_types::provider::future::ProvideCredentials::ready(Err((self.0)()))
        }
    }

    let get = |failing: Failing| async move {
        let config = leader_dynamodb::aws_config::SdkConfig::builder()
            .region(leader_dynamodb::aws_config::Region::new("us-east-1"))
            .endpoint_url("http://127.0.0.1:9")
            .credentials_provider(SharedCredentialsProvider::new(failing))
            .build();
        let store = DynamoStore::builder("locks")
            .sdk_config(config)
            .timeout(Duration::from_millis(500))
            .build()
            .await
            .expect("a store");
        store.lock("app", "a").get().await
    };
    leader_test_support::assert_forbidden_saying(
        get(Failing(|| {
            CredentialsError::not_loaded("no web identity token file")
        }))
        .await,
        &["no AWS credentials", "no web identity token file"],
    );
    leader_test_support::assert_unavailable_saying(
        get(Failing(|| {
            CredentialsError::provider_timed_out(Duration::from_secs(1))
        }))
        .await,
        &["credentials could not be had this time"],
    );
}

/// Errors and `Debug` never show credentials.
#[tokio::test]
async fn credentials_are_never_shown() {
    let config = leader_dynamodb::aws_config::SdkConfig::builder()
        .region(leader_dynamodb::aws_config::Region::new("us-east-1"))
        .endpoint_url("http://127.0.0.1:9")
        .credentials_provider(
            leader_dynamodb::aws_sdk_dynamodb::config::SharedCredentialsProvider::new(
                leader_dynamodb::aws_sdk_dynamodb::config::Credentials::new(
                    "AKIDEXAMPLE",
                    "wJalrXUtnFEMI-SECRET",
                    None,
                    None,
                    "test",
                ),
            ),
        )
        .build();
    let builder = DynamoStore::builder("locks")
        .sdk_config(config)
        .timeout(Duration::from_millis(500));
    assert!(!format!("{builder:?}").contains("SECRET"));
    let store = builder.build().await.expect("a store");
    let err = store
        .lock("app", "a")
        .get()
        .await
        .expect_err("nothing listens");
    let text = format!("{err} {err:?}");
    assert!(
        matches!(
            err,
            LockError::Unavailable { .. } | LockError::Timeout { .. }
        ),
        "{err:?}"
    );
    assert!(!text.contains("SECRET"), "{text}");
    let url = LockUrl::parse("dynamodb://AKID:SECRET@locks").expect_err("credentials");
    assert!(!url.to_string().contains("SECRET"), "{url}");
}
