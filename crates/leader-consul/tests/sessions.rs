//! What ends a holder's Consul session besides the lock itself, and what electors make of it,
//! on the test Consul server with an agent per node: an operator's destroy, the holder's agent
//! leaving, its node force-left, a failing node check; a holder that crashes; a release.
//!
//! Consul unlocks the key of an invalidated session at once (`deleteSessionTxn`), while the
//! holder leads on until its next renewal fails or, cut off, until its renew deadline. No
//! follower may lead before the holder has stopped; a release still hands over at once.

mod common;

use std::future::Future;
use std::time::Duration;

use common::{ConsulApiServer, lock, prefix, put};
use leader_consul::ConsulStore;
use leader_core::LeaderElector;
use leader_core::background::{Candidate, RETRY};
use tokio::time::Instant;

/// The holder's timings: a retry period long enough that a holder whose session ended leads on
/// for a while before its next renewal finds out.
const LEASE: Duration = Duration::from_secs(4);
const RENEW: Duration = Duration::from_secs(3);
const HOLDER_RETRY: Duration = Duration::from_secs(1);

/// A store on `agent`, with requests that give up after a second (an agent that left answers
/// nothing).
fn store_on(agent: &ConsulApiServer, prefix: &str) -> ConsulStore {
    ConsulStore::builder(agent.url())
        .prefix(prefix)
        .timeout(Duration::from_secs(1))
        .build()
        .expect("a store")
}

/// A holder on `agent` that leads, and a follower on `other` (with the conformance suite's
/// timings) waiting for the same election.
async fn holder_and_follower(
    agent: &ConsulApiServer,
    other: &ConsulApiServer,
    name: &str,
) -> (Candidate, Candidate) {
    let prefix = prefix();
    let mut holder = Candidate::build(
        LeaderElector::builder(lock(&store_on(agent, &prefix), name, "holder"))
            .lease_duration(LEASE)
            .renew_deadline(RENEW)
            .retry_period(HOLDER_RETRY),
    );
    holder.wait_leading(Duration::from_secs(5)).await;
    let follower = Candidate::start(lock(&store_on(other, &prefix), name, "follower"));
    // Let the follower read the record and subscribe to it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!follower.is_leading());
    (holder, follower)
}

/// Runs `fault` while `holder` leads, then watches both for `window`, asserting that they never
/// lead at once; returns how long after the fault the holder's term ended and the follower
/// first led, if they did.
async fn after(
    holder: &Candidate,
    follower: &Candidate,
    fault: impl Future<Output = ()>,
    window: Duration,
) -> (Option<Duration>, Option<Duration>) {
    let term = holder.term().expect("the holder leads");
    let at = Instant::now();
    fault.await;
    let mut ended = None;
    let mut led = None;
    while at.elapsed() < window {
        let (holding, following) = (holder.is_leading(), follower.is_leading());
        assert!(
            !(holding && following),
            "two leaders {:?} after the fault",
            at.elapsed()
        );
        if ended.is_none() && term.is_cancelled() {
            ended = Some(at.elapsed());
        }
        if led.is_none() && following {
            led = Some(at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    (ended, led)
}

/// An operator destroys the holder's session (`PUT /v1/session/destroy/ID`): Consul unlocks the
/// key at once and keeps it under the session's lock-delay (the lease). The holder's next
/// renewal finds the key no longer locked by its session, and its term ends at its renew
/// deadline; the follower leads a lease after it read the key unlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_destroy_never_gives_two_leaders() {
    let api = ConsulApiServer::start().await;
    let agent = api.agent("node-a").await;
    let (holder, follower) = holder_and_follower(&agent, &api, "destroy").await;
    let destroyed = session_of(&api);
    let destroy = async {
        let (status, _) = put(&format!("{}/v1/session/destroy/{destroyed}", api.url()), "").await;
        assert!(status.is_success());
    };
    let (ended, led) = after(&holder, &follower, destroy, LEASE * 2).await;
    let ended = ended.expect("the holder's term ends");
    assert!(ended <= RENEW, "the holder stopped {ended:?} after");
    let led = led.expect("a leader after the lease");
    assert!(led >= LEASE, "the follower led {led:?} after the destroy");
    holder.stop().await;
    follower.stop().await;
}

/// The holder's agent leaves (`consul leave`): the servers deregister its node, which ends the
/// holder's session (`deleteNodeTxn`), and the holder, cut off from its agent, leads until its
/// renew deadline. The follower on another agent leads only after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_leaves_never_gives_two_leaders() {
    let api = ConsulApiServer::start().await;
    let agent = api.agent("node-a").await;
    let (holder, follower) = holder_and_follower(&agent, &api, "leave").await;
    let (ended, led) = after(&holder, &follower, async { agent.leave() }, LEASE * 2).await;
    let ended = ended.expect("the holder's term ends");
    assert!(
        ended >= RENEW - HOLDER_RETRY * 2,
        "the holder, cut off, stopped {ended:?} after, before its deadline could have passed"
    );
    let led = led.expect("the follower leads");
    assert!(led >= LEASE, "the follower led {led:?} after the leave");
    holder.stop().await;
    follower.stop().await;
}

/// The holder's node is deregistered while its agent still answers (`consul force-leave`,
/// `PUT /v1/catalog/deregister`): its session ends, and its renewals, which need a new session
/// for a node Consul no longer knows, fail until its renew deadline ends the term; the
/// follower leads a lease after it read the key unlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_left_node_never_gives_two_leaders() {
    let api = ConsulApiServer::start().await;
    let agent = api.agent("node-a").await;
    let (holder, follower) = holder_and_follower(&agent, &api, "force-leave").await;
    let deregister = async {
        let (status, _) = put(
            &format!("{}/v1/catalog/deregister", api.url()),
            r#"{"Node": "node-a"}"#,
        )
        .await;
        assert!(status.is_success());
    };
    let (ended, led) = after(&holder, &follower, deregister, LEASE * 2).await;
    let ended = ended.expect("the holder's term ends");
    assert!(ended <= RENEW, "the holder stopped {ended:?} after");
    let led = led.expect("the follower leads");
    assert!(led >= LEASE, "the follower led {led:?} after");
    holder.stop().await;
    follower.stop().await;
}

/// A release is an `unlock`, which no lock-delay follows: the follower leads at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_still_hands_over_at_once() {
    let api = ConsulApiServer::start().await;
    let agent = api.agent("node-a").await;
    let (holder, mut follower) = holder_and_follower(&agent, &api, "release").await;
    let started = Instant::now();
    let stopped = holder.stop().await;
    assert!(stopped.iter().all(|s| s.released), "{stopped:?}");
    follower.wait_leading(Duration::from_secs(2)).await;
    assert!(
        started.elapsed() < RETRY,
        "the follower led {:?} after the release",
        started.elapsed()
    );
    assert_eq!(
        api.sessions(),
        1,
        "the holder's session went with its release"
    );
    follower.stop().await;
}

/// A holder that crashes (no release, no close: its session stays and locks the key) is
/// replaced once its renewals have stopped for a lease, within a lease and one jittered retry
/// period of the follower (up to 2.2 retry periods), not when Consul would end a session
/// (twice a TTL of at least 10 s, plus the lock-delay). The follower then destroys the dead
/// holder's session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holder_is_replaced_within_a_lease_and_a_jittered_retry_period() {
    let api = ConsulApiServer::start().await;
    let agent = api.agent("node-a").await;
    let (holder, mut follower) = holder_and_follower(&agent, &api, "crash").await;
    let crashed = Instant::now();
    holder.task.abort();
    follower.wait_leading(LEASE * 3).await;
    let failover = crashed.elapsed();
    let bound = LEASE + RETRY.mul_f64(2.2) + Duration::from_millis(500);
    assert!(
        failover <= bound,
        "failover {failover:?} after the crash, more than {bound:?}"
    );
    assert_eq!(api.sessions(), 1, "the dead holder's session was destroyed");
    follower.stop().await;
}

/// The lock's sessions carry no health check (`"Checks": []`, which `fixupEmptySessionChecks`
/// turns into no node checks either): a failing `serfHealth` does not end the holder's term,
/// which only its renew deadline and a lease of silence decide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_node_check_does_not_end_the_term() {
    let api = ConsulApiServer::start().await;
    let agent = api.agent("node-a").await;
    let (holder, follower) = holder_and_follower(&agent, &api, "checks").await;
    let id = session_of(&api);
    let session = api.session(&id).expect("the holder's session");
    assert_eq!(session["NodeChecks"], serde_json::json!([]), "{session}");
    api.set_check("node-a", "serfHealth", "critical");
    tokio::time::sleep(LEASE + RETRY).await;
    assert!(holder.is_leading() && !follower.is_leading());
    assert!(api.session(&id).is_some(), "the session lives on");
    holder.stop().await;
    follower.stop().await;
}

/// The one session there is (the holder's).
fn session_of(api: &ConsulApiServer) -> String {
    let ids = api.session_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    ids[0].clone()
}
