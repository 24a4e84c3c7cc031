//! What a misconfigured or broken setup gets: typed errors naming the problem, never a panic,
//! never credentials, nothing overwritten.

mod common;

use std::time::{Duration, Instant};

use common::{make_chroot, raw, unique, zookeeper_chroot, zookeeper_ensemble};
use leader_core::{LockError, ResourceLock, conformance};
use leader_test_support::record_writes::created;
use leader_test_support::zookeeper_ensemble::ZooKeeperEnsemble;
use leader_zookeeper::zookeeper_client as zk;
use leader_zookeeper::{ZooKeeperStore, ZooKeeperStoreBuilder};

/// A store on the ensemble at `connect` that gives up connecting after 5 s.
fn connecting(connect: &str) -> ZooKeeperStoreBuilder {
    ZooKeeperStore::builder(connect).connect_timeout(Duration::from_secs(5))
}

/// A store on the test ensemble under the run's chroot and `prefix`, logging in with `digest`
/// (user and password) when given.
fn under(prefix: &str, digest: Option<(&str, &str)>) -> ZooKeeperStoreBuilder {
    let builder = ZooKeeperStore::builder(zookeeper_ensemble())
        .chroot(zookeeper_chroot())
        .prefix(prefix);
    match digest {
        Some((user, password)) => builder.digest(user, password),
        None => builder,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chroot_that_does_not_exist_is_misconfigured() {
    if raw().await.is_none() {
        return;
    }
    let chroot = format!("{}/{}", zookeeper_chroot(), unique("missing"));
    let err = ZooKeeperStore::builder(zookeeper_ensemble())
        .chroot(&chroot)
        .build()
        .await
        .expect_err("no such chroot");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("chroot does not exist")
            && message.contains(&format!("zkCli.sh create {chroot}")),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ensemble_that_is_down_at_start_is_unavailable_at_once() {
    let port = leader_test_support::free_port();
    let started = Instant::now();
    let err = connecting(&format!("127.0.0.1:{port},127.0.0.1:{port}"))
        .build()
        .await
        .expect_err("nothing listens");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}: every server refused, so the store need not wait for the timeout",
        started.elapsed()
    );
}

/// A lock under digest credentials creates its znodes readable and writable by that user
/// alone: a session without credentials, or with a wrong password (ZooKeeper's digest scheme
/// takes any, as another identity), is forbidden to read or write them, and the record stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn znodes_under_digest_credentials_refuse_other_sessions() {
    let Some(client) = raw().await else {
        return;
    };
    make_chroot(&client, "").await;
    let prefix = format!("/{}", unique("acl"));
    let owner = under(&prefix, Some(("app", "app-secret")))
        .build()
        .await
        .expect("store");
    owner
        .lock("billing", "a")
        .create(&conformance::record("a", 1))
        .await
        .expect("the owner writes");
    // Reading an ACL needs a right on the znode (ZOOKEEPER-1392): the owner reads it.
    let (acls, _) = owner
        .client()
        .await
        .expect("session")
        .get_acl(owner.lock("billing", "a").path())
        .await
        .expect("acl");
    assert!(
        acls.iter()
            .all(|acl| acl.scheme() == "digest" && acl.id().starts_with("app:")),
        "{acls:?}"
    );
    for (who, digest) in [
        ("anonymous", None),
        ("wrong password", Some(("app", "wrong-secret"))),
    ] {
        // The prefix is the owner's too: a store is refused at once.
        let err = under(&prefix, digest).build().await.expect_err(who);
        assert!(matches!(err, LockError::Forbidden { .. }), "{who}: {err:?}");
        assert!(!err.to_string().contains("secret"), "{who}: {err}");
    }
    // A prefix anyone may use (an operator's), an election the owner made in it: the others'
    // locks are refused reading and writing it.
    let shared = format!("/{}", unique("shared"));
    client
        .mkdir(
            &format!("{}{shared}", zookeeper_chroot()),
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .expect("a shared prefix");
    let owner = under(&shared, Some(("app", "app-secret")))
        .build()
        .await
        .expect("store");
    let created = owner
        .lock("billing", "a")
        .create(&conformance::record("a", 1))
        .await
        .expect("the owner writes");
    for (who, digest) in [
        ("anonymous", None),
        ("wrong password", Some(("app", "wrong-secret"))),
    ] {
        let other = under(&shared, digest).build().await.expect("store");
        let lock = other.lock("billing", "b");
        let err = lock.get().await.expect_err(who);
        assert!(matches!(err, LockError::Forbidden { .. }), "{who}: {err:?}");
        assert!(err.to_string().contains("ACL"), "{who}: {err}");
        let err = lock
            .update(&created.version, &conformance::record("b", 2))
            .await
            .expect_err(who);
        assert!(matches!(err, LockError::Forbidden { .. }), "{who}: {err:?}");
        assert!(!err.to_string().contains("secret"), "{who}: {err}");
        assert!(!format!("{other:?}").contains("secret"));
    }
    assert_eq!(
        owner.lock("billing", "a").get().await.expect("get"),
        Some(created),
        "a refused write changed the record"
    );
}

/// A lease longer than the granted session timeout less the client's connection timeout could
/// outlive its record (the ensemble times the session from its followers' reports, up to a
/// client ping interval early): the lock refuses to hold it, naming the bound, and writes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_longer_than_the_granted_session_less_the_connection_timeout_is_refused() {
    let Some(client) = raw().await else {
        return;
    };
    make_chroot(&client, "").await;
    let store = ZooKeeperStore::builder(zookeeper_ensemble())
        .chroot(zookeeper_chroot())
        .session_timeout(Duration::from_secs(6))
        .build()
        .await
        .expect("store");
    let granted = store.client().await.expect("session").session_timeout();
    assert_eq!(
        granted,
        Duration::from_secs(6),
        "within the servers' bounds"
    );
    // The store asks for a connection timeout of at most 2/5 of the session: 2.4 s.
    let longest = granted - Duration::from_millis(2400);
    let lock = store.lock(unique("long"), "a");
    let mut record = conformance::record("a", 1);
    for lease in [
        granted + Duration::from_secs(1),
        granted,
        longest + Duration::from_millis(1),
    ] {
        record.lease_duration = lease;
        let err = lock.create(&record).await.expect_err("too long a lease");
        assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains("less the connection timeout") && message.contains("3.6s"),
            "{lease:?}: {message}"
        );
        assert_eq!(lock.get().await.expect("get"), None, "it wrote");
        let err = lock.check_lease(lease).await.expect_err("too long a lease");
        assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    }
    lock.check_lease(longest).await.expect("the longest lease");
    record.lease_duration = longest;
    lock.create(&record).await.expect("the longest lease");

    // However short the connection timeout, the lease stays 1.5 s below the session: the
    // ensemble's leader hears of a session on a follower every half tick.
    let quick = ZooKeeperStore::builder(zookeeper_ensemble())
        .chroot(zookeeper_chroot())
        .session_timeout(Duration::from_secs(6))
        .connection_timeout(Duration::from_millis(200))
        .build()
        .await
        .expect("store");
    let lock = quick.lock(unique("quick"), "a");
    let err = lock
        .check_lease(Duration::from_millis(4600))
        .await
        .expect_err("within 1.5 s of the session");
    assert!(err.to_string().contains("at least 1.5s"), "{err}");
    lock.check_lease(Duration::from_millis(4500))
        .await
        .expect("1.5 s below the session");
}

/// An ensemble that requires authentication refuses a session without credentials, and says
/// that none were sent (not that they were refused); with digest credentials, the same
/// ensemble takes the session. An ensemble that requires SASL refuses digest credentials, and
/// the message says the lock speaks no SASL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_refused_for_want_of_credentials_says_none_were_sent() {
    let Some(ensemble) = ZooKeeperEnsemble::start_with(
        1,
        "enforce.auth.enabled=true\nenforce.auth.schemes=digest",
        &[],
    ) else {
        return;
    };
    let connect = ensemble.connect_string();
    let store = |digest: bool| {
        let builder = connecting(&connect);
        if digest {
            builder.digest("app", "app-secret")
        } else {
            builder
        }
    };
    let err = store(false).build().await.expect_err("no credentials");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("sent no credentials"), "{message}");
    assert!(!message.contains("refused the session's"), "{message}");
    let owner = store(true).build().await.expect("digest credentials");
    owner
        .lock("billing", "a")
        .create(&conformance::record("a", 1))
        .await
        .expect("the session writes");

    let Some(sasl) = ZooKeeperEnsemble::start_with(
        1,
        "enforce.auth.enabled=true\nenforce.auth.schemes=sasl\nauthProvider.sasl=org.apache.zookeeper.server.auth.SASLAuthenticationProvider",
        &[],
    ) else {
        return;
    };
    let answer = connecting(&sasl.connect_string())
        .digest("app", "app-secret")
        .build()
        .await;
    if let Err(err) = &answer {
        assert!(!err.to_string().contains("secret"), "{err}");
    }
    leader_test_support::assert_forbidden_saying(answer, &["digest credentials", "SASL"]);
}

/// An election znode whose data is not a token count (an operator's write) is an invalid
/// record, reported and never overwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_znode_that_holds_no_count_is_an_invalid_record() {
    let Some(store) = common::store().await else {
        return;
    };
    let lock = store.lock(unique("count"), "a");
    created(&lock).await;
    let client = store.client().await.expect("session");
    client
        .set_data(lock.path(), b"not a number", None)
        .await
        .expect("an operator's write");
    let err = lock.get().await.expect_err("no count");
    assert!(matches!(err, LockError::InvalidRecord { .. }), "{err:?}");
    let (data, _) = client.get_data(lock.path()).await.expect("read");
    assert_eq!(data, b"not a number");
}
