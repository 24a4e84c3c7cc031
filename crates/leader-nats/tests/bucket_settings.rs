//! Buckets the lock cannot be safe on are refused when it opens them (S15), in one line naming
//! the setting: limits that make the server delete records (`max_age`, `max_msgs` or
//! `max_bytes` with discard old), a replicated bucket on servers before 2.9.21 (their
//! clustered compare-and-swap can let two writers win, nats-server#4319: a three-server
//! cluster on loopback here), and a server without JetStream.

mod common;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use common::{Server, nats_url, unique};
use leader_core::{LockError, ResourceLock};
use leader_nats::NatsStore;

/// The stream of bucket `bucket` as `nats kv add` makes it, with `tweak` applied.
fn bucket_config(bucket: &str, tweak: impl FnOnce(&mut stream::Config)) -> stream::Config {
    let mut config = stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        ..Default::default()
    };
    tweak(&mut config);
    config
}

async fn store(url: &str, bucket: &str) -> NatsStore {
    NatsStore::builder(url)
        .bucket(bucket)
        .build()
        .await
        .expect("store")
}

/// A bucket setting under test: its name, the change, and what the refusal must say (nothing:
/// accepted).
type Case = (
    &'static str,
    fn(&mut stream::Config),
    &'static [&'static str],
);

fn misconfigured(result: Result<impl std::fmt::Debug, LockError>, says: &[&str]) -> String {
    match result {
        Err(LockError::Misconfigured { message, .. }) => {
            for word in says {
                assert!(message.contains(word), "{word:?} not in {message:?}");
            }
            message
        }
        other => panic!("expected Misconfigured saying {says:?}, got {other:?}"),
    }
}

#[tokio::test]
async fn buckets_whose_limits_delete_records_are_refused() {
    if leader_test_support::nats_lock_or_skip().is_none() {
        return;
    }
    let client = async_nats::connect(nats_url()).await.expect("connect");
    let jetstream = jetstream::new(client);
    let cases: [Case; 4] = [
        (
            "ttl",
            |c| c.max_age = Duration::from_secs(60),
            &["max_age", "--ttl"],
        ),
        (
            "msgs",
            |c| c.max_messages = 100,
            &["max_msgs", "discard old"],
        ),
        (
            "bytes",
            |c| c.max_bytes = 1 << 20,
            &["max_bytes", "discard old"],
        ),
        // Limits that refuse writes instead of deleting records are fine.
        (
            "new",
            |c| {
                c.max_messages = 100;
                c.discard = stream::DiscardPolicy::New;
            },
            &[],
        ),
    ];
    for (what, tweak, says) in cases {
        let bucket = unique(&format!("settings_{what}")).replace('-', "_");
        jetstream
            .create_stream(bucket_config(&bucket, tweak))
            .await
            .expect("create the bucket");
        let store = store(&nats_url(), &bucket).await;
        let lock = store.lock("settings", "a");
        if says.is_empty() {
            lock.get().await.expect("a bucket that keeps its records");
        } else {
            let message = misconfigured(lock.get().await, says);
            assert!(message.contains(&bucket), "{message}");
        }
        jetstream
            .delete_stream(format!("KV_{bucket}"))
            .await
            .expect("delete the bucket");
    }
}

#[tokio::test]
async fn a_server_without_jetstream_is_misconfigured_naming_it() {
    let Some(server) = Server::start_without_jetstream() else {
        return;
    };
    let store = NatsStore::builder(server.url())
        .bucket("leader")
        .request_timeout(Duration::from_secs(2))
        .build()
        .await
        .expect("store");
    misconfigured(store.lock("e", "a").get().await, &["JetStream", "-js"]);
}

/// Three servers of one cluster (the 2.9 on this machine): a replicated bucket is refused,
/// named with the version, and never created by the lock; a bucket on one replica works.
#[tokio::test]
async fn a_replicated_bucket_on_servers_before_2_9_21_is_refused() {
    let Some(servers) = Server::cluster(3) else {
        return;
    };
    let urls = Server::urls(&servers);
    let client = async_nats::connect(servers[0].url())
        .await
        .expect("connect");
    let version = client.server_info().version;
    let jetstream = jetstream::new(client);
    // The cluster elects its JetStream meta leader first.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match jetstream
            .create_stream(bucket_config("replicated", |c| c.num_replicas = 3))
            .await
        {
            Ok(_) => break,
            Err(err) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no R3 stream: {err}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    jetstream
        .create_stream(bucket_config("single", |_| {}))
        .await
        .expect("an R1 bucket");

    let replicated = store(&urls, "replicated").await;
    let single = store(&urls, "single").await;
    let fixed =
        semver::Version::parse(&version).expect("version") >= semver::Version::new(2, 9, 21);
    if fixed {
        replicated
            .lock("e", "a")
            .get()
            .await
            .expect("a replicated bucket on a fixed server");
    } else {
        misconfigured(
            replicated.lock("e", "a").get().await,
            &["3 replicas", &version, "2.9.21", "nats-server#4319"],
        );
        // Asked to create one, the lock refuses before it creates anything.
        let creating = NatsStore::builder(&urls)
            .bucket("created")
            .create_bucket(true)
            .replicas(3)
            .build()
            .await
            .expect("store");
        misconfigured(creating.lock("e", "a").get().await, &["2.9.21"]);
        assert!(
            jetstream.get_stream("KV_created").await.is_err(),
            "the lock created a bucket it refuses"
        );
    }
    single
        .lock("e", "a")
        .get()
        .await
        .expect("a bucket on one replica");
}
