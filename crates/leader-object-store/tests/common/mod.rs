//! The object storage lock against moto's S3 server (`S3_ENDPOINT`, started on loopback by
//! `scripts/setup`; a new bucket per run unless `S3_BUCKET` names one) and against
//! object_store's in-memory store.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
use leader_object_store::object_store::memory::InMemory;
use leader_object_store::object_store::path::Path;
use leader_object_store::object_store::{ObjectStore, PutOptions, PutPayload};
use leader_object_store::{BucketStore, BucketStoreBuilder};

/// A prefix nobody else uses.
pub fn unique_prefix() -> String {
    format!("leader-test-{:08x}/", fastrand::u32(..))
}

/// A builder for `bucket` on the test S3 server.
pub fn s3_builder(bucket: &str, prefix: &str) -> BucketStoreBuilder {
    leader_object_store::ensure_crypto_provider();
    let mut builder = BucketStore::from_url(&format!("s3://{bucket}/{prefix}"));
    for (key, value) in leader_test_support::s3_options() {
        builder = builder.option(key, value);
    }
    builder
}

/// A store on the test S3 server with a prefix of its own; `None` (a skip) when the server is
/// not there, a failure under CI.
pub fn s3_or_skip() -> Option<BucketStore> {
    let bucket = leader_test_support::s3_bucket_or_skip()?;
    Some(
        s3_builder(&bucket, &unique_prefix())
            .build()
            .expect("a store on the test S3 server"),
    )
}

/// An in-memory store.
pub fn memory() -> BucketStore {
    BucketStore::builder(Arc::new(InMemory::new()), "memory")
        .prefix(unique_prefix())
        .build()
        .expect("an in-memory store")
}

/// Locks of one store for the conformance suite.
pub struct Factory {
    pub store: BucketStore,
}

#[async_trait]
impl LockFactory for Factory {
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(name, identity))
    }

    async fn corrupt(&self, name: &str) -> bool {
        let path = Path::from(format!("{}{name}", self.store.prefix()));
        self.store
            .object_store()
            .put_opts(
                &path,
                PutPayload::from_static(b"{\"holderIdentity\": 5, garbage"),
                PutOptions::default(),
            )
            .await
            .expect("a raw write");
        true
    }
}
