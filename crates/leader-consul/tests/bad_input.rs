//! ACLs, unreachable agents, bad settings and records other clients wrote, on the test Consul
//! server.

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
