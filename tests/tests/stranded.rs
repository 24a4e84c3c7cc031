//! Every lock whose store is a server on a long-lived TCP connection, through what a firewall or
//! NAT does when it drops the state of that connection: what the leader sends vanishes, and no
//! reset tells the driver; new connections pass. A leader alone in its election must go on
//! leading, or lead again, on a new connection, instead of failing every request until TCP
//! gives up on the old one (a quarter of an hour later on Linux) or for as long as it runs.
//!
//! One test per store, each a candidate on its server through a proxy of its own
//! ([`Proxy::strand`]); the stores' own tests cover what each does on its connection.

use std::time::Duration;

use futures_util::StreamExt;

use leader_core::background::Candidate;
use leader_core::{CancellationToken, LeaderElector, Shards, ShardsState};
use leader_test_support::{in_ci, unique};
use leader_tests::harness::proxy::Proxy;
use tokio::time::sleep;

const LEASE: Duration = Duration::from_secs(4);
const RENEW: Duration = Duration::from_secs(3);
const RETRY: Duration = Duration::from_millis(500);

/// `url` with its (first) server replaced by a proxy to it, and the proxy; `None` (a skip
/// outside CI) when the server does not answer.
async fn through_a_proxy(what: &str, url: &str) -> Option<(Proxy, String)> {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let (user_info, servers) = match authority.rsplit_once('@') {
        Some((user_info, servers)) => (format!("{user_info}@"), servers),
        None => (String::new(), authority),
    };
    let server = servers.split(',').next().expect("a server");
    let Ok(Some(upstream)) = tokio::net::lookup_host(server)
        .await
        .map(|mut found| found.next())
    else {
        panic!("{what}: cannot resolve {server}");
    };
    if tokio::net::TcpStream::connect(upstream).await.is_err() {
        assert!(!in_ci(), "{what} does not answer at {server} (CI=true)");
        eprintln!("skipped: {what} does not answer at {server}");
        return None;
    }
    let proxy = Proxy::start(upstream).await.expect("a proxy port");
    let proxied = format!(
        "{scheme}://{user_info}127.0.0.1:{}{}",
        proxy.port(),
        &rest[authority_end..]
    );
    Some((proxy, proxied))
}

/// Opens the lock `url` names through a proxy, elects it alone, strands its connections, and
/// checks that it goes on leading or leads again.
async fn a_stranded_leader_leads_again(what: &str, url: &str) {
    let Some((proxy, url)) = through_a_proxy(what, url).await else {
        return;
    };
    let lock = leader::open(&url, &unique("stranded"), "a")
        .await
        .unwrap_or_else(|err| panic!("{what}: open the lock: {err}"));
    leads_again(what, &proxy, lock).await;
}

/// Elects `lock` (behind `proxy`) alone, strands its connections, and checks that it goes on
/// leading or leads again.
async fn leads_again(what: &str, proxy: &Proxy, lock: impl leader_core::ResourceLock + 'static) {
    let mut candidate = Candidate::build(
        LeaderElector::builder(lock)
            .lease_duration(LEASE)
            .renew_deadline(RENEW)
            .retry_period(RETRY),
    );
    let first = candidate.wait_leading(Duration::from_secs(10)).await;
    let term = candidate.term().expect("leading");
    sleep(RETRY * 2).await;

    proxy.strand();
    sleep(LEASE * 2).await;
    if !term.is_cancelled() && candidate.is_leading() {
        eprintln!("{what}: the term went on");
    } else {
        // Without a new connection it never leads again.
        let second = candidate.wait_leading(LEASE * 4).await;
        assert!(
            second > first,
            "{what}: fencing token {first} then {second}"
        );
        eprintln!("{what}: the term ended, and the next began");
    }
    candidate.stop().await;
}

/// Opens the lock `url` names through a proxy as a follower, watches it, strands its
/// connections, and checks that a release reaches the follower within 40 s: on the stream it
/// watched, or, when that stream ended (its connection found dead), on the next.
async fn a_stranded_follower_hears_a_release(what: &str, url: &str) {
    let Some((proxy, proxied)) = through_a_proxy(what, url).await else {
        return;
    };
    let name = unique("stranded-follower");
    let follower = leader::open(&proxied, &name, "b")
        .await
        .unwrap_or_else(|err| panic!("{what}: open the lock: {err}"));
    let watch = async || {
        follower
            .watch()
            .await
            .unwrap_or_else(|err| panic!("{what}: watch: {err}"))
    };
    let watch = async || {
        watch()
            .await
            .unwrap_or_else(|| panic!("{what}: the lock has no change stream"))
    };
    let mut changes = watch().await;
    proxy.strand();
    let stranded = tokio::time::Instant::now();
    // Whatever the follower's client does about the connection, it does without a release.
    loop {
        match tokio::time::timeout(Duration::from_secs(20), changes.next()).await {
            Ok(Some(())) => {}
            Ok(None) => {
                changes = watch().await;
                break;
            }
            Err(_) => break,
        }
    }
    let heard = tokio::time::timeout(Duration::from_secs(40), async {
        loop {
            let mut leader = Candidate::build(
                LeaderElector::builder(
                    leader::open(url, &name, "a")
                        .await
                        .unwrap_or_else(|err| panic!("{what}: open the lock: {err}")),
                )
                .lease_duration(LEASE)
                .renew_deadline(RENEW)
                .retry_period(RETRY),
            );
            leader.wait_leading(Duration::from_secs(10)).await;
            leader.stop().await;
            match tokio::time::timeout(Duration::from_secs(5), changes.next()).await {
                Ok(Some(())) => return,
                // The stream ended: its connection was found dead, and the next watch is on a
                // new one.
                Ok(None) => changes = watch().await,
                Err(_) => {}
            }
        }
    })
    .await;
    assert!(
        heard.is_ok(),
        "{what}: no release reached the follower within {:?} of the stranding",
        stranded.elapsed()
    );
}

/// The lock URL of the tests' Redis, under a prefix of the run's own.
fn redis_url() -> String {
    let url = leader_test_support::redis_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}prefix={}:", unique("stranded"))
}

/// The tests' MySQL with the `GET_LOCK` lock, whose server lets go of a stranded session's
/// lock after its idle session timeout.
fn mysql_named_url() -> String {
    let url = leader_test_support::mysql_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}lock=named&idle_session_timeout=5s")
}

/// The tests' Postgres with the advisory lock, whose server lets go of a stranded session's
/// lock after its idle session timeout.
fn postgres_advisory_url() -> String {
    let url = leader_test_support::database_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}advisory=true&idle_session_timeout=5s")
}

/// The first of the tests' etcd members, under a prefix of the run's own.
fn etcd_url() -> String {
    let endpoint = leader_test_support::etcd_endpoints()
        .into_iter()
        .next()
        .expect("an etcd endpoint");
    let server = endpoint
        .split_once("://")
        .map_or(endpoint.as_str(), |(_, server)| server)
        .trim_end_matches('/');
    format!("etcd://{server}/?prefix={}/", unique("stranded"))
}

/// The tests' NATS server and bucket.
fn nats_url() -> String {
    let url = leader_test_support::nats_url();
    let bucket = leader_test_support::nats_bucket();
    format!("{}/{bucket}", url.trim_end_matches('/'))
}

/// The tests' ZooKeeper ensemble (its first server, through the proxy), under a prefix of the
/// run's own.
fn zookeeper_url() -> String {
    let ensemble = leader_test_support::zookeeper_ensemble();
    format!("zk://{ensemble}/?prefix=/{}", unique("stranded"))
}

/// The shards of the stranded member's set.
const SHARDS: u32 = 3;

/// Opens the shard set `url` names through a proxy as its one member, waits until it owns every
/// shard, strands its connections, and checks that it owns every shard again within four leases
/// of the stranding (or never lost them).
async fn a_stranded_shard_member_owns_its_shards_again(what: &str, url: &str) {
    let Some((proxy, proxied)) = through_a_proxy(what, url).await else {
        return;
    };
    let name = unique("stranded-set");
    let set = leader::open_set(&proxied, &name, "m")
        .await
        .unwrap_or_else(|err| panic!("{what}: open the shard set: {err}"));
    let shards = Shards::builder(&name, SHARDS, set)
        .lease_duration(LEASE)
        .renew_deadline(RENEW)
        .retry_period(RETRY)
        .build()
        .expect("shard settings");
    let mut state = shards.subscribe();
    let shutdown = CancellationToken::new();
    let member = tokio::spawn(shards.run(shutdown.clone()));
    let owns_all = |state: &ShardsState| state.tokens().len() == SHARDS as usize;
    tokio::time::timeout(Duration::from_secs(20), state.wait_for(owns_all))
        .await
        .unwrap_or_else(|_| panic!("{what}: the member did not own every shard"))
        .expect("the member runs");
    proxy.strand();
    sleep(LEASE * 2).await;
    let again = tokio::time::timeout(LEASE * 4, state.wait_for(owns_all))
        .await
        .is_ok_and(|owned| owned.is_ok());
    assert!(
        again,
        "{what}: the member owns {:?} of {SHARDS} shards four leases after the stranding",
        state.borrow().tokens()
    );
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), member).await;
}

/// A test a store, of its leader, of a follower where its lock has a change stream, and of a
/// shard member where it keeps shard sets, side by side on proxies of their own.
macro_rules! each_store {
    ($($store:ident: $what:literal, $url:expr, follower: $follower:literal, shards: $shards:literal;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $store() {
                let url = $url;
                let follower = async {
                    if $follower {
                        a_stranded_follower_hears_a_release($what, &url).await;
                    }
                };
                let member = async {
                    if $shards {
                        a_stranded_shard_member_owns_its_shards_again($what, &url).await;
                    }
                };
                tokio::join!(a_stranded_leader_leads_again($what, &url), follower, member);
            }
        )*
    };
}

each_store! {
    redis: "Redis", redis_url(), follower: true, shards: true;
    postgres: "Postgres", leader_test_support::database_url(), follower: true, shards: true;
    postgres_advisory: "Postgres advisory lock", postgres_advisory_url(), follower: true, shards: false;
    // The table lock has no change stream: its followers read the record. Shard sets use the
    // table lock, whichever lock the URL names.
    mysql: "MySQL", leader_test_support::mysql_url(), follower: false, shards: true;
    mysql_named: "MySQL GET_LOCK", mysql_named_url(), follower: true, shards: false;
    etcd: "etcd", etcd_url(), follower: true, shards: true;
    nats: "NATS", nats_url(), follower: true, shards: true;
    zookeeper: "ZooKeeper", zookeeper_url(), follower: true, shards: true;
}

/// A Postgres store on a pool of the user's own, whose connections the lock checks at each
/// checkout after another user of the pool had them: the check, too, is a request on a
/// stranded connection, and that connection must not go back to the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_on_a_pool_of_its_own() {
    use leader_postgres::deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
    use leader_postgres::tokio_postgres::{Config, NoTls};
    let what = "Postgres on a pool of its own";
    let Some((proxy, url)) = through_a_proxy(what, &leader_test_support::database_url()).await
    else {
        return;
    };
    let config: Config = url.parse().expect("DATABASE_URL");
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager).max_size(4).build().expect("a pool");
    let store = leader_postgres::PostgresStore::builder(&url)
        .pool(pool.clone())
        .build()
        .await
        .expect("a store on the pool");
    // Another user of the pool: every connection the lock takes was someone else's since.
    let other = tokio::spawn(async move {
        loop {
            if let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(1), pool.get()).await {
                let _ = tokio::time::timeout(Duration::from_secs(1), client.simple_query("")).await;
            }
            sleep(Duration::from_millis(50)).await;
        }
    });
    leads_again(what, &proxy, store.lock(unique("stranded"), "a")).await;
    other.abort();
}
