//! Scenarios that run on the test Consul server (`tests/sessions.rs`, `tests/blocking.rs`,
//! `tests/bad_input.rs`) and against a real agent on request (`tests/agent.rs`).

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use leader_consul::ConsulStore;
use leader_core::background::{Candidate, RETRY};
use leader_core::conformance::record;
use leader_core::{Acquisition, LeaderElector, LockError, ResourceLock};
use serde_json::Value;
use tokio::time::Instant;

use super::cluster::Cluster;
use super::{lock, prefix};

/// The holder's timings: a retry period long enough that a holder whose session ended leads on
/// for a while before its next renewal finds out.
pub const LEASE: Duration = Duration::from_secs(4);
pub const RENEW: Duration = Duration::from_secs(3);
pub const HOLDER_RETRY: Duration = Duration::from_secs(1);

/// A holder on the holder's agent that leads, and a follower on the other agent (with the
/// conformance suite's timings) waiting for the same election; and their key prefix.
pub async fn holder_and_follower(cluster: &Cluster, name: &str) -> (Candidate, Candidate, String) {
    let prefix = prefix();
    let mut holder = Candidate::build(
        LeaderElector::builder(lock(&cluster.store(true, &prefix), name, "holder"))
            .lease_duration(LEASE)
            .renew_deadline(RENEW)
            .retry_period(HOLDER_RETRY),
    );
    holder.wait_leading(Duration::from_secs(5)).await;
    let follower = Candidate::start(lock(&cluster.store(false, &prefix), name, "follower"));
    // Let the follower read the record and subscribe to it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!follower.is_leading());
    (holder, follower, prefix)
}

/// What [`after`] saw, each as how long after the fault began: the holder's term ending, the
/// follower first leading, and the holder leading again in a new term.
#[derive(Debug)]
pub struct Seen {
    pub ended: Option<Duration>,
    pub led: Option<Duration>,
    pub retaken: Option<Duration>,
}

impl Seen {
    /// When either candidate first led after the holder's term ended. Where the holder's node
    /// is still (or again) registered, the holder may lock the key again once its lock-delay
    /// ends, as the follower may: whichever asks first after it leads.
    pub fn next_leader(&self) -> Option<Duration> {
        match (self.led, self.retaken) {
            (Some(led), Some(retaken)) => Some(led.min(retaken)),
            (led, retaken) => led.or(retaken),
        }
    }
}

/// Runs `fault` while `holder` leads, then watches both for `window` (and a lease more while
/// nobody has led again), asserting that they never lead at once.
pub async fn after(
    holder: &Candidate,
    follower: &Candidate,
    fault: impl Future<Output = ()>,
    window: Duration,
) -> Seen {
    let term = holder.term().expect("the holder leads");
    let at = Instant::now();
    fault.await;
    let mut seen = Seen {
        ended: None,
        led: None,
        retaken: None,
    };
    // Nobody leading again by the window's end (a loaded machine) is given a lease more, still
    // watched for two leaders: the window bounds the safety check, not a wait.
    while at.elapsed() < window || (seen.next_leader().is_none() && at.elapsed() < window + LEASE) {
        let (holding, following) = (holder.is_leading(), follower.is_leading());
        assert!(
            !(holding && following),
            "two leaders {:?} after the fault",
            at.elapsed()
        );
        if seen.ended.is_none() && term.is_cancelled() {
            seen.ended = Some(at.elapsed());
        }
        if seen.led.is_none() && following {
            seen.led = Some(at.elapsed());
        }
        if seen.retaken.is_none() && seen.ended.is_some() && holding {
            seen.retaken = Some(at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    seen
}

/// The one session of the lock's with key prefix `prefix` (the holder's).
pub async fn session_of(cluster: &Cluster, prefix: &str) -> Value {
    let sessions = cluster.sessions(prefix).await;
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    sessions[0].clone()
}

/// Panics unless the session that locks `prefix`'s key is the follower's; `why` says what
/// that shows.
async fn assert_the_followers_session(cluster: &Cluster, prefix: &str, why: &str) {
    let session = session_of(cluster, prefix).await;
    assert!(
        session["Name"]
            .as_str()
            .is_some_and(|n| n.ends_with(" follower")),
        "{why}: {session}"
    );
}

/// An operator destroys the holder's session (`PUT /v1/session/destroy/ID`): Consul unlocks the
/// key at once and keeps it under the session's lock-delay (the lease). The holder's next
/// renewal finds the key no longer locked by its session, and its term ends at its renew
/// deadline; nobody leads before the lock-delay ends, and then the follower (a lease after it
/// read the key unlocked) or the holder (with a new session) does.
pub async fn an_operators_destroy_never_gives_two_leaders(cluster: &Cluster) {
    let (holder, follower, prefix) = holder_and_follower(cluster, "destroy").await;
    let session = session_of(cluster, &prefix).await;
    let id = session["ID"].as_str().expect("an ID").to_owned();
    let seen = after(&holder, &follower, cluster.destroy(&id), LEASE * 2).await;
    let ended = seen.ended.expect("the holder's term ends");
    assert!(ended <= RENEW, "the holder stopped {ended:?} after");
    let next = seen.next_leader().expect("a leader after the lease");
    assert!(next >= LEASE, "{seen:?} after the destroy");
    holder.stop().await;
    follower.stop().await;
}

/// The holder's node is deregistered while its agent still answers (`consul force-leave
/// -prune`, `PUT /v1/catalog/deregister`): its session ends and its renewals conflict until its
/// renew deadline ends the term. Nobody leads before; a lease after the key was read unlocked
/// the follower leads (on the test server, where the holder's node stays gone and the holder
/// cannot lock the key again; on a real agent, whose node is registered again at once, the
/// holder may take it back first).
pub async fn a_force_left_node_never_gives_two_leaders(cluster: &Cluster) {
    let (holder, follower, _) = holder_and_follower(cluster, "force-leave").await;
    let node = cluster.holder_node();
    let seen = after(&holder, &follower, cluster.deregister(&node), LEASE * 2).await;
    let ended = seen.ended.expect("the holder's term ends");
    assert!(ended <= RENEW, "the holder stopped {ended:?} after");
    if cluster.test_server().is_some() {
        let led = seen.led.expect("the follower leads");
        assert!(led >= LEASE, "the follower led {led:?} after");
    } else {
        let next = seen.next_leader().expect("a leader after the lease");
        assert!(next >= LEASE, "{seen:?}");
    }
    holder.stop().await;
    follower.stop().await;
}

/// A release is an `unlock`, which no lock-delay follows: the follower leads at once, and the
/// holder's session goes with it.
pub async fn a_release_still_hands_over_at_once(cluster: &Cluster) {
    let (holder, mut follower, prefix) = holder_and_follower(cluster, "release").await;
    let started = Instant::now();
    let stopped = holder.stop().await;
    assert!(stopped.iter().all(|s| s.released), "{stopped:?}");
    follower.wait_leading(Duration::from_secs(2)).await;
    assert!(
        started.elapsed() < RETRY,
        "the follower led {:?} after the release",
        started.elapsed()
    );
    assert_the_followers_session(
        cluster,
        &prefix,
        "the holder's session went with its release",
    )
    .await;
    follower.stop().await;
}

/// A holder that crashes (no release, no close: its session stays and locks the key) is
/// replaced once its renewals have stopped for a lease, within a lease and one jittered retry
/// period of the follower (up to 2.2 retry periods), not when Consul would end a session
/// (twice a TTL of at least 10 s, plus the lock-delay). The follower then destroys the dead
/// holder's session.
pub async fn a_crashed_holder_is_replaced_within_a_lease_and_a_jittered_retry_period(
    cluster: &Cluster,
) {
    let (holder, mut follower, prefix) = holder_and_follower(cluster, "crash").await;
    let crashed = Instant::now();
    holder.task.abort();
    follower.wait_leading(LEASE * 3).await;
    let failover = crashed.elapsed();
    let bound = LEASE + RETRY.mul_f64(2.2) + Duration::from_millis(500);
    assert!(
        failover <= bound,
        "failover {failover:?} after the crash, more than {bound:?}"
    );
    assert_the_followers_session(cluster, &prefix, "the dead holder's session was destroyed").await;
    follower.stop().await;
}

/// The lock's sessions carry no TTL, so no `session_ttl_min` can refuse them, and no health
/// check (`"Checks": []`, which `fixupEmptySessionChecks` turns into no node checks either): only
/// the lock, an operator or the node's deregistration ends them.
pub async fn sessions_carry_no_ttl_and_no_checks(cluster: &Cluster) {
    let (holder, follower, prefix) = holder_and_follower(cluster, "checks").await;
    let session = session_of(cluster, &prefix).await;
    assert_eq!(session["TTL"].as_str().unwrap_or_default(), "", "{session}");
    let checks = |field: &str| session[field].as_array().map_or(0, Vec::len);
    assert_eq!(checks("NodeChecks") + checks("Checks"), 0, "{session}");
    holder.stop().await;
    follower.stop().await;
}

/// The change stream of `lock`, consumed as the elector does (a query always in flight): a
/// receiver of its items.
pub async fn changes(lock: &impl ResourceLock) -> tokio::sync::mpsc::UnboundedReceiver<()> {
    let mut stream = lock.watch().await.expect("watch").expect("a stream");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(()) = stream.next().await {
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    // Let its first blocking query start.
    tokio::time::sleep(Duration::from_millis(100)).await;
    rx
}

/// Whether `changes` reports an item within 2 s.
pub async fn reported(changes: &mut tokio::sync::mpsc::UnboundedReceiver<()>) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(2), changes.recv()).await,
        Ok(Some(()))
    )
}

/// A follower watching an election nobody ran yet wakes when its key is created, not for
/// writes to other keys (and, on the test server, which counts them, with no request for
/// them either).
pub async fn a_watch_on_a_missing_key_wakes_for_its_creation_only(cluster: &Cluster) {
    let prefix = prefix();
    let store = cluster.store(false, &prefix);
    let follower = lock(&store, "missing", "b");
    let mut changes = changes(&follower).await;
    let reads = || {
        cluster
            .test_server()
            .map(|api| api.requests().get("GET /v1/kv").copied().unwrap_or(0))
    };
    let before = reads();
    for i in 0..20 {
        cluster.put(&format!("{prefix}other-{i}"), "x").await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(changes.try_recv().is_err(), "woken by writes to other keys");
    assert_eq!(reads(), before, "a blocking query answered for other keys");

    let a = lock(&store, "missing", "a");
    let taken = a.try_acquire(&record("a", 0)).await.expect("try");
    assert!(matches!(taken, Some(Acquisition::Acquired(_))));
    assert!(
        reported(&mut changes).await,
        "not woken by the key's creation"
    );
    a.close().await;
}

/// Names and prefixes whose key Consul's KV API would refuse or send elsewhere are refused
/// when the lock (or the store) is built, naming a name that would do; the names the lock
/// accepts are keys Consul's KV API reads.
pub async fn names_consul_would_refuse_are_refused_when_the_lock_is_built(cluster: &Cluster) {
    let store = cluster.store(false, &prefix());
    for (name, instead) in [
        ("job.json", "job-json"),
        ("a~b", "a-b"),
        ("nightly report", "nightly-report"),
        ("x/../y", "x/y"),
    ] {
        let err = store.lock(name, "a").expect_err(name);
        let message = err.to_string();
        assert!(
            matches!(err, LockError::Misconfigured { .. })
                && message.contains(&format!("{instead:?} would do")),
            "{name}: {message}"
        );
    }
    let err = ConsulStore::builder("http://127.0.0.1:8500")
        .prefix("team a/")
        .build()
        .expect_err("a prefix with a space");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    for name in ["job-json", "jobs/nightly", "v1.2,eu"] {
        let a = lock(&store, name, "a");
        let taken = a.try_acquire(&record("a", 0)).await.expect("try");
        assert!(matches!(taken, Some(Acquisition::Acquired(_))), "{name}");
        let read = cluster
            .call("GET", &format!("/v1/kv/{}", a.key()), None)
            .await;
        assert_eq!(read[0]["Key"].as_str(), Some(a.key()), "{read}");
        a.close().await;
    }
}

/// A token that may create sessions and read keys but not write them: Consul refuses the
/// transaction's first write with 409 "Permission denied" (`check-not-exists` needs
/// `key:write` too), which the lock reports as `Forbidden`, naming the rule, never as a lost
/// compare-and-swap to retry forever.
pub async fn a_token_without_key_write_is_forbidden(store: &ConsulStore) {
    let a = lock(store, "denied", "a");
    let err = a
        .try_acquire(&record("a", 0))
        .await
        .expect_err("key:write denied");
    let message = err.to_string();
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    assert!(
        message.contains("Permission denied")
            && message.contains("check-not-exists")
            && message.contains("key:write")
            && message.contains(&format!("key_prefix \"{}\"", store.prefix())),
        "{message}"
    );
    let err = a.create(&record("a", 1)).await.expect_err("create");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    a.close().await;
}
