//! ACLs, unreachable agents, bad settings, records other clients wrote and a server restart, on
//! the test Consul server.

mod common;

use std::time::Duration;

use common::{ConsulApiServer, store};
use leader_consul::ConsulStore;
use leader_core::conformance::record;
use leader_core::{Acquisition, LockError, ResourceLock};

/// A token is sent, never shown; a missing rule is a 403 that names the ACL rules to grant.
#[tokio::test]
async fn acl_denials_name_the_rule_and_never_the_token() {
    let api = ConsulApiServer::start().await;
    api.require_token("s3cr3t-token");
    let anonymous = store(&api).lock("acl", "a");
    let err = anonymous
        .try_acquire(&record("a", 0))
        .await
        .expect_err("no token");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("key_prefix") && message.contains("session_prefix"),
        "{message}"
    );

    let with_token = ConsulStore::builder(api.url())
        .token("s3cr3t-token")
        .build()
        .expect("store");
    assert!(!format!("{with_token:?}").contains("s3cr3t"));
    let lock = with_token.lock("acl", "a");
    let taken = lock
        .try_acquire(&record("a", 0))
        .await
        .expect("with the token");
    assert!(matches!(taken, Some(Acquisition::Acquired(_))));
    api.deny("session:write");
    let other = with_token.lock("acl", "b");
    let err = other
        .create(&record("b", 1))
        .await
        .expect_err("session:write denied");
    let message = err.to_string();
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    assert!(
        message.contains("session:write") && !message.contains("s3cr3t"),
        "{message}"
    );
    assert!(!lock.describe().contains("s3cr3t"));
}

/// An agent that is not there is `Unavailable`, within the timeout; bad addresses and a
/// datacenter nobody serves are clear errors.
#[tokio::test]
async fn unreachable_agents_and_bad_settings() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let gone = ConsulStore::builder(format!("http://127.0.0.1:{port}"))
        .timeout(Duration::from_secs(1))
        .build()
        .expect("store");
    let err = gone.lock("x", "a").get().await.expect_err("no agent");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");

    for address in ["127.0.0.1:8500", "ftp://host", "http://user:pw@host:8500"] {
        let err = ConsulStore::builder(address).build().expect_err(address);
        assert!(
            matches!(err, LockError::Misconfigured { .. }),
            "{address}: {err:?}"
        );
        assert!(!err.to_string().contains(":pw@"), "{err}");
    }

    let api = ConsulApiServer::start().await;
    let elsewhere = ConsulStore::builder(api.url())
        .datacenter("dc9")
        .build()
        .expect("store");
    let err = elsewhere
        .lock("x", "a")
        .get()
        .await
        .expect_err("no such dc");
    assert!(err.to_string().contains("No path to datacenter"), "{err}");
}

/// A record locked by another client's session is held until that session ends; a lease
/// shorter than Consul's 10 s minimum TTL gets a 10 s session.
#[tokio::test]
async fn foreign_locks_hold_and_short_leases_get_the_minimum_ttl() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let a = store.lock("short", "a");
    let mut short = record("a", 0);
    short.lease_duration = Duration::from_secs(2);
    // The server refuses a TTL below 10 s (400), so this acquisition shows the session got 10 s.
    let taken = a.try_acquire(&short).await.expect("try");
    assert!(matches!(taken, Some(Acquisition::Acquired(_))));
    assert_eq!(api.sessions(), 1, "one session for the holder");
    let b = store.lock("short", "b");
    let held = b.try_acquire(&record("b", 0)).await.expect("try");
    assert!(
        matches!(
            held,
            Some(Acquisition::Held {
                renewed_in_store: true,
                ..
            })
        ),
        "{held:?}"
    );
    // The session invalidated (its TTL ran out): b takes the key, with a larger token.
    api.expire_sessions();
    match b.try_acquire(&record("b", 0)).await.expect("try") {
        Some(Acquisition::Acquired(observed)) => assert_eq!(observed.record.leader_transitions, 2),
        other => panic!("{other:?}"),
    }
    // The holder's next renewal finds its session gone.
    let stale = a.renew(&leader_core::Version::new("1"), &short).await;
    assert!(stale.is_err_and(|e| e.is_conflict()));
}

/// Drops a server's runtime, which closes its port, and waits until it has.
async fn stop(runtime: tokio::runtime::Runtime) {
    tokio::task::spawn_blocking(move || drop(runtime))
        .await
        .expect("the server's runtime stops");
}

/// A server restarted from its state file (as Consul keeps its raft log) still has the key,
/// its lock and the holder's session, whose timer starts anew: the holder renews, others find
/// the key held, and the next term's token continues the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_keeps_sessions_and_locks() {
    let dir = tempfile::tempdir().expect("dir");
    let state = dir.path().join("state.json");
    // Each incarnation of the server runs on a runtime of its own, dropped to crash it.
    let start = |port: u16| {
        let state = state.clone();
        async move {
            let runtime = tokio::runtime::Runtime::new().expect("runtime");
            let api = runtime
                .spawn(async move {
                    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                        .await
                        .expect("bind");
                    ConsulApiServer::serve_with_state(listener, Some(&state)).expect("serve")
                })
                .await
                .expect("server");
            (runtime, api)
        }
    };
    let (runtime, api) = start(0).await;
    let store = store(&api);
    let a = store.lock("restart", "a");
    let Some(Acquisition::Acquired(taken)) = a.try_acquire(&record("a", 0)).await.expect("try")
    else {
        panic!("a takes the free key");
    };
    stop(runtime).await;

    let (runtime, api) = start(api.address().port()).await;
    assert_eq!(api.sessions(), 1, "the holder's session is kept");
    let renewed = a.renew(&taken.version, &record("a", 0)).await;
    let renewed = renewed.expect("the holder renews after the restart");
    let b = store.lock("restart", "b");
    let held = b.try_acquire(&record("b", 0)).await.expect("try");
    assert!(matches!(held, Some(Acquisition::Held { .. })), "{held:?}");
    a.update(
        &renewed.version,
        &record("", taken.record.leader_transitions),
    )
    .await
    .expect("release");
    match b.try_acquire(&record("b", 0)).await.expect("try") {
        Some(Acquisition::Acquired(observed)) => assert_eq!(
            observed.record.leader_transitions,
            taken.record.leader_transitions + 1
        ),
        other => panic!("{other:?}"),
    }
    stop(runtime).await;
}

/// A renewal is one request, the session's renewal, while the holder's blocking query on its
/// key has seen no other write; a write by another client (which keeps the holder's session,
/// as a plain `PUT` does) is found by the next renewal once that query reports it.
#[tokio::test]
async fn renewals_are_one_request_until_someone_else_writes() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let a = store.lock("renewals", "a");
    let Some(Acquisition::Acquired(mut held)) = a.try_acquire(&record("a", 0)).await.expect("try")
    else {
        panic!("a takes the free key");
    };
    let count = |endpoint: &str| api.requests().get(endpoint).copied().unwrap_or(0);
    let (renewals, reads) = (count("PUT /v1/session/renew"), count("GET /v1/kv"));
    for _ in 0..20 {
        held = a.renew(&held.version, &held.record).await.expect("renew");
    }
    assert_eq!(count("PUT /v1/session/renew") - renewals, 20);
    // At most the holder's blocking query, if it had not started before.
    assert!(count("GET /v1/kv") - reads <= 1, "{:?}", api.requests());

    api.put_raw(a.key(), b"{\"holderIdentity\": \"a\"}");
    let found = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match a.renew(&held.version, &held.record).await {
                Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                Err(err) => return err,
            }
        }
    })
    .await
    .expect("a renewal finds the write");
    assert!(found.is_conflict(), "{found}");
}

/// Once the change stream has reported a write (here a handover request), the holder's next
/// renewal reads the key, even where the holder's own query on it has not reported the write
/// yet: the elector renews on a change precisely to read what changed.
#[tokio::test]
async fn a_renewal_after_a_reported_change_reads_it() {
    use futures_util::StreamExt;
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    for round in 0..50 {
        let name = format!("reported-{round}");
        let a = store.lock(&name, "a");
        let Some(Acquisition::Acquired(held)) = a.try_acquire(&record("a", 0)).await.expect("try")
        else {
            panic!("a takes the free key");
        };
        let mut changes = a.watch().await.expect("watch").expect("a stream");
        leader_core::request_handover(&store.lock(&name, "operator"), "b")
            .await
            .expect("request");
        changes.next().await.expect("the request is reported");
        let renewal = a.renew(&held.version, &held.record).await;
        assert!(
            renewal.as_ref().is_err_and(LockError::is_conflict),
            "round {round}: {renewal:?}"
        );
        a.close().await;
    }
}
