//! What users get wrong and stores that break the rules: stores without conditional writes are
//! refused before any write, a 403 names the permission, credentials never show, a missing
//! bucket and an unreachable endpoint are told apart, followers poll with conditional reads and
//! a renewal is one request.

mod common;

use std::sync::Arc;
use std::time::Duration;

use leader_core::{LeaderElector, LockError, ResourceLock};
use leader_object_store::object_store::memory::InMemory;
use leader_object_store::object_store::path::Path;
use leader_object_store::object_store::{ObjectStore, ObjectStoreExt};
use leader_object_store::{BucketStore, DEFAULT_PREFIX};
use leader_test_support::object_store_counting::Counting;
use tokio_util::sync::CancellationToken;

const SECRET: &str = "wJalrXUtnFEMI-not-a-real-secret-KEY";

fn misconfigured(result: Result<BucketStore, LockError>) -> String {
    match result {
        Err(err @ LockError::Misconfigured { .. }) => err.to_string(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn stores_without_conditional_update_are_refused_when_built() {
    leader_object_store::ensure_crypto_provider();
    for (url, says) in [
        ("file:///tmp/locks/", "file lock"),
        ("http://127.0.0.1:9/locks/", "no conditional update"),
        ("https://example.com/locks/", "no conditional update"),
        ("ftp://host/x", "unknown scheme"),
        ("s3:///no-bucket", "needs a bucket"),
        (
            "s3://bucket/x?aws_secret_access_key=abc",
            "no credentials or options",
        ),
        ("s3://user:pass@bucket/x", "no credentials or options"),
        ("not a url", "not a URL"),
    ] {
        let message = misconfigured(BucketStore::from_url(url).build());
        assert!(message.contains(says), "{url}: {message}");
        assert!(
            !message.contains("pass@") && !message.contains("abc"),
            "{message}"
        );
    }
    let message = misconfigured(
        BucketStore::from_url("s3://bucket/locks/")
            .option("aws_conditional_put", "disabled")
            .build(),
    );
    assert!(
        message.contains("conditional puts are disabled"),
        "{message}"
    );
    let message = misconfigured(
        BucketStore::from_url("s3://bucket/locks/")
            .option("no_such_option", "1")
            .build(),
    );
    assert!(message.contains("no_such_option"), "{message}");
}

/// An in-memory object store, `counting` wrapped around it (a [`Counting`] constructor), and a
/// lock store named `name` on the wrapper.
fn counted_in_memory(
    counting: fn(Arc<dyn ObjectStore>) -> Arc<Counting>,
    name: &str,
) -> (Arc<dyn ObjectStore>, Arc<Counting>, BucketStore) {
    let inner: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let counted = counting(inner.clone());
    let store = BucketStore::builder(counted.clone(), name)
        .build()
        .expect("built: only a request can tell");
    (inner, counted, store)
}

#[tokio::test]
async fn a_store_that_ignores_preconditions_is_refused_before_any_write() {
    let (inner, broken, store) = counted_in_memory(Counting::ignoring_preconditions, "broken");
    let lock = store.lock("app", "a");
    let record = leader_core::conformance::record("a", 1);
    for _ in 0..2 {
        match lock.create(&record).await {
            Err(LockError::Misconfigured { message, .. }) => {
                assert!(message.contains("precondition"), "{message}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    // The record was never written; only the check's object was.
    let record_path = Path::from(format!("{}app", store.prefix()));
    assert!(
        inner.head(&record_path).await.is_err(),
        "the record was written"
    );
    assert!(
        broken.counts().keys().all(|k| k.starts_with("PUT update")),
        "{:?}",
        broken.counts()
    );
}

#[tokio::test]
async fn the_check_costs_one_request_per_store_and_writes_nothing() {
    let (inner, counting, store) = counted_in_memory(Counting::new, "memory");
    for name in ["a", "b"] {
        let lock = store.lock(name, "x");
        lock.create(&leader_core::conformance::record("x", 1))
            .await
            .expect("created");
    }
    let counts = counting.counts();
    assert_eq!(counts.get("PUT update 412"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("PUT create 200"), Some(&2), "{counts:?}");
    assert_eq!(probes(&inner).await, 0, "the check wrote its object");
}

/// The objects the checks wrote, in `store`.
async fn probes(store: &Arc<dyn ObjectStore>) -> usize {
    use futures_util::TryStreamExt;
    let listed: Vec<_> = store.list(None).try_collect().await.expect("list");
    listed
        .iter()
        .filter(|meta| {
            meta.location
                .filename()
                .is_some_and(|name| name.starts_with(leader_object_store::PROBE_NAME))
        })
        .count()
}

/// A store that keeps `If-Match` only on objects that exist (and takes `If-None-Match: *` for
/// an overwrite), as MinIO did before RELEASE.2024-05-07, is refused by every store on it, also
/// after a check wrote its object: each check asks about an object no one wrote. A refusal
/// stands for the store's life: one object at most per store.
#[tokio::test]
async fn a_store_that_checks_preconditions_only_on_existing_objects_is_refused() {
    let inner: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    for process in ["first", "second"] {
        let partial = Counting::checking_preconditions_only_on_existing_objects(inner.clone());
        let store = BucketStore::builder(partial.clone(), process)
            .build()
            .expect("built");
        let lock = store.lock("app", "a");
        for _ in 0..3 {
            match lock.create(&leader_core::conformance::record("a", 1)).await {
                Err(LockError::Misconfigured { message, .. }) => {
                    assert!(message.contains("precondition"), "{process}: {message}")
                }
                other => panic!("{process}: expected a refusal, got {other:?}"),
            }
        }
        assert_eq!(
            partial.counts().get("PUT update 200"),
            Some(&1),
            "{process}: {:?}",
            partial.counts()
        );
    }
    assert_eq!(probes(&inner).await, 2, "one object per store");
    let record = Path::from(format!("{DEFAULT_PREFIX}app"));
    assert!(inner.head(&record).await.is_err(), "the record was written");
}

/// An S3 endpoint that answers everything with `status` and `body`.
async fn answering_server(status: axum::http::StatusCode, body: &'static str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let app = axum::Router::new().fallback(move || async move { (status, body) });
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{address}")
}

/// An S3 endpoint that refuses everything with 403, as S3 does for credentials without the
/// permission.
async fn forbidding_server() -> String {
    answering_server(
        axum::http::StatusCode::FORBIDDEN,
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code>\
         <Message>Access Denied</Message></Error>",
    )
    .await
}

/// S3 echoes an expired or invalid session token in its answer (`Token-0`), also in an answer
/// whose root names its namespace: the error keeps the answer's code and message, never that.
#[tokio::test]
async fn an_answer_that_echoes_credentials_is_reduced_to_its_code_and_message() {
    const TOKEN: &str = "FwoGZXIvYXdzEXAMPLESESSIONTOKEN";
    for (status, body, code) in [
        (
            axum::http::StatusCode::BAD_REQUEST,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>ExpiredToken</Code>\
             <Message>The provided token has expired.</Message>\
             <Token-0>FwoGZXIvYXdzEXAMPLESESSIONTOKEN</Token-0><RequestId>R1</RequestId></Error>",
            "ExpiredToken",
        ),
        (
            axum::http::StatusCode::BAD_REQUEST,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\
             <Error xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Code>InvalidToken</Code>\
             <Message>The provided token is malformed or otherwise invalid.</Message>\
             <Token-0>FwoGZXIvYXdzEXAMPLESESSIONTOKEN</Token-0><RequestId>R2</RequestId></Error>",
            "InvalidToken",
        ),
    ] {
        let endpoint = answering_server(status, body).await;
        leader_object_store::ensure_crypto_provider();
        let store = BucketStore::from_url("s3://locks-bucket/svc/")
            .option("aws_endpoint", &endpoint)
            .option("allow_http", "true")
            .option("aws_region", "us-east-1")
            .option("aws_access_key_id", "AKIDEXAMPLE")
            .option("aws_secret_access_key", SECRET)
            .option("aws_session_token", TOKEN)
            .timeout(Duration::from_secs(5))
            .build()
            .expect("a store");
        let lock = store.lock("app", "a");
        let read = lock.get().await.expect_err("refused");
        let write = lock
            .create(&leader_core::conformance::record("a", 1))
            .await
            .expect_err("refused");
        for err in [&read, &write] {
            let text = format!("{err} {err:?}");
            assert!(!text.contains(TOKEN) && !text.contains(SECRET), "{text}");
            assert!(text.contains(code), "{text}");
        }
    }
}

fn s3_store(endpoint: &str, timeout: Duration) -> BucketStore {
    leader_object_store::ensure_crypto_provider();
    BucketStore::from_url("s3://locks-bucket/svc/")
        .option("aws_endpoint", endpoint)
        .option("allow_http", "true")
        .option("aws_region", "us-east-1")
        .option("aws_access_key_id", "AKIDEXAMPLE")
        .option("aws_secret_access_key", SECRET)
        .timeout(timeout)
        .build()
        .expect("a store")
}

#[tokio::test]
async fn a_403_names_the_permission_and_never_the_secret() {
    let endpoint = forbidding_server().await;
    let store = s3_store(&endpoint, Duration::from_secs(5));
    assert!(!format!("{store:?}").contains(SECRET));
    let lock = store.lock("app", "a");
    assert!(!format!("{lock:?}").contains(SECRET));
    let read = lock.get().await.expect_err("refused");
    let text = read.to_string();
    assert!(matches!(read, LockError::Forbidden { .. }), "{read:?}");
    assert!(
        text.contains("s3:GetObject on arn:aws:s3:::locks-bucket/svc/*"),
        "{text}"
    );
    let write = lock
        .create(&leader_core::conformance::record("a", 1))
        .await
        .expect_err("refused");
    let text = write.to_string();
    assert!(matches!(write, LockError::Forbidden { .. }), "{write:?}");
    assert!(text.contains("s3:PutObject"), "{text}");
    for err in [&read, &write] {
        assert!(!format!("{err} {err:?}").contains(SECRET), "{err:?}");
    }
}

#[tokio::test]
async fn an_unreachable_endpoint_is_unavailable_within_the_timeout() {
    // A port nothing listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().expect("address"));
    drop(listener);
    let store = s3_store(&endpoint, Duration::from_millis(500));
    let at = tokio::time::Instant::now();
    let err = store.lock("app", "a").get().await.expect_err("unreachable");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(at.elapsed() < Duration::from_secs(3), "{:?}", at.elapsed());
    assert!(!format!("{err} {err:?}").contains(SECRET));
}

#[tokio::test]
async fn a_missing_bucket_is_misconfigured() {
    if leader_test_support::s3_bucket_or_skip().is_none() {
        return;
    }
    let missing = format!("leader-missing-{:08x}", fastrand::u32(..));
    let lock = common::s3_builder(&missing, "x/")
        .build()
        .expect("a store")
        .lock("app", "a");
    let err = lock.get().await.expect_err("no bucket");
    assert!(
        matches!(&err, LockError::Misconfigured { message, .. } if message.contains("bucket does not exist")),
        "{err:?}"
    );
    let err = lock
        .create(&leader_core::conformance::record("a", 1))
        .await
        .expect_err("no bucket");
    assert!(!err.is_conflict(), "{err:?}");
}

/// Followers read with `If-None-Match` and get `304 Not Modified` while the record is
/// unchanged, and a leader's renewal is one request (the conditional write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_read_conditionally_and_renewals_are_one_request() {
    let inner: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let leader_store = Counting::new(inner.clone());
    let follower_store = Counting::new(inner);
    let build = |store: Arc<Counting>| {
        BucketStore::builder(store, "memory")
            .build()
            .expect("a store")
    };
    let elector = |lock| {
        LeaderElector::builder(lock)
            .lease_duration(Duration::from_millis(1500))
            .renew_deadline(Duration::from_millis(1000))
            .retry_period(Duration::from_millis(100))
            .build()
            .expect("an elector")
    };
    let shutdown = CancellationToken::new();
    let leader = elector(build(leader_store.clone()).lock("app", "leader"));
    let mut state = leader.subscribe();
    let leading = tokio::spawn(leader.run(shutdown.clone()));
    state
        .wait_for(|s| s.is_leading())
        .await
        .expect("the leader leads");
    let follower = elector(build(follower_store.clone()).lock("app", "follower"));
    let following = tokio::spawn(follower.run(shutdown.clone()));
    let (leader_before, follower_before) = (leader_store.counts(), follower_store.counts());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let diff = |after: std::collections::BTreeMap<String, usize>,
                before: std::collections::BTreeMap<String, usize>| {
        after
            .into_iter()
            .map(|(k, v)| (k.clone(), v - before.get(&k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let leader_counts = diff(leader_store.counts(), leader_before);
    let follower_counts = diff(follower_store.counts(), follower_before);
    shutdown.cancel();
    let _ = tokio::join!(leading, following);
    // The leader: conditional writes only, each one renewal.
    assert_eq!(
        leader_counts.keys().collect::<Vec<_>>(),
        ["PUT update 200"],
        "{leader_counts:?}"
    );
    assert!(leader_counts["PUT update 200"] >= 10, "{leader_counts:?}");
    // The follower: conditional reads; the record changes at every renewal, so some return it,
    // but never more reads than retry periods.
    let reads: usize = follower_counts
        .iter()
        .filter(|(k, _)| k.starts_with("GET"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(
        reads,
        follower_counts.values().sum::<usize>(),
        "{follower_counts:?}"
    );
    assert!((10..=25).contains(&reads), "{follower_counts:?}");
}

/// While the record does not change (a holder that stopped renewing, a lease nobody renews),
/// every poll of a follower is answered `304 Not Modified`, without the object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_record_is_answered_not_modified() {
    let (_, counting, store) = counted_in_memory(Counting::new, "memory");
    common::assert_unchanged_reads_not_modified(&store, &counting, 5).await;
}
