//! The DynamoDB lock against moto's server (`DYNAMODB_ENDPOINT`, default
//! `http://127.0.0.1:9000`: the S3 server `scripts/setup` starts, whose moto answers DynamoDB
//! on the same port), on a table of each test's own.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::Arc;

use leader_core::conformance::LockFactory;
use leader_core::{LockSet, ResourceLock, async_trait};
use leader_dynamodb::aws_sdk_dynamodb::types::AttributeValue;
use leader_dynamodb::{DynamoStore, DynamoStoreBuilder, aws_config};

pub mod proxy;

/// The DynamoDB endpoint of the tests ([`leader_test_support::dynamodb_endpoint`]).
pub fn endpoint() -> String {
    leader_test_support::dynamodb_endpoint()
}

/// A table name nobody used.
pub fn unique_table() -> String {
    format!("leader-test-{:08x}", fastrand::u32(..))
}

/// The AWS configuration of the test server.
pub async fn sdk_config() -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(endpoint())
        .credentials_provider(leader_dynamodb::aws_sdk_dynamodb::config::Credentials::for_tests())
        .load()
        .await
}

/// A builder of a store on `table` of the test server.
pub async fn builder(table: &str) -> DynamoStoreBuilder {
    DynamoStore::builder(table).sdk_config(sdk_config().await)
}

/// A store on `table` of the test server, which creates the table when `create` is set.
pub async fn store_on(table: &str, create: bool) -> DynamoStore {
    builder(table)
        .await
        .create_table(create)
        .build()
        .await
        .expect("a store on the test server")
}

/// Whether the test server answers: `false` (a skip) when it does not, a failure under CI.
pub fn server_or_skip() -> bool {
    leader_test_support::answering("DynamoDB server", endpoint(), 80).is_some()
}

/// A table name nobody used, when the test server answers; `None` (a skip) when it does not, a
/// failure under CI.
pub fn table_or_skip() -> Option<String> {
    server_or_skip().then(unique_table)
}

/// A store on a new table of the test server (created by the lock), or `None` (a skip).
pub async fn store_or_skip() -> Option<DynamoStore> {
    let store = store_on(&table_or_skip()?, true).await;
    store.check_table().await.expect("the test table");
    Some(store)
}

/// Writes `item` as it is, without a condition, as a broken writer would.
pub async fn raw_put(store: &DynamoStore, item: HashMap<String, AttributeValue>) {
    store
        .client()
        .put_item()
        .table_name(store.table())
        .set_item(Some(item))
        .send()
        .await
        .expect("a raw write");
}

/// Deletes the item `name`, as an operator (or a TTL) would.
pub async fn raw_delete(store: &DynamoStore, name: &str) {
    store
        .client()
        .delete_item()
        .table_name(store.table())
        .key("name", AttributeValue::S(name.to_owned()))
        .send()
        .await
        .expect("a raw delete");
}

/// Locks of one store for the conformance suite.
pub struct Factory {
    pub store: DynamoStore,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity))
    }

    async fn corrupt(&self, name: &str) -> bool {
        raw_put(
            &self.store,
            HashMap::from([
                ("name".to_owned(), AttributeValue::S(name.to_owned())),
                (
                    "record".to_owned(),
                    AttributeValue::S("{\"holderIdentity\": 5, garbage".to_owned()),
                ),
                ("version".to_owned(), AttributeValue::N("7".to_owned())),
            ]),
        )
        .await;
        true
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn LockSet>> {
        Some(Box::new(self.store.lock_set(identity)))
    }
}
