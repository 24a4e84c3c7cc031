//! The test API server keeps kube-apiserver's contract for what Lease clients do (each behaviour
//! cites its source in `common/mod.rs`), and the lock's watch copes with what a real watch does:
//! bookmarks, 410 Gone and the server ending it.

mod common;

use std::time::Duration;

use common::FakeApi;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams, PostParams};
use leader_kube::LeaseLock;
use leader_test_support::Candidate;
use serde_json::json;

fn lease(name: &str, spec: serde_json::Value) -> Lease {
    serde_json::from_value(
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name}, "spec": spec}),
    )
    .expect("a Lease")
}

fn code(err: kube::Error) -> u16 {
    match err {
        kube::Error::Api(status) => status.code,
        other => panic!("not an API error: {other}"),
    }
}

#[tokio::test]
async fn writes_follow_the_lease_strategy_and_validation() {
    let api = FakeApi::start().await;
    let leases: Api<Lease> = Api::namespaced(api.client(), "default");
    let params = PostParams::default();

    // Validation: 422 for a zero duration, negative transitions, a preferred holder without a
    // strategy.
    for spec in [
        json!({"holderIdentity": "a", "leaseDurationSeconds": 0}),
        json!({"holderIdentity": "a", "leaseTransitions": -1}),
        json!({"holderIdentity": "a", "preferredHolder": "b"}),
    ] {
        let err = leases.create(&params, &lease("bad", spec.clone())).await;
        assert_eq!(code(err.expect_err("invalid")), 422, "{spec}");
    }

    // Create-on-update: a PUT of a missing Lease creates it.
    let created = leases
        .replace(
            "put",
            &params,
            &lease(
                "put",
                json!({"holderIdentity": "a",
            "leaseDurationSeconds": 15, "renewTime": "2026-11-21T10:00:00.5+01:00"}),
            ),
        )
        .await
        .expect("create on update");
    // Times come back as RFC 3339 micro UTC.
    let renew = serde_json::to_value(&created).expect("json")["spec"]["renewTime"].clone();
    assert_eq!(renew, "2026-11-21T09:00:00.500000Z");

    // An unconditional update of an existing Lease is refused (422); a stale one conflicts (409).
    let mut unconditional = created.clone();
    unconditional.metadata.resource_version = None;
    let err = leases.replace("put", &params, &unconditional).await;
    assert_eq!(code(err.expect_err("unconditional")), 422);
    let mut stale = created.clone();
    stale.metadata.resource_version = Some("999".into());
    let err = leases.replace("put", &params, &stale).await;
    assert_eq!(code(err.expect_err("stale")), 409);
    leases
        .replace("put", &params, &created)
        .await
        .expect("an update from the version read");

    // PATCH: merge and strategic merge patch a Lease; apply needs a field manager and creates.
    let merged = leases
        .patch(
            "put",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"holderIdentity": "b"}})),
        )
        .await
        .expect("merge patch");
    let spec = merged.spec.expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(
        spec.lease_duration_seconds,
        Some(15),
        "untouched fields stay"
    );
    leases
        .patch(
            "put",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"leaseTransitions": 3}})),
        )
        .await
        .expect("strategic merge patch");
    let err = leases
        .patch("missing", &PatchParams::default(), &Patch::Merge(json!({})))
        .await;
    assert_eq!(code(err.expect_err("a merge patch of nothing")), 404);
    let applied = leases
        .patch(
            "applied",
            &PatchParams::apply("test"),
            &Patch::Apply(
                json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "applied"}, "spec": {"holderIdentity": "c",
                "leaseDurationSeconds": 10}}),
            ),
        )
        .await
        .expect("apply creates");
    assert_eq!(
        applied.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("c")
    );
    let err = leases
        .patch(
            "put",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": "999"}, "spec": {}})),
        )
        .await;
    assert_eq!(code(err.expect_err("a stale precondition")), 409);
    let err = leases
        .patch(
            "put",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"leaseDurationSeconds": -3}})),
        )
        .await;
    assert_eq!(code(err.expect_err("an invalid result")), 422);
}

/// A follower's watch gets bookmarks every 100 ms, is ended by the server every 300 ms, and is
/// answered once with 410 Gone; it still wakes the follower at once when the leader releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_survives_bookmarks_gone_and_server_timeouts() {
    let api = FakeApi::start().await;
    api.bookmark_every(Duration::from_millis(100));
    api.end_watches_after(Duration::from_millis(300));
    let lock = |identity: &str| LeaseLock::new(api.client(), "default", "watched", identity);
    let retry = Duration::from_secs(2);
    let mut leader = Candidate::start_with(lock("first"), retry);
    let token = leader.wait_leading(Duration::from_secs(10)).await;
    api.expire_watches(1);
    let mut follower = Candidate::start_with(lock("second"), retry);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        api.watches() >= 3,
        "watched again after each end: {}",
        api.watches()
    );
    let released = tokio::time::Instant::now();
    leader.stop().await;
    let next = follower.wait_leading(retry).await;
    let took = released.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "handover after a release took {took:?}"
    );
    assert!(next > token);
    follower.stop().await;
}
