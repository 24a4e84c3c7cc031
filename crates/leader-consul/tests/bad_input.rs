//! ACLs, unreachable agents, bad settings and names, a raised `session_ttl_min`, records other
//! clients wrote and a server restart, on the test Consul server.

mod common;

use std::time::Duration;

use common::cluster::Cluster;
use common::scenarios;
use common::{ConsulApiServer, get_status, lock, put, store};
use leader_consul::ConsulStore;
use leader_core::conformance::record;
use leader_core::{Acquisition, LockError, ResourceLock};
use leader_test_support::record_writes::{released, renewal};

/// A token is sent, never shown; a missing rule is a 403 that names the ACL rules to grant.
#[tokio::test]
async fn acl_denials_name_the_rule_and_never_the_token() {
    let api = ConsulApiServer::start().await;
    api.require_token("s3cr3t-token");
    let anonymous = lock(&store(&api), "acl", "a");
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
    let a = lock(&with_token, "acl", "a");
    let taken = a
        .try_acquire(&record("a", 0))
        .await
        .expect("with the token");
    assert!(matches!(taken, Some(Acquisition::Acquired(_))));
    api.deny("session:write");
    let other = lock(&with_token, "acl-other", "b");
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
    assert!(!a.describe().contains("s3cr3t"));
}

/// Consul answers an operation of a transaction the token may not do with 409 and "Permission
/// denied" in `Errors[].What` (`Txn.preCheck`), not with 403; a `check-not-exists` needs
/// `key:write` like a write. That is `Forbidden` naming the rule, never a lost
/// compare-and-swap the elector would retry forever. A token that may not read the keys gets
/// them left out of a read transaction's answer (`FilterTxnResults`): `Forbidden` too, never
/// an absent record the lock would create.
#[tokio::test]
async fn a_token_without_key_rights_is_forbidden_naming_the_rule() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    api.deny("key:write");
    scenarios::a_token_without_key_write_is_forbidden(&store).await;
    let a = lock(&store, "denied", "a");

    api.allow("key:write");
    let held = match a.try_acquire(&record("a", 0)).await.expect("allowed") {
        Some(Acquisition::Acquired(held)) => held,
        other => panic!("{other:?}"),
    };
    // A renewal the token may no longer write: Forbidden, so the elector keeps its deadline
    // instead of giving the term up as lost.
    api.deny("key:write");
    let err = a
        .renew(&held.version, &held.record)
        .await
        .expect_err("renewal denied");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    api.allow("key:write");

    api.deny("key:read");
    let err = lock(&store, "denied", "b")
        .get()
        .await
        .expect_err("key:read denied");
    let message = err.to_string();
    assert!(
        matches!(err, LockError::Forbidden { .. }) && message.contains("key:read"),
        "{err:?}"
    );
}

/// An agent that is not there is `Unavailable`, within the timeout; bad addresses, a zero
/// timeout and a datacenter nobody serves are clear errors.
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
    let err = lock(&gone, "x", "a").get().await.expect_err("no agent");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");

    for address in ["127.0.0.1:8500", "ftp://host", "http://user:pw@host:8500"] {
        let err = ConsulStore::builder(address).build().expect_err(address);
        assert!(
            matches!(err, LockError::Misconfigured { .. }),
            "{address}: {err:?}"
        );
        assert!(!err.to_string().contains(":pw@"), "{err}");
    }
    let err = ConsulStore::builder("http://127.0.0.1:8500")
        .timeout(Duration::ZERO)
        .build()
        .expect_err("a zero timeout");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");

    let api = ConsulApiServer::start().await;
    let elsewhere = ConsulStore::builder(api.url())
        .datacenter("dc9")
        .build()
        .expect("store");
    let err = lock(&elsewhere, "x", "a")
        .get()
        .await
        .expect_err("no such dc");
    assert!(
        matches!(err, LockError::Misconfigured { .. })
            && err.to_string().contains("No path to datacenter"),
        "{err:?}"
    );
    // Sessions on a node the datacenter does not know (the agent's node, asked of another
    // datacenter, is the same answer): a setting to fix, not an outage retried forever.
    let nowhere = ConsulStore::builder(api.url())
        .session_node("no-such-node")
        .build()
        .expect("store");
    let err = lock(&nowhere, "x", "a")
        .try_acquire(&record("a", 0))
        .await
        .expect_err("no such node");
    assert!(
        matches!(err, LockError::Misconfigured { .. }) && err.to_string().contains("session_node="),
        "{err:?}"
    );
}

/// Consul checks key names on `GET`, `PUT` and `DELETE /v1/kv` (`validateKVKey`) but not in
/// transactions, which is how the lock writes: an election named `job.json` or `a~b` could be
/// written and never read. Such names, and prefixes, are refused when the lock (or the store)
/// is built; the names the lock accepts are keys Consul serves, and the test server refuses
/// what the lock refuses, as Consul does.
#[tokio::test]
async fn names_consul_would_refuse_are_refused_when_the_lock_is_built() {
    let cluster = Cluster::test().await;
    scenarios::names_consul_would_refuse_are_refused_when_the_lock_is_built(&cluster).await;
    let api = cluster.test_server().expect("the test server");
    let path = format!("{}/v1/kv/leader/job.json", api.url());
    assert_eq!(get_status(&path).await, reqwest::StatusCode::BAD_REQUEST);
}

/// An operator may raise `session_ttl_min` (Consul then answers a shorter TTL with 500
/// "Invalid Session TTL", which a lock sending a TTL would retry forever as an outage). The
/// lock's sessions carry no TTL, so it elects as before.
#[tokio::test]
async fn a_raised_session_ttl_min_does_not_stop_the_lock() {
    let api = ConsulApiServer::start().await;
    api.set_session_ttl_min(Duration::from_secs(3600));
    let a = lock(&store(&api), "ttl-min", "a");
    let mut short = record("a", 0);
    short.lease_duration = Duration::from_secs(2);
    let taken = a.try_acquire(&short).await.expect("try");
    assert!(matches!(taken, Some(Acquisition::Acquired(_))), "{taken:?}");
    let session = api
        .session(&a.session_id().expect("a session"))
        .expect("it exists");
    assert_eq!(session["TTL"], "", "{session}");
    // A session with a TTL below the minimum is what Consul refuses, with a 500.
    let (status, text) = put(
        &format!("{}/v1/session/create", api.url()),
        r#"{"TTL": "10s"}"#,
    )
    .await;
    assert_eq!(status, reqwest::StatusCode::INTERNAL_SERVER_ERROR);
    assert!(text.contains("Invalid Session TTL"), "{text}");
}

/// A record locked by another client's session, whose holder renews its session rather than
/// writing (an earlier version of this lock, `consul lock`), is held until Consul ends that
/// session; then it is taken only a lease after it was first read unlocked.
#[tokio::test]
async fn foreign_locks_hold_until_consul_ends_their_session() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let key = format!("{}foreign", store.prefix());
    let (_, created) = put(
        &format!("{}/v1/session/create", api.url()),
        r#"{"TTL": "10s", "LockDelay": "0s"}"#,
    )
    .await;
    let created: serde_json::Value = serde_json::from_str(&created).expect("JSON");
    let session = created["ID"].as_str().expect("an ID").to_owned();
    let value = String::from_utf8(record("other", 1).to_json()).expect("UTF-8");
    let (_, acquired) = put(
        &format!("{}/v1/kv/{key}?acquire={session}", api.url()),
        &value,
    )
    .await;
    let acquired = acquired == "true";
    assert!(acquired);
    let b = lock(&store, "foreign", "b");
    match b.try_acquire(&record("b", 0)).await.expect("try") {
        Some(Acquisition::Held {
            renewed_in_store: true,
            ..
        }) => {}
        other => panic!("a foreign session's lock must be held in the store: {other:?}"),
    }
    // Its session ends (its TTL ran out): the key is unlocked, the record still names its
    // holder, and candidates count a lease from here.
    api.expire_sessions();
    match b.try_acquire(&record("b", 0)).await.expect("try") {
        Some(Acquisition::Held {
            renewed_in_store: false,
            observed,
            ..
        }) => assert_eq!(observed.record.holder_identity, "other"),
        other => panic!("{other:?}"),
    }
}

/// A holder that died leaves its key locked by its session, which has no TTL and no checks:
/// Consul keeps it until the node leaves. With the renewal key deleted by hand (or written by
/// another client), nothing names that session as renewing by writes; the key is still judged
/// by writes, so a candidate takes it a lease after reading it, instead of waiting for a
/// session that nothing ends. A session with a check, or a TTL, is Consul's to end: the key
/// stays held in the store.
#[tokio::test]
async fn a_dead_holders_key_is_taken_with_its_renewal_key_deleted() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let dead = lock(&store, "orphan", "dead");
    let Some(Acquisition::Acquired(_)) = dead.try_acquire(&record("dead", 0)).await.expect("try")
    else {
        panic!("the first candidate takes the key");
    };
    let locker = dead.session_id().expect("a session");
    // The holder dies: its lock object is dropped without a release; its session stays.
    let renewal_url = format!("{}/v1/kv/{}", api.url(), dead.renewal_key());
    drop(dead);
    let deleted = common::http()
        .delete(&renewal_url)
        .send()
        .await
        .expect("delete");
    assert!(deleted.status().is_success());

    // A token that may not read the session gets an answer without it (Consul filters it
    // out): that is no proof the session ended, and the key stays held in the store.
    api.deny("session:read");
    let blind = lock(&store, "orphan", "blind");
    match blind.try_acquire(&record("blind", 0)).await.expect("try") {
        Some(Acquisition::Held {
            renewed_in_store: true,
            ..
        }) => {}
        other => panic!("a session the token may not read must be waited on: {other:?}"),
    }
    api.allow("session:read");

    let b = lock(&store, "orphan", "b");
    let observed = match b.try_acquire(&record("b", 0)).await.expect("try") {
        Some(Acquisition::Held {
            renewed_in_store: false,
            observed,
            ..
        }) => observed,
        other => panic!("a session nothing ends must not be waited on: {other:?}"),
    };
    assert_eq!(observed.record.holder_identity, "dead");
    // The elector takes it once the version has stayed the same for a lease.
    let taken = b
        .update(&observed.version, &record("b", 0))
        .await
        .expect("the key is taken over");
    assert_eq!(taken.record.holder_identity, "b");
    assert!(taken.record.leader_transitions > observed.record.leader_transitions);
    assert!(
        api.session(&locker).is_none(),
        "the dead holder's session is destroyed"
    );

    // A session with the node's health check, locking a key by hand: Consul ends it when the
    // node fails, so the key is held in the store.
    let (_, created) = put(
        &format!("{}/v1/session/create", api.url()),
        r#"{"LockDelay": "0s"}"#,
    )
    .await;
    let created: serde_json::Value = serde_json::from_str(&created).expect("JSON");
    let checked = created["ID"].as_str().expect("an ID").to_owned();
    let value = String::from_utf8(record("other", 1).to_json()).expect("UTF-8");
    let key = format!("{}checked", store.prefix());
    let (_, acquired) = put(
        &format!("{}/v1/kv/{key}?acquire={checked}", api.url()),
        &value,
    )
    .await;
    assert_eq!(acquired, "true");
    let c = lock(&store, "checked", "c");
    match c.try_acquire(&record("c", 0)).await.expect("try") {
        Some(Acquisition::Held {
            renewed_in_store: true,
            ..
        }) => {}
        other => panic!("a session with a check is Consul's to end: {other:?}"),
    }
}

/// Drops a server's runtime, which closes its port, and waits until it has.
async fn stop(runtime: tokio::runtime::Runtime) {
    tokio::task::spawn_blocking(move || drop(runtime))
        .await
        .expect("the server's runtime stops");
}

/// A server restarted from its state file (as Consul keeps its raft log) still has the key,
/// its lock and the holder's session: the holder renews, others find the key held, and the
/// next term's token continues the count.
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
    let a = lock(&store, "restart", "a");
    let Some(Acquisition::Acquired(taken)) = a.try_acquire(&record("a", 0)).await.expect("try")
    else {
        panic!("a takes the free key");
    };
    stop(runtime).await;

    let (runtime, api) = start(api.address().port()).await;
    assert_eq!(api.sessions(), 1, "the holder's session is kept");
    let renewed = a.renew(&taken.version, &record("a", 0)).await;
    let renewed = renewed.expect("the holder renews after the restart");
    let b = lock(&store, "restart", "b");
    let held = b.try_acquire(&record("b", 0)).await.expect("try");
    assert!(matches!(held, Some(Acquisition::Held { .. })), "{held:?}");
    a.update(
        &renewed.version,
        &record("", taken.record.leader_transitions),
    )
    .await
    .expect("release");
    assert_eq!(api.sessions(), 0, "a release destroys the holder's session");
    match b.try_acquire(&record("b", 0)).await.expect("try") {
        Some(Acquisition::Acquired(observed)) => assert_eq!(
            observed.record.leader_transitions,
            taken.record.leader_transitions + 1
        ),
        other => panic!("{other:?}"),
    }
    stop(runtime).await;
}

/// A renewal is one request, a transaction that writes the renewal key and checks the
/// record's index, which followers' blocking queries on the record do not wake for; someone
/// else's write of the record is found by the next renewal.
#[tokio::test]
async fn renewals_are_one_request_and_find_another_write() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let a = lock(&store, "renewals", "a");
    let Some(Acquisition::Acquired(mut held)) = a.try_acquire(&record("a", 0)).await.expect("try")
    else {
        panic!("a takes the free key");
    };
    let requests = || api.requests().values().sum::<usize>();
    let before = requests();
    for _ in 0..20 {
        let previous = held.version.clone();
        held = a
            .renew(&held.version, &renewal(&held.record))
            .await
            .expect("renew");
        assert_ne!(held.version, previous, "a renewal changes the version");
    }
    assert_eq!(requests() - before, 20, "{:?}", api.requests());

    api.put_raw(a.key(), b"{\"holderIdentity\": \"a\"}");
    let stale = a.renew(&held.version, &held.record).await;
    assert!(stale.is_err_and(|e| e.is_conflict()));
}

/// A handover request (a write on the holder's behalf, which keeps its lock) makes the
/// holder's next renewal conflict, so that the elector reads it.
#[tokio::test]
async fn a_handover_request_makes_the_next_renewal_conflict() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let a = lock(&store, "request", "a");
    let Some(Acquisition::Acquired(held)) = a.try_acquire(&record("a", 0)).await.expect("try")
    else {
        panic!("a takes the free key");
    };
    let held = a
        .renew(&held.version, &renewal(&held.record))
        .await
        .expect("renew");
    leader_core::request_handover(&lock(&store, "request", "operator"), "b")
        .await
        .expect("request");
    let renewal = a.renew(&held.version, &held.record).await;
    assert!(
        renewal.as_ref().is_err_and(LockError::is_conflict),
        "{renewal:?}"
    );
    let read = a.get().await.expect("get").expect("a record");
    assert_eq!(read.record.handover_to(), Some("b"));
    assert_eq!(read.record.holder_identity, "a", "the holder stays");
}

/// Sessions left behind for a key (a hundred processes killed between creating their session
/// and locking the key, holders killed whose successor could not destroy theirs) are
/// destroyed a lease into the next term: Consul keeps a session without a TTL until its node
/// deregisters, and caps nothing (hashicorp/consul#5327). Sessions of other keys stay, and so
/// do those of other nodes: the sweep lists the holder's node alone, never every session of
/// the datacenter.
#[tokio::test]
async fn sessions_left_behind_are_destroyed_a_lease_into_the_next_term() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let a = lock(&store, "orphans", "a");
    let create = |name: String| {
        let url = format!("{}/v1/session/create", api.url());
        async move {
            let body = format!(r#"{{"Name": "{name}", "Behavior": "release", "Checks": []}}"#);
            let (status, answer) = put(&url, &body).await;
            assert!(status.is_success(), "{answer}");
        }
    };
    for i in 0..100 {
        create(format!("leader {} killed-{i}", a.key())).await;
    }
    create("leader another/key someone".to_owned()).await;
    api.register_node("elsewhere");
    let url = format!("{}/v1/session/create", api.url());
    let body = format!(
        r#"{{"Name": "leader {} far", "Node": "elsewhere", "Behavior": "release", "Checks": []}}"#,
        a.key()
    );
    let (status, answer) = put(&url, &body).await;
    assert!(status.is_success(), "{answer}");
    assert_eq!(api.sessions(), 102);
    let mut short = record("a", 0);
    short.lease_duration = Duration::from_millis(500);
    let Some(Acquisition::Acquired(_)) = a.try_acquire(&short).await.expect("try") else {
        panic!("a takes the free key");
    };
    assert_eq!(api.sessions(), 103);
    tokio::time::timeout(Duration::from_secs(5), async {
        while api.sessions() != 3 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} sessions left", api.sessions()));
    // The holder's session still locks the key; the other key's session is untouched.
    let held = a.get().await.expect("get").expect("the record");
    assert_eq!(held.record.holder_identity, "a");
    let renewal = renewal(&held.record);
    a.renew(&held.version, &renewal).await.expect("still held");
    let requests = api.requests();
    assert_eq!(requests.get("GET /v1/session/list"), None, "{requests:?}");
    assert_eq!(
        requests.get("GET /v1/session/node"),
        Some(&1),
        "{requests:?}"
    );
}

/// A candidate whose take timed out keeps its session, and may lock the key with it once the
/// term that was due to sweep ends: the sweep never destroys a session that holds the key
/// (that would end the new holder's term for nothing). A key is swept only while the term
/// that scheduled the sweep still locks it.
#[tokio::test]
async fn a_sweep_never_destroys_the_session_that_holds_the_key() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let a = lock(&store, "kept", "a");
    // b's session, created before a's term, as a take that timed out leaves it.
    let url = format!("{}/v1/session/create", api.url());
    let body = format!(
        r#"{{"Name": "leader {} b", "Behavior": "release", "Checks": []}}"#,
        a.key()
    );
    let (status, answer) = put(&url, &body).await;
    assert!(status.is_success(), "{answer}");
    let kept: serde_json::Value = serde_json::from_str(&answer).expect("JSON");
    let kept = kept["ID"].as_str().expect("an ID").to_owned();
    let mut short = record("a", 0);
    short.lease_duration = Duration::from_millis(500);
    let Some(Acquisition::Acquired(held)) = a.try_acquire(&short).await.expect("try") else {
        panic!("a takes the free key");
    };
    // a's term ends before its sweep is due; b locks the key with the session it kept.
    released(&a, &held).await;
    let value = base64_encode(&record("b", held.record.leader_transitions + 1).to_json());
    let body = format!(
        r#"[{{"KV": {{"Verb": "lock", "Key": "{}", "Value": "{value}", "Session": "{kept}"}}}}]"#,
        a.key()
    );
    let (status, answer) = put(&format!("{}/v1/txn", api.url()), &body).await;
    assert!(status.is_success(), "{answer}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        api.session(&kept).is_some(),
        "the session that holds the key was destroyed by a sweep"
    );
}

/// A shard set's member takes many keys at once: their sweeps share one list of the node's
/// sessions and one read of the keys per batch, instead of a list per key.
#[tokio::test]
async fn sweeps_of_many_keys_share_their_requests() {
    let api = ConsulApiServer::start().await;
    let store = store(&api);
    let mut short = record("a", 0);
    short.lease_duration = Duration::from_millis(500);
    let locks: Vec<_> = (0..50)
        .map(|i| lock(&store, &format!("many-{i}"), "a"))
        .collect();
    for lock in &locks {
        let Some(Acquisition::Acquired(_)) = lock.try_acquire(&short).await.expect("try") else {
            panic!("a takes the free key");
        };
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let requests = api.requests();
    let lists = requests.get("GET /v1/session/node").copied().unwrap_or(0);
    assert!((1..=3).contains(&lists), "{requests:?}");
    assert_eq!(requests.get("GET /v1/session/list"), None, "{requests:?}");
}

fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
