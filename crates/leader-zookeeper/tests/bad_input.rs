//! What a misconfigured or broken setup gets: typed errors naming the problem, never a panic,
//! never credentials, nothing overwritten.

mod common;

use std::time::{Duration, Instant};

use common::{make_chroot, raw, unique, zookeeper_chroot, zookeeper_ensemble};
use leader_core::{LockError, ResourceLock, conformance};
use leader_zookeeper::ZooKeeperStore;
use leader_zookeeper::zookeeper_client as zk;

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
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let started = Instant::now();
    let err = ZooKeeperStore::builder(format!("127.0.0.1:{port},127.0.0.1:{port}"))
        .connect_timeout(Duration::from_secs(5))
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
    let builder = |digest: Option<(&str, &str)>| {
        let builder = ZooKeeperStore::builder(zookeeper_ensemble())
            .chroot(zookeeper_chroot())
            .prefix(&prefix);
        match digest {
            Some((user, password)) => builder.digest(user, password),
            None => builder,
        }
    };
    let owner = builder(Some(("app", "app-secret")))
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
        let err = builder(digest).build().await.expect_err(who);
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
    let in_shared = |digest: Option<(&str, &str)>| {
        let builder = ZooKeeperStore::builder(zookeeper_ensemble())
            .chroot(zookeeper_chroot())
            .prefix(&shared);
        match digest {
            Some((user, password)) => builder.digest(user, password),
            None => builder,
        }
    };
    let owner = in_shared(Some(("app", "app-secret")))
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
        let other = in_shared(digest).build().await.expect("store");
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

/// A lease longer than the session timeout the ensemble granted could outlive its record: the
/// lock refuses to hold it, naming both, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_longer_than_the_granted_session_is_refused() {
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
    let lock = store.lock(unique("long"), "a");
    let mut record = conformance::record("a", 1);
    record.lease_duration = granted + Duration::from_secs(1);
    let err = lock.create(&record).await.expect_err("too long a lease");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    assert!(
        err.to_string().contains("longer than the session timeout"),
        "{err}"
    );
    assert_eq!(lock.get().await.expect("get"), None, "it wrote");
    record.lease_duration = granted;
    lock.create(&record)
        .await
        .expect("a lease as long as the session");
}

/// An election znode whose data is not a token count (an operator's write) is an invalid
/// record, reported and never overwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_election_znode_that_holds_no_count_is_an_invalid_record() {
    let Some(store) = common::store().await else {
        return;
    };
    let lock = store.lock(unique("count"), "a");
    lock.create(&conformance::record("a", 1))
        .await
        .expect("create");
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
