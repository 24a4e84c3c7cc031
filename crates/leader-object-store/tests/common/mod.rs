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
use leader_test_support::object_store_counting::Counting;

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

/// Azurite's well-known development account and key (published in Azurite's documentation:
/// not a secret).
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Azurite's blob endpoint, as object_store's emulator mode reads it: `AZURITE_BLOB_STORAGE_URL`,
/// or Azurite's default on loopback.
pub fn azurite_url() -> String {
    std::env::var("AZURITE_BLOB_STORAGE_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "http://127.0.0.1:10000".to_owned())
        .trim_end_matches('/')
        .to_owned()
}

/// Whether Azurite answers: `false` (a skip) when it does not, a failure under CI.
pub fn azurite_or_skip() -> bool {
    leader_test_support::answering("Azurite", azurite_url(), 10000).is_some()
}

/// A container name nobody used.
pub fn unique_container() -> String {
    format!("leader-test-{:08x}", fastrand::u32(..))
}

/// A new container on Azurite, or `None` (a skip) when Azurite does not answer, a failure
/// under CI.
pub fn azurite_container_or_skip() -> Option<String> {
    if !azurite_or_skip() {
        return None;
    }
    let container = unique_container();
    create_container(&container);
    Some(container)
}

/// Checks that a follower's `reads` reads of a record nobody renews, after its first, are
/// each answered `304 Not Modified` without the object; `counting` sees `store`'s requests.
pub async fn assert_unchanged_reads_not_modified(
    store: &BucketStore,
    counting: &Counting,
    reads: usize,
) {
    let holder = store.lock("app", "gone");
    let mut record = leader_core::conformance::record("gone", 1);
    record.lease_duration = std::time::Duration::from_secs(3600);
    holder.create(&record).await.expect("created");
    let follower = store.lock("app", "follower");
    let first = follower.get().await.expect("read").expect("a record");
    for _ in 0..reads {
        let again = follower.get().await.expect("read").expect("a record");
        assert_eq!(again, first);
    }
    let counts = counting.counts();
    assert_eq!(counts.get("GET 200"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("GET 304"), Some(&reads), "{counts:?}");
}

/// A builder for `az://CONTAINER/PREFIX` on Azurite, with its development account (object_store's
/// emulator mode), and `key` as the account key when given.
pub fn azurite_builder(container: &str, prefix: &str, key: Option<&str>) -> BucketStoreBuilder {
    leader_object_store::ensure_crypto_provider();
    let builder = BucketStore::from_url(&format!("az://{container}/{prefix}"))
        .option("azure_storage_use_emulator", "true");
    match key {
        Some(key) => builder.option("azure_storage_account_key", key),
        None => builder,
    }
}

/// A store on a new container of Azurite with a prefix of its own, or `None` (a skip).
pub fn azurite_or_skip_store() -> Option<BucketStore> {
    let container = azurite_container_or_skip()?;
    Some(
        azurite_builder(&container, &unique_prefix(), None)
            .build()
            .expect("a store on Azurite"),
    )
}

/// Creates `container` on Azurite: a `Create Container` request (object_store makes no
/// containers).
pub fn create_container(container: &str) {
    let status = azurite_request(container, "", "restype=container", &[]);
    assert!(
        status.contains(" 201 "),
        "Azurite did not create container {container}: {status}"
    );
}

/// Sends Azurite a `PUT` on `blob` of `container` (the container itself for an empty `blob`)
/// with the query parameter `query` (`name=value`) and the `x-ms-` headers `headers` (sorted
/// by name), signed with the development account's Shared Key: the status line of its answer.
pub fn azurite_request(
    container: &str,
    blob: &str,
    query: &str,
    headers: &[(&str, &str)],
) -> String {
    use std::io::{Read, Write};
    let url = azurite_url();
    let authority = url.trim_start_matches("http://");
    let date = chrono::Utc::now()
        .format("%a, %d %b %Y %H:%M:%S GMT")
        .to_string();
    let version = "2021-08-06";
    let path = if blob.is_empty() {
        format!("/{AZURITE_ACCOUNT}/{container}")
    } else {
        format!("/{AZURITE_ACCOUNT}/{container}/{blob}")
    };
    let mut x_ms = vec![("x-ms-date", date.as_str())];
    x_ms.extend_from_slice(headers);
    x_ms.push(("x-ms-version", version));
    let canonical: String = x_ms.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let lines: String = x_ms.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    // Shared Key: the verb, eleven standard headers (all empty here), the x-ms- headers, then
    // the resource (path-style: the account twice) with its query parameters.
    let to_sign = format!(
        "PUT\n\n\n\n\n\n\n\n\n\n\n\n{canonical}/{AZURITE_ACCOUNT}{path}\n{}",
        query.replacen('=', ":", 1)
    );
    let key = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, AZURITE_KEY)
        .expect("the development key is base64");
    let tag = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key),
        to_sign.as_bytes(),
    );
    let signature =
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, tag.as_ref());
    let mut stream = std::net::TcpStream::connect(authority).expect("Azurite answers");
    write!(
        stream,
        "PUT {path}?{query} HTTP/1.1\r\nHost: {authority}\r\n{lines}\
         Authorization: SharedKey {AZURITE_ACCOUNT}:{signature}\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .expect("a request to Azurite");
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .expect("Azurite's answer");
    answer.lines().next().unwrap_or_default().to_owned()
}
