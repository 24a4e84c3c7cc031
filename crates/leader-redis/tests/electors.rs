//! Electors on one real Redis: exactly one leads, a deleted or expired key, a fast handover.

mod common;

use std::time::Duration;

use common::{Factory, RETRY, Running, unique};
use leader_core::conformance;
use leader_test_support::{next_leader, started_leading};
use tokio::time::{Instant, sleep, timeout};

/// Two and ten electors each elect exactly one; a release wakes the followers (pub/sub), and
/// one takes over well within a retry period.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::electors(&Factory::new(store), true).await;
}

/// The leader's key vanishes (deleted by hand, or expired early): the leader notices on its next
/// renewal and steps down, and a new term starts with a larger fencing token (the counter
/// outlives the key).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_whose_key_vanished_steps_down_at_its_next_renewal() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    for how in ["DEL", "PEXPIRE"] {
        let name = unique("vanish");
        let (leader, token) = started_leading(store.lock(&name, "first")).await;
        // The term's own token: the old leader may step down and win the next term at once, too
        // quickly for a watch of the state to see it not leading in between.
        let first_term = leader.term().expect("leading");
        let follower = Running::start(store.lock(&name, "second"));
        // Mid-way between two renewals, so that a 1 ms TTL runs out before the next one (a
        // renewal in that millisecond would rightly extend the lease).
        sleep(RETRY * 3 / 2).await;
        let key = store.lock(&name, "x").key().to_owned();
        let mut command = redis::cmd(how);
        command.arg(&key);
        if how == "PEXPIRE" {
            command.arg(1);
        }
        let changed: i64 = command
            .query_async(&mut admin)
            .await
            .expect("remove the key");
        assert_eq!(changed, 1);
        let removed = Instant::now();
        timeout(
            RETRY * 2 + Duration::from_millis(200),
            first_term.cancelled(),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{how}: the leader did not step down at its next renewal; leader {:?}; follower {:?}",
                *leader.state.borrow(),
                *follower.state.borrow()
            )
        });
        let stepped_down = removed.elapsed();
        let next = next_leader(&[&leader, &follower], Duration::from_secs(5)).await;
        assert!(next > token, "{how}: fencing token {token} then {next}");
        eprintln!("{how}: stepped down {stepped_down:?} after the key vanished");
        follower.stop().await;
        leader.stop().await;
    }
}

/// An operator's `PERSIST` of the holder's key (or a `RESTORE` without a TTL) while the holder
/// renews it in the store: the follower, which waited on the store's TTL and never counted the
/// lease itself, counts a whole lease from when it saw the store stop keeping it, never from
/// when it first saw the term. The holder's next renewal puts the TTL back, so the follower
/// never takes over a holder that renews while the key is persisted now and then (here about
/// once a second, never in step with the renewals).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_persisted_key_is_not_taken_from_a_holder_that_renews() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let name = unique("persist");
    let (holder, token) = started_leading(store.lock(&name, "holder")).await;
    let follower = Running::start(store.lock(&name, "follower"));
    let key = store.lock(&name, "x").key().to_owned();
    // Past the follower's first sighting plus a lease, several times over.
    let until = Instant::now() + common::LEASE * 3;
    while Instant::now() < until {
        let _: i64 = redis::cmd("PERSIST")
            .arg(&key)
            .query_async(&mut admin)
            .await
            .expect("PERSIST");
        assert!(
            !follower.is_leading(),
            "the follower took the lease of a holder that renews, after a PERSIST"
        );
        assert_eq!(
            holder.leading_token(),
            Some(token),
            "the holder lost its term"
        );
        // Watch closely until the next PERSIST.
        let next = Instant::now() + Duration::from_millis(1130);
        while Instant::now() < next {
            assert!(
                !follower.is_leading(),
                "the follower took the lease of a holder that renews, after a PERSIST"
            );
            sleep(Duration::from_millis(10)).await;
        }
    }
    follower.stop().await;
    holder.stop().await;
}

/// A server busy for more than a second (a script, a fork for a snapshot, a large read) delays
/// an acquisition and a read, and fails neither: the store waits for the answer as long as
/// the elector would, and does not send again a request that may still run. (On a server of
/// the test's own: a busy shared one would hold up the tests beside it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_busy_for_a_second_fails_no_request() {
    use leader_core::{LeaderElectionRecord, ResourceLock};
    let Some(server) = common::PrivateServer::start().await else {
        return;
    };
    let store = leader_redis::RedisStore::connect(server.url.as_str())
        .await
        .expect("store");
    let admin = server.admin().await.expect("server");
    let lock = store.lock(unique("busy"), "first");
    lock.get().await.expect("a first read, to connect");
    // Keeps the server busy for `ARGV[1]` milliseconds, by its own clock.
    let busy = move |millis: u64| {
        let mut admin = admin.clone();
        tokio::spawn(async move {
            redis::cmd("EVAL")
                .arg(
                    "local function now() local t = redis.call('TIME') \
                     return t[1] * 1000 + math.floor(t[2] / 1000) end \
                     local start = now() \
                     while now() - start < tonumber(ARGV[1]) do end return 1",
                )
                .arg(0)
                .arg(millis)
                .query_async::<i64>(&mut admin)
                .await
        })
    };
    let script = busy(1_200);
    sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let desired =
        LeaderElectionRecord::new("first", Duration::from_secs(15), chrono::Utc::now(), 1);
    let acquired = lock.try_acquire(&desired).await.expect("an acquisition");
    assert!(acquired.is_some(), "not acquired");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "the server was not busy"
    );
    // The busy script's own answer comes too late for its connection's timeout.
    let _ = script.await;

    let script = busy(1_200);
    sleep(Duration::from_millis(100)).await;
    let observed = lock.get().await.expect("a read").expect("the record");
    assert!(observed.record.is_held_by("first"));
    // The busy script's own answer comes too late for its connection's timeout.
    let _ = script.await;

    // Requests their callers give up on while the server is busy (the elector's request
    // timeout) leave the connection as it is: the check that follows finds it answering.
    let mut admin = server.admin().await.expect("server");
    let mut connections_made = async || {
        let info: String = redis::cmd("INFO")
            .arg("stats")
            .query_async(&mut admin)
            .await
            .expect("INFO");
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .expect("total_connections_received")
    };
    let before = connections_made().await;
    let script = busy(1_200);
    sleep(Duration::from_millis(100)).await;
    for _ in 0..5 {
        let given_up = tokio::time::timeout(Duration::from_millis(100), lock.get()).await;
        assert!(given_up.is_err(), "answered while the server was busy");
    }
    let _ = script.await;
    sleep(Duration::from_secs(1)).await;
    lock.get().await.expect("a read once the server answers");
    assert_eq!(
        connections_made().await,
        before,
        "the connection to a server that was only slow was replaced"
    );
}
