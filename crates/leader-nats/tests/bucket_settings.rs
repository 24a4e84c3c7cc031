//! Buckets the lock cannot be safe on are refused when it opens them (S15), in one line naming
//! the setting: records kept in memory, which a server's restart loses, limits that make the
//! server delete records (`max_age`, `max_msgs` or
//! `max_bytes` with discard old), a replicated bucket on servers before 2.10.23 (their
//! clustered compare-and-swap can let two writers win, nats-server#4319, or replicas store
//! different creates, nats-server#5794, and 2.10.20 to 2.10.22 can lose the stream,
//! nats-server#6888: a three-server cluster on loopback here), and a server
//! without JetStream. The same settings changed on a bucket in use (`nats kv edit`, a scale to
//! three replicas) are refused at the next term's start.

mod common;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use common::{Server, nats_url, unique};
use leader_core::{LockError, ResourceLock, conformance};
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

/// JetStream on the test server ([`nats_url`]), or `None` (a skip, a failure under CI).
async fn test_jetstream() -> Option<jetstream::Context> {
    leader_test_support::nats_lock_or_skip()?;
    let client = async_nats::connect(nats_url()).await.expect("connect");
    Some(jetstream::new(client))
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
    let Some(jetstream) = test_jetstream().await else {
        return;
    };
    let cases: [Case; 6] = [
        (
            "memory",
            |c| c.storage = stream::StorageType::Memory,
            &["in memory", "--storage memory", "file storage"],
        ),
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
        // A record could never be written again.
        (
            "new_per_subject",
            |c| {
                c.discard = stream::DiscardPolicy::New;
                c.discard_new_per_subject = true;
            },
            &["discard_new_per_subject"],
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
        let created = jetstream
            .create_stream(bucket_config(&bucket, tweak))
            .await
            .expect("create the bucket");
        let store = store(&nats_url(), &bucket).await;
        let lock = store.lock("settings", "a");
        // A server too old for a setting leaves it out of the stream it makes (2.9 has no
        // discard_new_per_subject): such a bucket is as made.
        let kept =
            what != "new_per_subject" || created.cached_info().config.discard_new_per_subject;
        if says.is_empty() || !kept {
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

/// Three servers of one cluster of the test's own, their client URLs, their version, and a
/// JetStream context on them with `config`'s stream, created once the cluster has elected its
/// JetStream meta leader; `None` (outside CI) without a `nats-server` binary.
async fn cluster_with(
    config: stream::Config,
) -> Option<(Vec<Server>, String, String, jetstream::Context)> {
    let servers = Server::cluster(3)?;
    let urls = Server::urls(&servers);
    let client = async_nats::connect(servers[0].url())
        .await
        .expect("connect");
    let version = client.server_info().version;
    let jetstream = jetstream::new(client);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while let Err(err) = jetstream.create_stream(config.clone()).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no stream {}: {err}",
            config.name
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Some((servers, urls, version, jetstream))
}

/// Whether a server of `version` keeps compare-and-swap on a replicated stream.
fn replicated_compare_and_swap_holds(version: &str) -> bool {
    semver::Version::parse(version).expect("version") >= semver::Version::new(2, 10, 23)
}

/// Applies `tweak` to the settings of the stream `stream`, as `nats kv edit` or `nats stream
/// edit` does, retrying while a cluster is not ready for it.
async fn edit(jetstream: &jetstream::Context, stream: &str, tweak: impl Fn(&mut stream::Config)) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut config = jetstream
            .get_stream(stream)
            .await
            .expect("the stream")
            .cached_info()
            .config
            .clone();
        tweak(&mut config);
        match jetstream.update_stream(config).await {
            Ok(_) => return,
            Err(err) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{stream} not edited: {err}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// A takeover of `holder`'s record by a candidate whose wait ran out, and a creation of another
/// election's record: the two writes that start a term.
async fn start_terms(
    store: &NatsStore,
    election: &str,
    holder: &leader_core::Observed,
) -> [Result<leader_core::Observed, LockError>; 2] {
    let takeover = store
        .lock(election, "b")
        .update(
            &holder.version,
            &conformance::record("b", holder.record.leader_transitions + 1),
        )
        .await;
    let created = store
        .lock(unique("other"), "c")
        .create(&conformance::record("c", 1))
        .await;
    [takeover, created]
}

/// An operator edits a bucket in use (`nats kv edit --ttl`, a limit that discards the oldest
/// values) while a leader holds its record: the next term's start refuses it, naming the
/// setting, and nothing is written; the leader's renewals go on (a renewal starts no term);
/// once the setting is undone, terms start again.
#[tokio::test]
async fn settings_changed_on_a_bucket_in_use_are_refused_at_the_next_term() {
    let Some(jetstream) = test_jetstream().await else {
        return;
    };
    let cases: [Case; 3] = [
        (
            "ttl",
            // As `nats kv edit --ttl 1m` does: the server wants no longer a duplicate window.
            |c| {
                c.max_age = Duration::from_secs(60);
                c.duplicate_window = Duration::from_secs(60);
            },
            &["max_age", "--ttl"],
        ),
        (
            "msgs",
            |c| {
                c.max_messages = 100;
                c.discard = stream::DiscardPolicy::Old;
            },
            &["max_msgs", "discard old"],
        ),
        (
            "bytes",
            |c| {
                c.max_bytes = 1 << 20;
                c.discard = stream::DiscardPolicy::Old;
            },
            &["max_bytes", "discard old"],
        ),
    ];
    for (what, tweak, says) in cases {
        let bucket = unique(&format!("edited_{what}")).replace('-', "_");
        let stream = format!("KV_{bucket}");
        jetstream
            .create_stream(bucket_config(&bucket, |c| {
                c.discard = stream::DiscardPolicy::New;
            }))
            .await
            .expect("create the bucket");
        let holder_store = store(&nats_url(), &bucket).await;
        let candidates = store(&nats_url(), &bucket).await;
        let election = unique("edited");
        let holder = holder_store.lock(&election, "a");
        let held = holder
            .create(&conformance::record("a", 1))
            .await
            .expect("a term on the bucket as made");
        // Both stores have looked the bucket up before the edit.
        assert_eq!(
            candidates.lock(&election, "b").get().await.expect("get"),
            Some(held.clone())
        );

        edit(&jetstream, &stream, tweak).await;
        for refused in start_terms(&candidates, &election, &held).await {
            let message = misconfigured(refused, says);
            assert!(message.contains(&bucket), "{message}");
        }
        assert_eq!(
            holder.get().await.expect("get"),
            Some(held.clone()),
            "a refused term start wrote"
        );
        let renewal = leader_test_support::record_writes::renewal(&held.record);
        let renewed = holder
            .update(&held.version, &renewal)
            .await
            .expect("a renewal starts no term");

        edit(&jetstream, &stream, |c| {
            c.max_age = Duration::ZERO;
            c.max_messages = -1;
            c.max_bytes = -1;
            c.discard = stream::DiscardPolicy::New;
        })
        .await;
        for started in start_terms(&candidates, &election, &renewed).await {
            started.expect("a term on the bucket as it was");
        }
        jetstream
            .delete_stream(&stream)
            .await
            .expect("delete the bucket");
    }
}

/// Three servers of one cluster (the 2.9 on this machine): a replicated bucket is refused,
/// named with the version, and never created by the lock; a bucket on one replica works.
#[tokio::test]
async fn a_replicated_bucket_on_servers_before_2_10_23_is_refused() {
    let Some((_servers, urls, version, jetstream)) =
        cluster_with(bucket_config("replicated", |c| c.num_replicas = 3)).await
    else {
        return;
    };
    jetstream
        .create_stream(bucket_config("single", |_| {}))
        .await
        .expect("an R1 bucket");

    let replicated = store(&urls, "replicated").await;
    let single = store(&urls, "single").await;
    if replicated_compare_and_swap_holds(&version) {
        replicated
            .lock("e", "a")
            .get()
            .await
            .expect("a replicated bucket on a fixed server");
    } else {
        misconfigured(
            replicated.lock("e", "a").get().await,
            &[
                "3 replicas",
                &version,
                "2.9.21",
                "nats-server#4319",
                "2.10.19",
                "nats-server#5794",
                "upgrade every server to 2.10.23",
            ],
        );
        // Asked to create one, the lock refuses before it creates anything.
        let creating = NatsStore::builder(&urls)
            .bucket("created")
            .create_bucket(true)
            .replicas(3)
            .build()
            .await
            .expect("store");
        misconfigured(creating.lock("e", "a").get().await, &["2.10.19"]);
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

/// A bucket on one replica of a three-server cluster, in use, scaled to three replicas (`nats
/// stream edit --replicas 3`): on servers before 2.10.23 the next term's start refuses it,
/// naming the replicas and the version.
#[tokio::test]
async fn a_bucket_scaled_to_three_replicas_in_use_is_refused_at_the_next_term() {
    let Some((servers, urls, version, jetstream)) =
        cluster_with(bucket_config("scaled", |_| {})).await
    else {
        return;
    };
    let holder_store = store(&urls, "scaled").await;
    let candidates = store(&urls, "scaled").await;
    let held = holder_store
        .lock("e", "a")
        .create(&conformance::record("a", 1))
        .await
        .expect("a term on one replica");
    candidates.lock("e", "b").get().await.expect("get");

    edit(&jetstream, "KV_scaled", |c| c.num_replicas = 3).await;
    // While the stream moves to three servers, a write to it may find no stream for a moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let kv = async_nats::jetstream::new(
        async_nats::connect(&servers[1].url())
            .await
            .expect("connect"),
    )
    .get_key_value("scaled")
    .await
    .expect("the bucket");
    while let Err(err) = kv.put("elsewhere", "x".into()).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no write after the scale: {err}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let results = start_terms(&candidates, "e", &held).await;
    if replicated_compare_and_swap_holds(&version) {
        for started in results {
            started.expect("a term on three replicas of a fixed server");
        }
    } else {
        for refused in results {
            misconfigured(refused, &["3 replicas", &version, "2.10.19"]);
        }
        assert_eq!(
            holder_store.lock("e", "a").get().await.expect("get"),
            Some(held),
            "a refused term start wrote"
        );
    }
}
