//! What ends a holder's Consul session besides the lock itself, and what electors make of it,
//! on the test Consul server with an agent per node: an operator's destroy, the holder's agent
//! leaving, its node force-left, a failing node check; a holder that crashes; a release.
//!
//! Consul unlocks the key of an invalidated session at once (`deleteSessionTxn`), while the
//! holder leads on until its next renewal fails or, cut off, until its renew deadline. No
//! follower may lead before the holder has stopped; a release still hands over at once. The
//! scenarios shared with the real-agent tests are in `common/scenarios.rs`.

mod common;

use common::cluster::Cluster;
use common::scenarios::{self, HOLDER_RETRY, LEASE, RENEW, after, holder_and_follower};
use leader_core::background::RETRY;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_destroy_never_gives_two_leaders() {
    scenarios::an_operators_destroy_never_gives_two_leaders(&Cluster::test().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_left_node_never_gives_two_leaders() {
    scenarios::a_force_left_node_never_gives_two_leaders(&Cluster::test().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_still_hands_over_at_once() {
    scenarios::a_release_still_hands_over_at_once(&Cluster::test().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holder_is_replaced_within_a_lease_and_a_jittered_retry_period() {
    let cluster = Cluster::test().await;
    scenarios::a_crashed_holder_is_replaced_within_a_lease_and_a_jittered_retry_period(&cluster)
        .await;
}

/// The holder's agent leaves (`consul leave`): the servers deregister its node, which ends the
/// holder's session (`deleteNodeTxn`), and the holder, cut off from its agent, leads until its
/// renew deadline. The follower on another agent leads only after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_leaves_never_gives_two_leaders() {
    let cluster = Cluster::test().await;
    let Cluster::Test { holder: agent, .. } = &cluster else {
        unreachable!("the test server");
    };
    let (holder, follower, _) = holder_and_follower(&cluster, "leave").await;
    let seen = after(&holder, &follower, async { agent.leave() }, LEASE * 2).await;
    let ended = seen.ended.expect("the holder's term ends");
    assert!(
        ended >= RENEW - HOLDER_RETRY * 2,
        "the holder, cut off, stopped {ended:?} after, before its deadline could have passed"
    );
    let led = seen.led.expect("the follower leads");
    assert!(led >= LEASE, "the follower led {led:?} after the leave");
    holder.stop().await;
    follower.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_carry_no_ttl_and_no_checks() {
    scenarios::sessions_carry_no_ttl_and_no_checks(&Cluster::test().await).await;
}

/// A failing `serfHealth` on the holder's node does not end its term, which only its renew
/// deadline and a lease of silence decide: its session is tied to no check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_node_check_does_not_end_the_term() {
    let cluster = Cluster::test().await;
    let api = cluster.test_server().expect("the test server");
    let (holder, follower, prefix) = holder_and_follower(&cluster, "failing-check").await;
    api.set_check(&cluster.holder_node(), "serfHealth", "critical");
    tokio::time::sleep(LEASE + RETRY).await;
    assert!(holder.is_leading() && !follower.is_leading());
    assert_eq!(
        cluster.sessions(&prefix).await.len(),
        1,
        "the session lives on"
    );
    holder.stop().await;
    follower.stop().await;
}

/// A holder whose agent restarts (`leave_on_terminate`, a client agent's default: its node is
/// deregistered, which ends its sessions), back within the holder's renew deadline, with the
/// sessions on the agent's own node (the default) and on a node that does not restart
/// (`session_node`). On its own node the holder loses its term, and a lease later (the
/// lock-delay) one of the two leads: the follower, or the holder again, whose node the
/// restarted agent registered anew, whichever asks first. On the other node the holder leads
/// on, with the same token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_restart_ends_terms_unless_sessions_are_on_another_node() {
    use std::time::Duration;

    use leader_consul::ConsulStore;
    use leader_core::LeaderElector;
    use leader_core::background::Candidate;

    for on_stable_node in [false, true] {
        let api = common::ConsulApiServer::start().await;
        let agent = api.agent("node-a").await;
        let prefix = common::prefix();
        let mut holder_store = ConsulStore::builder(agent.url())
            .prefix(&prefix)
            .timeout(Duration::from_millis(500));
        if on_stable_node {
            holder_store = holder_store.session_node(api.node());
        }
        let holder_store = holder_store.build().expect("a store");
        let mut holder = Candidate::build(
            LeaderElector::builder(common::lock(&holder_store, "restart", "holder"))
                .lease_duration(LEASE)
                .renew_deadline(RENEW)
                .retry_period(HOLDER_RETRY),
        );
        let token = holder.wait_leading(Duration::from_secs(5)).await;
        let follower = Candidate::start(common::lock(
            &common::store_at(&api.url(), &prefix),
            "restart",
            "follower",
        ));
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The follower leads a lease after the restart; the two leases after it are a margin
        // for a loaded machine. On the stable node, nothing may change in the whole window.
        let seen = after(
            &holder,
            &follower,
            agent.restart(Duration::from_millis(500)),
            LEASE * 3,
        )
        .await;
        if on_stable_node {
            assert_eq!(
                seen.ended, None,
                "the holder lost its term at its agent's restart"
            );
            assert_eq!(seen.led, None, "the follower led");
            assert_eq!(holder.leading_token(), Some(token));
            assert_eq!(api.sessions(), 1, "the holder's session on {}", api.node());
        } else {
            eprintln!("an agent restart with sessions on its node: {seen:?}");
            assert!(seen.ended.is_some(), "the holder's term ends");
            let next = seen.next_leader().expect("a leader after the lease");
            assert!(next >= LEASE, "{seen:?} after the restart");
        }
        holder.stop().await;
        follower.stop().await;
    }
}
