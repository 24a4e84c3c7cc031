//! The test API server keeps kube-apiserver's contract for what Lease clients do (each behaviour
//! cites its source in `leader_test_support::kube_api`), and the lock's watch copes with what a
//! real watch does: bookmarks, 410 Gone and the server ending it.

mod common;

use std::time::Duration;

use common::{KubeApiServer, client};
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
    let api = KubeApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(client(&api), "default");
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
    let api = KubeApiServer::start().await;
    api.bookmark_every(Duration::from_millis(100));
    api.end_watches_after(Duration::from_millis(300));
    let lock = |identity: &str| LeaseLock::new(client(&api), "default", "watched", identity);
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

/// Server-side apply keeps field ownership: an apply that would change a field another manager
/// owns is a 409 naming the field and the manager, unless forced; the same value is shared; a
/// `resourceVersion` in an apply is a precondition; `managedFields` records who owns what.
#[tokio::test]
async fn apply_conflicts_on_fields_other_managers_own() {
    let api = KubeApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(client(&api), "default");
    let created = leases
        .create(
            &PostParams {
                field_manager: Some("ours".into()),
                ..PostParams::default()
            },
            &lease(
                "ssa",
                json!({"holderIdentity": "a", "leaseDurationSeconds": 15}),
            ),
        )
        .await
        .expect("create");
    let take = |holder: &str| {
        Patch::Apply(
            json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "ssa"}, "spec": {"holderIdentity": holder,
            "leaseDurationSeconds": 15}}),
        )
    };
    let err = leases
        .patch("ssa", &PatchParams::apply("theirs"), &take("b"))
        .await
        .expect_err("a conflict");
    let kube::Error::Api(status) = err else {
        panic!("not an API error: {err}")
    };
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    assert!(
        status.message.contains(r#"conflict with "ours""#)
            && status.message.contains(".spec.holderIdentity"),
        "{}",
        status.message
    );
    // The value it already has is shared, not taken.
    leases
        .patch("ssa", &PatchParams::apply("theirs"), &take("a"))
        .await
        .expect("the same value is shared");
    let forced = leases
        .patch("ssa", &PatchParams::apply("theirs").force(), &take("b"))
        .await
        .expect("forced");
    assert_eq!(
        forced.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("b")
    );
    let managers: Vec<(String, String)> = forced
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .map(|m| {
            (
                m.manager.unwrap_or_default(),
                m.operation.unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        managers.contains(&("theirs".into(), "Apply".into())),
        "{managers:?}"
    );
    // An apply with a stale resourceVersion is refused like any other write.
    let mut stale = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "ssa"}, "spec": {"holderIdentity": "c"}});
    stale["metadata"]["resourceVersion"] = json!(created.metadata.resource_version);
    let err = leases
        .patch(
            "ssa",
            &PatchParams::apply("theirs").force(),
            &Patch::Apply(stale),
        )
        .await;
    assert_eq!(code(err.expect_err("stale")), 409);
}

/// Decoding and validation as the real server does them: a field of the wrong type is 400, an
/// unknown field is dropped, a name that is not a DNS subdomain or an unknown strategy is 422.
#[tokio::test]
async fn bodies_are_decoded_and_validated_as_the_real_server_does() {
    let api = KubeApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(client(&api), "default");
    let err = leases
        .patch(
            "missing-or-not",
            &PatchParams::apply("t"),
            &Patch::Apply(
                json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "typed"}, "spec": {"leaseDurationSeconds": "15"}}),
            ),
        )
        .await;
    assert_eq!(code(err.expect_err("a string for an int32")), 400);
    let applied = leases
        .patch(
            "unknown",
            &PatchParams::apply("t"),
            &Patch::Apply(
                json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "unknown"}, "spec": {"holderIdentity": "a", "bogus": 1}}),
            ),
        )
        .await
        .expect("an unknown field is dropped");
    assert_eq!(
        serde_json::to_value(&applied).expect("json")["spec"].get("bogus"),
        None
    );
    let err = leases
        .create(&PostParams::default(), &lease("Not_A_Name", json!({})))
        .await;
    assert_eq!(code(err.expect_err("not a DNS subdomain")), 422);
    let err = leases
        .create(
            &PostParams::default(),
            &lease("strategy", json!({"strategy": "Newest"})),
        )
        .await;
    assert_eq!(code(err.expect_err("an unknown strategy")), 422);
}

/// With a state file, the server keeps its Leases and its revision across a restart, as the
/// real one keeps them in etcd; a watch from before the restart gets 410 Gone.
#[test]
fn a_state_file_keeps_leases_across_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    let state = dir.path().join("state.json");
    let start = |port: u16| {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        let api = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .expect("bind");
            KubeApiServer::serve(listener, Some(&state)).expect("serve")
        });
        (runtime, api)
    };
    let (runtime, api) = start(0);
    let port: u16 = api
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port");
    let before = runtime.block_on(async {
        let leases: Api<Lease> = Api::namespaced(client(&api), "default");
        let first = leases
            .create(&PostParams::default(), &lease("first", json!({})))
            .await
            .expect("create");
        leases
            .create(
                &PostParams::default(),
                &lease("kept", json!({"holderIdentity": "a"})),
            )
            .await
            .expect("create");
        first
    });
    drop(runtime);
    let (runtime, api) = start(port);
    runtime.block_on(async {
        let leases: Api<Lease> = Api::namespaced(client(&api), "default");
        let after = leases.get("first").await.expect("kept across the restart");
        assert_eq!(
            after.metadata.resource_version,
            before.metadata.resource_version
        );
        assert_eq!(after.metadata.uid, before.metadata.uid);
        leases.get("kept").await.expect("kept across the restart");
        // The watch cache starts again at the restart: a version from before it is too old.
        let old = before.metadata.resource_version.clone().expect("a version");
        let mut stream = std::pin::pin!(
            leases
                .watch(&kube::api::WatchParams::default(), &old)
                .await
                .expect("watch")
        );
        use futures_util::StreamExt;
        let first = stream.next().await.expect("an event");
        match first {
            Ok(kube::api::WatchEvent::Error(status)) => assert_eq!(status.code, 410),
            other => panic!("expected 410 Gone, got {other:?}"),
        }
    });
}
