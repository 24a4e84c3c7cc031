//! What a misconfigured or broken setup gets: typed errors naming the problem, never a panic,
//! never credentials, nothing overwritten.

mod common;

use std::time::{Duration, Instant};

use common::{Server, builder as store, unique};
use leader_core::{LockError, ResourceLock, conformance};
use leader_nats::NatsStore;
use leader_nats::async_nats::jetstream;

/// Users of a private server: one with every right, one that may read but not write the
/// bucket's keys.
const ACCOUNTS: &str = r#"
accounts {
  APP {
    jetstream: enabled
    users: [
      { user: owner, password: owner-secret }
      {
        user: reader, password: reader-secret
        permissions: {
          publish: { allow: ["$JS.API.>"] }
          subscribe: { allow: ["_INBOX.>"] }
        }
      }
    ]
  }
}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_write_rights_is_forbidden_and_a_wrong_password_too() {
    let Some(server) = Server::start(Some(ACCOUNTS)) else {
        return;
    };
    let owner = store(&server.url_as("owner", "owner-secret"))
        .create_bucket(true)
        .build()
        .await
        .expect("store");
    let name = unique("rights");
    let created = owner
        .lock(&name, "a")
        .create(&conformance::record("a", 1))
        .await
        .expect("the owner writes");

    let reader = store(&server.url_as("reader", "reader-secret"))
        .build()
        .await
        .expect("store");
    let lock = reader.lock(&name, "b");
    assert_eq!(
        lock.get().await.expect("the reader reads"),
        Some(created.clone())
    );
    let err = lock
        .update(&created.version, &conformance::record("b", 2))
        .await
        .expect_err("the reader may not write");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    assert!(err.to_string().contains("ermission"), "{err}");
    assert!(!err.to_string().contains("reader-secret"), "{err}");
    assert_eq!(
        owner.lock(&name, "a").get().await.expect("get"),
        Some(created),
        "the refused write changed the record"
    );

    let wrong = store(&server.url_as("owner", "wrong-secret"))
        .build()
        .await
        .expect("store");
    let err = wrong
        .lock(&name, "c")
        .get()
        .await
        .expect_err("wrong password");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    assert!(!err.to_string().contains("wrong-secret"), "{err}");
    assert!(!format!("{wrong:?}").contains("wrong-secret"));
}

/// What a read in `bucket` on `server` gets, a misconfiguration; `why` says why.
async fn refused_read(server: &Server, bucket: &str, why: &str) -> LockError {
    let store = store(&server.url())
        .bucket(bucket)
        .build()
        .await
        .expect("store");
    let err = store.lock("x", "a").get().await.expect_err(why);
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_or_a_stream_that_is_no_bucket_is_misconfigured() {
    let Some(server) = Server::start(None) else {
        return;
    };
    let err = refused_read(&server, "nothing_here", "no bucket").await;
    assert!(err.to_string().contains("nats kv add"), "{err}");

    // A stream under a bucket's name that keeps every message of a subject: not a bucket.
    let client = leader_nats::async_nats::connect(server.url())
        .await
        .expect("client");
    jetstream::new(client)
        .create_stream(jetstream::stream::Config {
            name: "KV_plain".to_owned(),
            subjects: vec!["plain.>".to_owned()],
            max_messages_per_subject: 0,
            ..Default::default()
        })
        .await
        .expect("a plain stream");
    refused_read(&server, "plain", "not a bucket").await;

    for bad in ["", "a.b", "a b", "a*"] {
        let err = store(&server.url())
            .bucket(bad)
            .build()
            .await
            .expect_err(bad);
        assert!(
            matches!(err, LockError::Misconfigured { .. }),
            "{bad}: {err:?}"
        );
    }
    let err = NatsStore::builder("").build().await.expect_err("no server");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    let err = store(&server.url())
        .credentials_file("/nonexistent/app.creds")
        .build()
        .await
        .expect_err("no credentials file");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
}

/// No server at all: the store builds (it connects in the background) and every request
/// fails as an outage within its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_server_is_an_outage_within_the_timeout() {
    let port = leader_test_support::free_port();
    let nobody = store(&format!("nats://u:secret@127.0.0.1:{port}"))
        .build()
        .await
        .expect("the store builds");
    let lock = nobody.lock("x", "a");
    let started = Instant::now();
    for result in [
        lock.get().await.map(|_| ()),
        lock.create(&conformance::record("a", 1)).await.map(|_| ()),
    ] {
        let err = result.expect_err("no server");
        assert!(
            matches!(
                err,
                LockError::Unavailable { .. } | LockError::Timeout { .. }
            ),
            "{err:?}"
        );
        assert!(!err.to_string().contains("secret"), "{err}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

/// The least-privilege permissions of `deploy/nats` are enough for an election: reads, writes,
/// followers' watches, a release taken over at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_documented_permissions_are_enough() {
    let Some(server) = common::documented_server().await else {
        return;
    };
    let app = NatsStore::builder(server.url_as("app", "app-secret"))
        .build()
        .await
        .expect("store");
    let taken = conformance::release_is_taken_over_at_once(&common::Factory { store: app }).await;
    assert!(taken < Duration::from_secs(1), "{taken:?}");
}
