//! The `GET_LOCK` lock against a real MySQL or MariaDB with a candidate frozen: its connections
//! go through a proxy that, when frozen, passes nothing in either direction and keeps every
//! connection open, which is what the server sees of a process stopped with SIGSTOP. A frozen
//! follower never holds up the election, and a frozen holder's session is dropped by the server
//! after its idle session timeout, not the server's 8 hours.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Running, unique};
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::Conn;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_test_support::proxy::{Mode, Proxy};
use tokio::time::{Instant, sleep, timeout};

/// `url` with its server replaced by `proxy`.
fn url_through(proxy: &Proxy, url: &str) -> String {
    let mut url = url::Url::parse(url).expect("MYSQL_URL");
    url.set_host(Some("127.0.0.1")).expect("host");
    url.set_port(Some(proxy.port())).expect("port");
    url.into()
}

fn server_addr() -> SocketAddr {
    let url = url::Url::parse(&common::mysql_url()).expect("MYSQL_URL");
    let host = url.host_str().expect("a host");
    let port = url.port().unwrap_or(3306);
    std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .expect("resolve")
        .next()
        .expect("an address")
}

/// A session of the server, as its process list shows it.
#[derive(Debug)]
struct Process {
    id: u64,
    command: String,
    info: Option<String>,
    time_ms: f64,
}

/// The server sessions that came through `proxy`.
async fn through(admin: &mut Conn, proxy: &Proxy) -> Vec<Process> {
    let hosts: Vec<String> = proxy
        .upstream_ports()
        .into_iter()
        .map(|port| format!("%:{port}"))
        .collect();
    let mut found = Vec::new();
    for host in hosts {
        let rows: Vec<(u64, String, Option<String>, f64)> = admin
            .exec(
                "SELECT ID, COMMAND, INFO, TIME_MS FROM information_schema.PROCESSLIST \
                 WHERE HOST LIKE ?",
                (host,),
            )
            .await
            .expect("processlist");
        found.extend(
            rows.into_iter()
                .map(|(id, command, info, time_ms)| Process {
                    id,
                    command,
                    info,
                    time_ms,
                }),
        );
    }
    found
}

/// The session of `proxy`'s candidate waiting in `GET_LOCK` (its watch), and how long it has
/// been waiting.
async fn waiting_in_get_lock(admin: &mut Conn, proxy: &Proxy) -> Option<(u64, Duration)> {
    through(admin, proxy)
        .await
        .into_iter()
        .find(|p| {
            p.command != "Sleep"
                && p.info
                    .as_deref()
                    .is_some_and(|info| info.contains("GET_LOCK"))
        })
        .map(|p| (p.id, Duration::from_secs_f64(p.time_ms / 1000.0)))
}

async fn user(admin: &mut Conn, key: &str) -> Option<u64> {
    admin
        .exec_first::<Option<u64>, _, _>("SELECT IS_USED_LOCK(?)", (key,))
        .await
        .expect("IS_USED_LOCK")
        .flatten()
}

/// The test's store, an admin connection, a proxy to the server and a store through it (whose
/// process the proxy can freeze); `None` (a skip) without a server.
async fn behind_a_proxy() -> Option<(MysqlStore, Conn, Proxy, MysqlStore)> {
    let store = common::store().await?;
    let admin = common::admin().await.expect("server");
    let proxy = Proxy::start(server_addr()).await.expect("a proxy port");
    let frozen_store = MysqlStore::builder(url_through(&proxy, &common::mysql_url()))
        .build()
        .await
        .expect("store through the proxy");
    Some((store, admin, proxy, frozen_store))
}

/// A follower whose process stops while its watch waits in `GET_LOCK`: the server goes on with
/// that statement, and gives the frozen session the user-level lock when the leader releases.
/// The watch lets go of it in the same statement, so the next candidate leads at once; before,
/// the frozen session kept it until the server dropped the connection (`wait_timeout`, 8 hours
/// by default), and nobody could lead.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_frozen_in_get_lock_holds_up_nobody() {
    let Some((store, mut admin, proxy, frozen_store)) = behind_a_proxy().await else {
        return;
    };
    let name = unique("frozen-follower");
    let leading = store.named_lock(&name, "leader");
    let key = leading.key().to_owned();
    let mut leader = Running::start(leading);
    leader.wait_leading(Duration::from_secs(10)).await;
    let follower = Running::start(frozen_store.named_lock(&name, "frozen"));

    // Freeze the follower while its watch waits in GET_LOCK with at least a second of its
    // wait (2 s) left, so that the leader's release lands inside it.
    let mut frozen_wait = None;
    for _ in 0..50 {
        let deadline = Instant::now() + Duration::from_secs(5);
        while waiting_in_get_lock(&mut admin, &proxy).await.is_none() {
            assert!(
                Instant::now() < deadline,
                "the follower's watch never waited"
            );
            sleep(Duration::from_millis(10)).await;
        }
        proxy.set(Mode::Cut);
        match waiting_in_get_lock(&mut admin, &proxy).await {
            Some((id, waited)) if waited < Duration::from_secs(1) => {
                frozen_wait = Some(id);
                break;
            }
            _ => proxy.set(Mode::Open),
        }
        sleep(Duration::from_millis(100)).await;
    }
    let watch_session = frozen_wait.expect("the follower frozen inside a GET_LOCK wait");

    let stopping = Instant::now();
    leader.stop().await;
    // The frozen session's wait ends with the release (not its timeout, a second away at
    // least): the server gives it the user-level lock.
    let granted = loop {
        let idle = through(&mut admin, &proxy)
            .await
            .into_iter()
            .find(|p| p.id == watch_session)
            .is_some_and(|p| p.command == "Sleep");
        if idle || stopping.elapsed() > Duration::from_millis(900) {
            break idle && stopping.elapsed() < Duration::from_millis(900);
        }
        sleep(Duration::from_millis(5)).await;
    };
    assert!(
        granted,
        "the release did not reach the frozen wait (stop took {:?})",
        stopping.elapsed()
    );

    let released = Instant::now();
    let mut next = Running::start(store.named_lock(&name, "next"));
    let bound = Duration::from_secs(3);
    let led = timeout(bound, next.leadership()).await;
    let holder = user(&mut admin, &key).await;
    assert!(
        led.is_ok(),
        "nobody led {bound:?} after the release: the user-level lock is held by session \
         {holder:?} (the frozen follower's watch is {watch_session})"
    );
    eprintln!(
        "frozen follower: the next candidate led {:?} after the release",
        released.elapsed()
    );
    assert!(
        follower.leading_token().is_none(),
        "the frozen follower leads"
    );

    // The server drops the frozen watch's connection once it has been silent for the watch
    // interval (2 s) and 5 s more.
    let silent_since = stopping;
    let within = Duration::from_secs(2 + 5 + 2);
    while through(&mut admin, &proxy)
        .await
        .iter()
        .any(|p| p.id == watch_session)
    {
        assert!(
            silent_since.elapsed() < within,
            "the frozen watch's connection is still there {within:?} on"
        );
        sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "frozen follower: its watch's connection dropped {:?} after its last statement",
        silent_since.elapsed()
    );
    next.stop().await;
    proxy.set(Mode::Open);
    follower.stop().await;
}

/// A holder whose process stops keeps its session's user-level lock until the server drops
/// the silent session: after the lock's idle session timeout (3 s here), not the server's
/// `wait_timeout` of 8 hours. The next candidate leads soon after, once the lease has run out
/// by the server's clock too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_holders_session_is_dropped_after_its_idle_timeout() {
    let Some((store, mut admin, proxy, frozen_store)) = behind_a_proxy().await else {
        return;
    };
    let name = unique("frozen-holder");
    let idle = Duration::from_secs(3);
    let holding = frozen_store
        .named_lock(&name, "frozen")
        .idle_session_timeout(idle);
    let key = holding.key().to_owned();
    let handle = holding.clone();
    let mut holder = Running::start(holding);
    holder.wait_leading(Duration::from_secs(10)).await;
    let mut next = Running::start(store.named_lock(&name, "next"));
    sleep(common::RETRY * 2).await;
    let session = handle.session_id().await.expect("the holder's session");
    assert_eq!(user(&mut admin, &key).await, Some(u64::from(session)));

    proxy.set(Mode::Cut);
    let frozen = Instant::now();
    // Its last statement came at most a retry period before the freeze; the lease (3 s) runs out
    // by then too.
    let bound = idle + common::RETRY * 2 + Duration::from_secs(2);
    let led = timeout(bound, next.leadership()).await;
    let holder_now = user(&mut admin, &key).await;
    assert!(
        led.is_ok(),
        "nobody led {bound:?} after the holder froze: the user-level lock is held by session \
         {holder_now:?} (the frozen holder's is {session})"
    );
    eprintln!(
        "frozen holder: the next candidate led {:?} after the freeze",
        frozen.elapsed()
    );
    next.stop().await;
    proxy.set(Mode::Open);
    holder.stop().await;
}
