//! What makes the Lease lock behave like client-go with other clients on the same Lease, checked
//! against the test API server and, on request, against a real cluster with the same code:
//! fencing tokens beyond int32 and past counts other clients reset, a release written as
//! client-go writes it, metadata kept through writes, clients set up for long-lived use, a
//! planned handover where the API server drops `preferredHolder` (the default), a leader whose
//! Lease is deleted, and the conformance suite.
//!
//! Against a real cluster (kind or k3d; see the README), each test here is run with
//! `LEADER_KUBE_E2E=1 KUBECONFIG=... cargo test -p leader-kube --test fidelity -- --ignored`, in
//! the namespace `LEADER_KUBE_NAMESPACE` (default `default`); without `LEADER_KUBE_E2E=1` those
//! are reported as ignored.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{KubeApiServer, client};
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use leader_core::conformance::{self, LockFactory};
use leader_core::faults::FaultyLock;
use leader_core::{
    CancellationToken, HandoverError, LeaderElector, LockError, ResourceLock, request_handover,
};
use leader_kube::{COORDINATION_ANNOTATION, FENCING_TOKEN_ANNOTATION, LeaseLock};
use leader_test_support::Candidate;
use serde_json::{Value, json};
use tokio::time::{sleep, timeout};

/// Where a test runs: the test API server or a real cluster.
struct Target {
    config: kube::Config,
    client: kube::Client,
    namespace: String,
    /// The test API server, when that is the target.
    server: Option<KubeApiServer>,
}

impl Target {
    async fn test_server() -> Self {
        let server = KubeApiServer::start().await;
        Self {
            config: kube::Config::new(server.url().parse().expect("url")),
            client: client(&server),
            namespace: "default".into(),
            server: Some(server),
        }
    }

    async fn real_cluster() -> Self {
        assert_eq!(
            std::env::var("LEADER_KUBE_E2E").as_deref(),
            Ok("1"),
            "set LEADER_KUBE_E2E=1 and KUBECONFIG to run against a real cluster"
        );
        let config = kube::Config::infer()
            .await
            .expect("a cluster from KUBECONFIG");
        Self {
            client: kube::Client::try_from(config.clone()).expect("client"),
            config,
            namespace: std::env::var("LEADER_KUBE_NAMESPACE").unwrap_or_else(|_| "default".into()),
            server: None,
        }
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn lock(&self, name: &str, identity: &str) -> LeaseLock {
        LeaseLock::new(self.client.clone(), &self.namespace, name, identity).expect("valid names")
    }

    /// A Lease name no earlier run used.
    fn unique(what: &str) -> String {
        format!("fidelity-{what}-{:08x}", fastrand::u32(..))
    }

    /// Stores a Lease through the API, as another client would (replacing any earlier one).
    /// A candidate of ours may create the Lease again between the delete and the create (it
    /// sees none, and takes it): then the delete and the create are made again.
    async fn put(&self, name: &str, metadata: Value, spec: Value) {
        let mut lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": metadata, "spec": spec});
        lease["metadata"]["name"] = json!(name);
        let lease: Lease = serde_json::from_value(lease).expect("a Lease");
        for _ in 0..20 {
            let _ = self.leases().delete(name, &DeleteParams::default()).await;
            match self.leases().create(&PostParams::default(), &lease).await {
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                created => {
                    created.expect("create the Lease");
                    return;
                }
            }
        }
        panic!("the Lease {name} was created again by others 20 times in a row");
    }

    /// The Lease as the API returns it.
    async fn get(&self, name: &str) -> Value {
        serde_json::to_value(self.leases().get(name).await.expect("get the Lease")).expect("json")
    }

    /// An owner reference that stays valid for the test: to a ConfigMap made for it on a real
    /// cluster (the garbage collector deletes objects whose owner is missing).
    async fn owner(&self, name: &str) -> Value {
        let uid = if self.server.is_some() {
            "d9607e19-f88f-11e6-a518-42010a800195".to_owned()
        } else {
            let maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
            let map: ConfigMap =
                serde_json::from_value(json!({"metadata": {"name": name}})).expect("a ConfigMap");
            maps.create(&PostParams::default(), &map)
                .await
                .expect("create the owner ConfigMap")
                .metadata
                .uid
                .expect("uid")
        };
        json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": uid}])
    }

    async fn cleanup(&self, names: &[&str]) {
        for name in names {
            let _ = self.leases().delete(name, &DeleteParams::default()).await;
            let maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
            let _ = maps.delete(name, &DeleteParams::default()).await;
        }
    }
}

/// A Lease held by a client that is gone, renewed long ago.
fn expired(transitions: i64) -> Value {
    json!({"holderIdentity": "other", "leaseDurationSeconds": 1,
        "acquireTime": "2026-11-21T10:00:00.000000Z", "renewTime": "2026-11-21T10:00:00.000000Z",
        "leaseTransitions": transitions})
}

/// Item 1, S5 with other writers: tokens grow past `i32::MAX` and past a `leaseTransitions`
/// another client reset (kubert reads it as a u16), while `leaseTransitions` stays a valid
/// int32 for client-go.
async fn fencing_tokens(target: &Target) {
    let big = Target::unique("big");
    target.put(&big, json!({}), expired(2_147_483_647)).await;
    let mut tokens = Vec::new();
    for identity in ["rust-1", "rust-2"] {
        let mut elector = Candidate::start(target.lock(&big, identity));
        tokens.push(elector.wait_leading(Duration::from_secs(5)).await);
        elector.stop().await;
        let lease = target.get(&big).await;
        let transitions = lease["spec"]["leaseTransitions"]
            .as_i64()
            .expect("leaseTransitions");
        assert!(
            (0..=i64::from(i32::MAX)).contains(&transitions),
            "leaseTransitions must stay a valid int32 >= 0: {transitions}"
        );
    }
    assert_eq!(tokens, [2_147_483_648, 2_147_483_649]);

    // kubert took the Lease at 70000 and reset the count past 65535; our high-water mark stays.
    let reset = Target::unique("reset");
    target
        .put(
            &reset,
            json!({"annotations": {(leader_kube::FENCING_TOKEN_ANNOTATION): "70000"}}),
            expired(2),
        )
        .await;
    let mut elector = Candidate::start(target.lock(&reset, "rust-1"));
    assert_eq!(elector.wait_leading(Duration::from_secs(5)).await, 70_001);
    elector.stop().await;
    target.cleanup(&[&big, &reset]).await;
}

/// Item 2: a release writes what client-go's release writes (no holder, a 1 s lease), so that
/// other clients, which wait out the stored duration, take over at once; one that hands over
/// keeps its lease, which the candidates stand back for.
async fn release_as_client_go(target: &Target) {
    let name = Target::unique("release");
    let mut elector = Candidate::start(target.lock(&name, "rust-1"));
    elector.wait_leading(Duration::from_secs(5)).await;
    assert_eq!(
        target.get(&name).await["spec"]["leaseDurationSeconds"],
        3,
        "held with the candidate's 3 s lease"
    );
    elector.stop().await;
    let released = target.get(&name).await;
    assert_eq!(released["spec"]["holderIdentity"], "");
    assert_eq!(released["spec"]["leaseDurationSeconds"], 1);

    // A release that hands over keeps the lease: the candidates that see the request stand
    // back for it from then, where a 1 s lease cut the stand-back to a second (client-go's
    // candidates take a Lease without a holder whatever its duration).
    let mut elector = Candidate::start(target.lock(&name, "rust-1"));
    elector.wait_leading(Duration::from_secs(5)).await;
    let leadership = elector.leadership().await;
    leadership.hand_over("away").expect("leading");
    drop(leadership);
    // The release follows the end of the term's work.
    let mut handed = target.get(&name).await;
    for _ in 0..100 {
        if handed["spec"]["holderIdentity"] == "" {
            break;
        }
        sleep(Duration::from_millis(50)).await;
        handed = target.get(&name).await;
    }
    assert_eq!(handed["spec"]["holderIdentity"], "", "{handed}");
    assert_eq!(handed["spec"]["leaseDurationSeconds"], 3, "{handed}");
    let other = Candidate::start(target.lock(&name, "rust-2"));
    other
        .stays_alive_without_leading(Duration::from_secs(2))
        .await;
    assert!(
        elector.leading_token().is_none(),
        "the old leader took it back"
    );
    other.stop().await;
    elector.stop().await;
    target.cleanup(&[&name]).await;
}

/// Item 3: writes send back the Lease as read with the spec replaced: labels, annotations and
/// owner references that others put on the Lease stay through renewals and a release.
async fn metadata_kept(target: &Target) {
    let name = Target::unique("meta");
    let owner = target.owner(&name).await;
    target
        .put(
            &name,
            json!({"labels": {"app": "jobs"}, "annotations": {"team": "infra"},
                   "ownerReferences": owner}),
            json!({"holderIdentity": "", "leaseDurationSeconds": 1, "leaseTransitions": 3}),
        )
        .await;
    let mut elector = Candidate::start(target.lock(&name, "rust-1"));
    elector.wait_leading(Duration::from_secs(5)).await;
    // Through a few renewals, then a release.
    sleep(Duration::from_millis(1200)).await;
    elector.stop().await;
    let stored = target.get(&name).await;
    assert_eq!(stored["metadata"]["labels"]["app"], "jobs");
    assert_eq!(stored["metadata"]["annotations"]["team"], "infra");
    assert_eq!(
        stored["metadata"]["ownerReferences"][0]["name"],
        name.as_str()
    );
    assert_eq!(stored["spec"]["leaseTransitions"], 4, "one holder change");
    target.cleanup(&[&name]).await;
}

/// Item 4: clients set up as kube-rs documents for long-lived use. With client-go's timings and
/// a 3 s request timeout, no renewal fails on the client side (the time a pooled connection sat
/// idle does not count) and a quiet follower's watch is not cut by the read timeout; on the
/// test API server, also while it answers every PUT in 1.5 s.
async fn long_lived_clients(target: &Target) {
    let name = Target::unique("slow");
    let request_timeout = Duration::from_secs(3);
    let lock = |identity: &str| {
        LeaseLock::from_config(
            target.config.clone(),
            &target.namespace,
            &name,
            identity,
            request_timeout,
        )
        .expect("client")
    };
    let start = |lock: FaultyLock<LeaseLock>| {
        let elector = LeaderElector::builder(lock)
            .build()
            .expect("client-go's timings");
        let state = elector.subscribe();
        let shutdown = CancellationToken::new();
        tokio::spawn(elector.run(shutdown.clone()));
        (state, shutdown)
    };
    let leader = FaultyLock::new(lock("rust-1"));
    let calls = leader.faults();
    let (mut leading, stop_leader) = start(leader);
    timeout(Duration::from_secs(5), leading.wait_for(|s| s.is_leading()))
        .await
        .expect("leads in time")
        .expect("elector alive");
    let follower = FaultyLock::new(lock("rust-2"));
    let follower_calls = follower.faults();
    let (_following, stop_follower) = start(follower);
    if let Some(server) = &target.server {
        server.delay_writes(Duration::from_millis(1500));
    }
    sleep(Duration::from_secs(12)).await;
    let updates: Vec<_> = calls
        .calls()
        .into_iter()
        .filter(|c| c.operation == "renew" && c.returned.is_some())
        .collect();
    assert!(updates.len() >= 3, "renewals: {updates:?}");
    assert!(
        updates.iter().all(|c| c.ok == Some(true)),
        "a renewal failed: {updates:?}"
    );
    assert!(leading.borrow().is_leading(), "the leader lost its lease");
    assert!(
        follower_calls.watches() <= 1,
        "the follower's watch was reopened: {} watches",
        follower_calls.watches()
    );
    if let Some(server) = &target.server {
        // One a candidate: the leader's, before it led, and the follower's.
        assert!(
            server.watches() <= 2,
            "the server saw {} watches",
            server.watches()
        );
    }
    stop_follower.cancel();
    stop_leader.cancel();
    sleep(Duration::from_millis(500)).await;
    target.cleanup(&[&name]).await;
}

/// Item: planned handover on a stock cluster (the CoordinatedLeaderElection gate off, which
/// drops `spec.preferredHolder`): the request is stored in the annotation every API server
/// keeps, the leader hands over to the named candidate, and the request is gone with the next
/// term. A request made stale by another client's takeover (client-go's `LeaseLock` keeps
/// annotations) is read as none.
async fn planned_handover(target: &Target) {
    let name = Target::unique("handover");
    let mut one = Candidate::start(target.lock(&name, "one"));
    let first = one.wait_leading(Duration::from_secs(10)).await;
    let mut two = Candidate::start(target.lock(&name, "two"));
    let three = Candidate::start(target.lock(&name, "three"));
    sleep(Duration::from_millis(300)).await;

    let requester = target.lock(&name, "operator");
    let written = request_handover(&requester, "two")
        .await
        .expect("the request is stored");
    assert_eq!(written.record.handover_to(), Some("two"));
    let lease = target.get(&name).await;
    let kept = lease["metadata"]["annotations"][COORDINATION_ANNOTATION]
        .as_str()
        .unwrap_or_else(|| panic!("the request in the annotation: {lease}"));
    assert!(kept.contains(r#""preferredHolder":"two""#), "{kept}");
    if target.server.is_some() {
        // The test server runs as a stock cluster: the spec keeps no request.
        assert!(lease["spec"].get("preferredHolder").is_none(), "{lease}");
    }
    let second = two.wait_leading(Duration::from_secs(10)).await;
    assert!(second > first, "tokens {first} then {second}");
    assert!(one.leading_token().is_none() && three.leading_token().is_none());
    let after = target.lock(&name, "operator").get().await.expect("get");
    assert_eq!(after.expect("lease").record.handover_to(), None);

    // A request written in one term is stale once another client takes the Lease over.
    for candidate in [one, two, three] {
        candidate.stop().await;
    }
    let read = target.leases().get(&name).await.expect("get");
    let mut asked = read.clone();
    let transitions = read
        .spec
        .as_ref()
        .and_then(|s| s.lease_transitions)
        .unwrap_or(0);
    request_handover(&requester, "one")
        .await
        .expect("a request on a free Lease");
    let current = target.leases().get(&name).await.expect("get");
    asked.metadata = current.metadata.clone();
    asked.spec = serde_json::from_value(json!({"holderIdentity": "client-go",
        "leaseDurationSeconds": 15, "leaseTransitions": transitions + 1,
        "acquireTime": "2026-11-21T10:00:00.000000Z", "renewTime": "2026-11-21T10:00:00.000000Z"}))
    .expect("spec");
    target
        .leases()
        .replace(&name, &PostParams::default(), &asked)
        .await
        .expect("a client-go takeover, annotations kept");
    let observed = requester.get().await.expect("get").expect("lease");
    assert_eq!(observed.record.holder_identity, "client-go");
    assert_eq!(observed.record.handover_to(), None, "a stale request");
    target.cleanup(&[&name]).await;
}

/// Item: a leader whose Lease is deleted ends its term (its renewal, sent with the Lease's uid,
/// is a conflict; the Lease is not created afresh under the old term) and, as a candidate again,
/// creates a new Lease with a fencing token above every one it saw.
async fn deleted_lease(target: &Target) {
    let name = Target::unique("deleted");
    let mut leader = Candidate::start(target.lock(&name, "one"));
    let first = leader.wait_leading(Duration::from_secs(10)).await;
    let term = leader.term().expect("a term");
    target
        .leases()
        .delete(&name, &DeleteParams::default())
        .await
        .expect("delete the Lease");
    timeout(Duration::from_secs(10), term.cancelled())
        .await
        .expect("the term ends with its Lease");
    let second = leader.wait_leading(Duration::from_secs(10)).await;
    assert!(second > first, "tokens {first} then {second}");
    let lease = target.get(&name).await;
    assert_eq!(
        lease["metadata"]["annotations"][FENCING_TOKEN_ANNOTATION],
        second.to_string()
    );
    // Another client (client-go, kubert) deletes the Lease and creates it again with its own
    // count from 0 and none of our annotations: our next acquisition, an update of that
    // Lease, still goes on from the highest token this lock saw.
    let term = leader.term().expect("a term");
    target.put(&name, json!({}), expired(0)).await;
    timeout(Duration::from_secs(10), term.cancelled())
        .await
        .expect("the term ends with its Lease");
    let third = leader.wait_leading(Duration::from_secs(10)).await;
    assert!(third > second, "tokens {second} then {third}");
    leader.stop().await;
    target.cleanup(&[&name]).await;
}

/// A handover request left for a holder that is not this toolkit's (here a client that renews
/// as client-go does: the whole Lease written back, annotations kept) is never acted on; it
/// wakes a follower's watch once, not at each of that holder's renewals, and it can be
/// withdrawn.
async fn a_request_for_a_foreign_holder(target: &Target) {
    let name = Target::unique("foreign-request");
    let now = chrono::Utc::now()
        .format("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string();
    target
        .put(
            &name,
            json!({}),
            json!({"holderIdentity": "client-go", "leaseDurationSeconds": 15,
                "acquireTime": now, "renewTime": now, "leaseTransitions": 3}),
        )
        .await;
    let follower = target.lock(&name, "rust-1");
    request_handover(&target.lock(&name, "operator"), "rust-1")
        .await
        .expect("a request");
    let mut wakes = follower.watch().await.expect("watch").expect("a stream");
    let renew = async || {
        let mut lease = target.get(&name).await;
        lease["spec"]["renewTime"] = json!(
            chrono::Utc::now()
                .format("%Y-%m-%dT%H:%M:%S%.6fZ")
                .to_string()
        );
        let lease: Lease = serde_json::from_value(lease).expect("a Lease");
        target
            .leases()
            .replace(&name, &PostParams::default(), &lease)
            .await
            .expect("renew as client-go");
    };
    let count = async |wakes: &mut leader_core::ChangeStream, within: Duration| {
        let mut n = 0;
        while let Ok(Some(())) = timeout(within, wakes.next()).await {
            n += 1;
        }
        n
    };
    for _ in 0..5 {
        renew().await;
    }
    assert_eq!(
        count(&mut wakes, Duration::from_millis(500)).await,
        1,
        "the pending request woke the follower at each of the foreign holder's renewals"
    );
    let withdrawn = leader_core::withdraw_handover(&target.lock(&name, "operator"))
        .await
        .expect("withdraw");
    assert_eq!(withdrawn.record.handover_to(), None);
    renew().await;
    assert_eq!(count(&mut wakes, Duration::from_millis(500)).await, 0);
    let lease = target.get(&name).await;
    assert!(
        lease["metadata"]["annotations"][COORDINATION_ANNOTATION].is_null(),
        "{lease}"
    );
    target.cleanup(&[&name]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_a_foreign_holder_wakes_followers_once_and_can_be_withdrawn() {
    a_request_for_a_foreign_holder(&Target::test_server().await).await;
}

/// A request the API server did not store (here an admission webhook strips the annotation)
/// is an error, never a request reported as made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_request_the_server_drops_is_an_error() {
    let target = Target::test_server().await;
    let name = Target::unique("dropped");
    let mut one = Candidate::start(target.lock(&name, "one"));
    one.wait_leading(Duration::from_secs(10)).await;
    let server = target.server.as_ref().expect("the test server");
    server.strip_annotation(COORDINATION_ANNOTATION);
    let err = request_handover(&target.lock(&name, "operator"), "two")
        .await
        .expect_err("a dropped request is an error");
    assert!(
        matches!(err, HandoverError::Lock(LockError::Misconfigured { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains(COORDINATION_ANNOTATION), "{err}");
    sleep(Duration::from_secs(1)).await;
    assert!(one.leading_token().is_some(), "nothing was handed over");
    one.stop().await;
}

/// Tests that each run one check on the test API server, and on a real cluster when asked for.
macro_rules! on_each_target {
    ($($check:ident: $test:ident, $real:ident;)+) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            $check(&Target::test_server().await).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "needs a Kubernetes cluster: LEADER_KUBE_E2E=1 and KUBECONFIG, run with --ignored"]
        async fn $real() {
            $check(&Target::real_cluster().await).await;
        }
    )+};
}

on_each_target! {
    planned_handover: planned_handover_works_where_the_api_server_drops_preferred_holder, real_cluster_planned_handover;
    deleted_lease: a_leader_whose_lease_is_deleted_steps_down_and_tokens_go_on, real_cluster_deleted_lease;
    fencing_tokens: fencing_tokens_grow_beyond_int32_and_past_counts_other_clients_reset, real_cluster_fencing_tokens;
    release_as_client_go: a_release_is_written_as_client_go_writes_it, real_cluster_release_as_client_go;
    metadata_kept: writes_keep_the_lease_metadata, real_cluster_metadata_kept;
    long_lived_clients: a_slow_api_server_fails_no_renewal_and_cuts_no_watch, real_cluster_long_lived_clients;
}

/// The conformance suite and three electors on a real cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a Kubernetes cluster: LEADER_KUBE_E2E=1 and KUBECONFIG, run with --ignored"]
async fn real_cluster_conformance() {
    struct Real(Target);
    #[leader_core::async_trait]
    impl LockFactory for Real {
        /// A later release's field is a column (an annotation) this release leaves alone.
        fn keeps_unknown_fields(&self) -> bool {
            false
        }
        async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
            Arc::new(self.0.lock(name, identity))
        }
        /// A real API server validates every Lease: none can hold a value the lock cannot
        /// decode.
        async fn corrupt(&self, _name: &str) -> bool {
            false
        }
    }
    let factory = Real(Target::real_cluster().await);
    conformance::run_all(&factory).await;
    conformance::electors_elect_exactly_one(&factory, 3).await;
}
