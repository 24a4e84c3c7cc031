//! Bad input against a real Redis: each gives a clear typed error, the elector keeps running and
//! recovers once the fault is gone, and nothing panics or overwrites what it cannot read.

mod common;

use std::time::Duration;

use common::{Running, unique};
use leader_core::conformance::record;
use leader_core::{LockError, LockSet, ResourceLock};
use leader_redis::RedisStore;
use leader_test_support::secrets::assert_wrong_password;
use leader_test_support::unreadable;
use leader_test_support::{assert_acquired, assert_forbidden_saying, assert_unavailable_saying};
use redis::aio::MultiplexedConnection;

async fn cmd(admin: &mut MultiplexedConnection, args: &[&str]) -> redis::Value {
    let mut command = redis::cmd(args[0]);
    for arg in &args[1..] {
        command.arg(*arg);
    }
    command.query_async(admin).await.expect("admin command")
}

/// `ACL SETUSER user RULES...`.
async fn set_user(admin: &mut MultiplexedConnection, user: &str, rules: &[&str]) {
    cmd(admin, &[&["ACL", "SETUSER", user][..], rules].concat()).await;
}

/// An elector on `lock` keeps running without leading while the ACL user `user` is refused,
/// then leads once `rules` are added to the user; the user is deleted after.
async fn leads_once_the_user_gets(
    lock: leader_redis::RedisLock,
    admin: &mut MultiplexedConnection,
    user: &str,
    rules: &[&str],
) {
    let mut elector = Running::start(lock);
    elector
        .stays_alive_without_leading(Duration::from_millis(1500))
        .await;
    set_user(admin, user, rules).await;
    elector.wait_leading(Duration::from_secs(5)).await;
    elector.stop().await;
    cmd(admin, &["ACL", "DELUSER", user]).await;
}

/// A store on the test server as `user:password`; it connects lazily.
async fn store_as(user: &str, password: &str) -> RedisStore {
    let url = common::redis_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    RedisStore::connect(format!("redis://{user}:{password}@{rest}"))
        .await
        .expect("a lazy connection")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_values_are_reported_never_overwritten_and_the_elector_recovers() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let garbage: [(&str, &[&str], &str); 6] = [
        ("a list", &["RPUSH", "{key}", "a", "b"], "another type"),
        (
            "a list at the fence counter",
            &["RPUSH", "{fence}", "a", "b"],
            "holds a list, not a counter",
        ),
        (
            "a word at the fence counter",
            &["SET", "{fence}", "seven"],
            "is not a whole number",
        ),
        ("a string", &["SET", "{key}", "hello"], "another type"),
        (
            "a hash of other fields",
            &["HSET", "{key}", "owner", "me"],
            "none of the lock fields",
        ),
        (
            "a hash with a broken record",
            &[
                "HSET",
                "{key}",
                "version",
                "3",
                "holder",
                "x",
                "transitions",
                "2",
                "record",
                "{\"holderIdentity\":",
            ],
            "not a JSON object",
        ),
    ];
    for (what, write, expected) in garbage {
        let name = unique("garbage");
        let lock = store.lock(&name, "a");
        let key = lock.key().to_owned();
        let fence = lock.fence_key().to_owned();
        let args: Vec<&str> = write
            .iter()
            .map(|a| match *a {
                "{key}" => key.as_str(),
                "{fence}" => fence.as_str(),
                a => a,
            })
            .collect();
        cmd(&mut admin, &args).await;
        let mut elector = unreadable::reported_while_the_elector_waits(lock, what, expected).await;
        let kind = cmd(&mut admin, &["TYPE", args[1]]).await;
        assert_ne!(
            kind,
            redis::Value::SimpleString("none".into()),
            "{what}: the value was removed"
        );
        assert!(
            store.lock(&name, "x").get().await.is_err(),
            "{what}: the value was overwritten"
        );
        cmd(&mut admin, &["DEL", &key, &fence]).await;
        elector.wait_leading(Duration::from_secs(5)).await;
        elector.stop().await;
    }
}

/// S8: a record with odd values another writer may leave (a zero lease) is read as it is, not
/// refused, so the election goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_with_odd_values_is_read_and_taken_over() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let lock = store.lock(unique("odd"), "a");
    let key = lock.key().to_owned();
    let json = r#"{"holderIdentity":"x","leaseDurationMillis":0,"acquireTime":"2024-01-02T00:00:00Z","renewTime":"2024-01-01T00:00:00Z","leaderTransitions":1}"#;
    cmd(
        &mut admin,
        &[
            "HSET",
            &key,
            "version",
            "3",
            "holder",
            "x",
            "transitions",
            "1",
            "record",
            json,
        ],
    )
    .await;
    let read = lock.get().await.expect("an odd record is readable");
    assert_eq!(read.map(|o| o.record.holder_identity).as_deref(), Some("x"));
    let mut elector = Running::start(lock);
    assert!(elector.wait_leading(Duration::from_secs(5)).await > 1);
    elector.stop().await;
    cmd(&mut admin, &["DEL", &key]).await;
}

/// S5 with large fencing-token floors: the scripts count in Lua's numbers, which Redis 7.0 sends
/// back in scientific notation from 10^17 and 7.2.0 to 7.2.4 from 10^9 (`INCR` then refuses the
/// counter for good), and whose JSON has 14 digits. Round floors up to [`MAX_TOKEN`] give
/// rising tokens, stored as whole numbers and read back; a floor above it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_fencing_tokens_stay_whole_and_those_above_the_maximum_are_refused() {
    use leader_core::Acquisition;
    use leader_redis::MAX_TOKEN;
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    for floor in [1_000_000_000, 100_000_000_000_000, MAX_TOKEN - 1] {
        let name = unique("tokens");
        let mut last = 0;
        for identity in ["a", "b"] {
            let lock = store.lock(&name, identity);
            let taken = match lock.try_acquire(&record(identity, floor)).await {
                Ok(Some(Acquisition::Acquired(taken))) => taken,
                other => panic!("floor {floor}: {other:?}"),
            };
            let token = taken.record.leader_transitions;
            assert!(
                token >= floor && token > last,
                "floor {floor}: {last} then {token}"
            );
            last = token;
            let read = lock.get().await.expect("readable").expect("present");
            assert_eq!(read.record.leader_transitions, token);
            let fence = format!("{}:fence", lock.key());
            let stored = cmd(&mut admin, &["GET", &fence]).await;
            assert_eq!(
                stored,
                redis::Value::BulkString(token.to_string().into_bytes())
            );
            let mut free = taken.record.clone();
            free.holder_identity.clear();
            lock.update(&taken.version, &free).await.expect("released");
        }
        let key = store.lock(&name, "a").key().to_owned();
        cmd(&mut admin, &["DEL", &key, &format!("{key}:fence")]).await;
    }
    let lock = store.lock(unique("tokens"), "a");
    leader_test_support::assert_misconfigured_saying(
        lock.try_acquire(&record("a", MAX_TOKEN + 1)).await,
        &[&MAX_TOKEN.to_string(), "floor"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_a_clear_error_that_never_shows_the_password() {
    let Some(mut admin) = common::admin().await else {
        return;
    };
    let user = unique("leader_acl");
    set_user(
        &mut admin,
        &user,
        &["on", ">the-right-one", "~leader:*", "&*", "+@all"],
    )
    .await;
    let secret = "wr0ng-Pa55word";
    let store = store_as(&user, secret).await;
    assert!(
        !format!("{store:?}").contains(secret),
        "Debug shows the password"
    );
    let lock = store.lock(unique("password"), "a");
    assert_wrong_password(lock.get().await, secret);

    // The elector keeps trying, and recovers when the password becomes right.
    leads_once_the_user_gets(lock, &mut admin, &user, &[&format!(">{secret}")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_without_script_rights_gets_a_clear_error_and_recovers_when_granted() {
    let Some(mut admin) = common::admin().await else {
        return;
    };
    let user = unique("leader_noscript");
    set_user(
        &mut admin,
        &user,
        &["on", ">pw", "~leader:*", "&*", "+@all", "-evalsha", "-eval"],
    )
    .await;
    let store = store_as(&user, "pw").await;
    let lock = store.lock(unique("noperm"), "a");
    assert_forbidden_saying(lock.try_acquire(&record("a", 0)).await, &["EVALSHA"]);
    leads_once_the_user_gets(lock, &mut admin, &user, &["+evalsha", "+eval"]).await;
}

/// The rules of the README's `ACL SETUSER` line, with `password` for `PASSWORD`.
fn readme_acl_rules(password: &str) -> Vec<String> {
    include_str!("../README.md")
        .lines()
        .find_map(|line| line.strip_prefix("ACL SETUSER leader "))
        .expect("the README's ACL line")
        .split_whitespace()
        .map(|rule| rule.replace("PASSWORD", password))
        .collect()
}

/// A user made with the README's ACL line passes the conformance suite; one without a
/// command a script runs, or without the channels, is refused as `Forbidden`, saying what the
/// user needs, where the server's answer was a script's `ERR`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_acl_user_conforms_and_a_user_without_a_scripts_command_is_told_why() {
    let Some(mut admin) = common::admin().await else {
        return;
    };
    let user = unique("leader_readme");
    let rules = readme_acl_rules("pw");
    let rules: Vec<&str> = rules.iter().map(String::as_str).collect();
    set_user(&mut admin, &user, &rules).await;
    let store = store_as(&user, "pw").await;
    leader_core::conformance::run_all(&common::Factory::new(store.clone())).await;

    // Each refusal is `Forbidden`, with the server's words for what it refused and what the
    // user needs.
    let refused = |answer: Result<_, LockError>, server_says: &str| {
        leader_test_support::assert_forbidden_saying(
            answer.map(|_| ()),
            &[server_says, "&leader:*"],
        );
    };
    set_user(&mut admin, &user, &["-hset"]).await;
    let lock = store.lock(unique("acl"), "a");
    refused(
        lock.try_acquire(&record("a", 0)).await.map(|_| ()),
        "can't run this command",
    );

    set_user(&mut admin, &user, &["+hset", "resetchannels"]).await;
    let taken = assert_acquired(lock.try_acquire(&record("a", 0)).await);
    refused(
        lock.update(&taken.version, &record("", 1))
            .await
            .map(|_| ()),
        "publish to the channel",
    );

    // A shard set's batch of renewals, one script, is refused the same way.
    set_user(&mut admin, &user, &["&leader:*"]).await;
    let set = store.lock_set("member");
    let key = unique("acl-shard");
    let held = assert_acquired(set.lock(&key).try_acquire(&record("member", 0)).await);
    set_user(&mut admin, &user, &["-pexpire"]).await;
    let renewed = set
        .renew_many(&leader_core::conformance::renewals(&[(key, held)]))
        .await;
    for answer in renewed {
        refused(answer.map(|_| ()), "can't run this command");
    }
    cmd(&mut admin, &["ACL", "DELUSER", &user]).await;
}

#[tokio::test]
async fn an_invalid_url_is_rejected_without_showing_the_password() {
    let err = RedisStore::connect("redis://u:secret@host:notaport/0")
        .await
        .expect_err("bad URL");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("secret"), "{err:?}");
}

/// A connection to a replica (or to a primary a failover demoted, reached through a name that
/// still leads there) is refused every write with `READONLY`: the request fails as an outage
/// that says so, and the connection is replaced, so that the next request reaches the primary
/// once the name leads to it. The proxy is that name: it sends new connections to the primary
/// once moved, and leaves the open one with the replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_a_replica_answered_is_replaced() {
    let Some(replica) = common::PrivateServer::start().await else {
        return;
    };
    let primary = common::PrivateServer::start()
        .await
        .expect("a second server");
    // A replica of a primary that is not there: it refuses writes, and answers reads.
    let nowhere = leader_test_support::free_port().to_string();
    let mut admin = replica.admin().await.expect("replica");
    cmd(&mut admin, &["REPLICAOF", "127.0.0.1", &nowhere]).await;
    let address = |url: &str| {
        let port = url.rsplit(':').next().and_then(|p| p.parse().ok());
        std::net::SocketAddr::from(([127, 0, 0, 1], port.expect("a port")))
    };
    let proxy = leader_test_support::proxy::Proxy::start(address(&replica.url))
        .await
        .expect("proxy");
    let store = RedisStore::connect(format!("redis://127.0.0.1:{}", proxy.port()))
        .await
        .expect("store");
    let lock = store.lock(unique("replica"), "a");
    assert!(lock.get().await.expect("a read").is_none());
    assert_unavailable_saying(
        lock.try_acquire(&record("a", 0)).await,
        &["read only replica", "connection is given up"],
    );
    proxy.move_to(address(&primary.url));
    assert_acquired(lock.try_acquire(&record("a", 0)).await);
}
