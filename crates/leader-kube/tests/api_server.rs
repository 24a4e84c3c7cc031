//! The test API server keeps kube-apiserver's contract for what Lease clients do (each behaviour
//! cites its source in `leader_test_support::kube_api`), and the lock's watch copes with what a
//! real watch does: bookmarks, 410 Gone and the server ending it.

mod common;

use std::time::Duration;

use common::{KubeApiServer, client, code};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use leader_kube::LeaseLock;
use leader_test_support::Candidate;
use serde_json::json;

/// Lease `name` with `spec`, as JSON (which the API server may refuse).
fn lease_json(name: &str, spec: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
    "metadata": {"name": name}, "spec": spec})
}

fn lease(name: &str, spec: serde_json::Value) -> Lease {
    serde_json::from_value(lease_json(name, spec)).expect("a Lease")
}

/// A server-side apply of Lease `name` with `spec`.
fn apply(name: &str, spec: serde_json::Value) -> Patch<serde_json::Value> {
    Patch::Apply(lease_json(name, spec))
}

#[tokio::test]
async fn writes_follow_the_lease_strategy_and_validation() {
    let api = KubeApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(client(&api), "default");
    let params = PostParams::default();

    // Validation: 422 for a zero duration, negative transitions.
    for spec in [
        json!({"holderIdentity": "a", "leaseDurationSeconds": 0}),
        json!({"holderIdentity": "a", "leaseTransitions": -1}),
    ] {
        let err = leases.create(&params, &lease("bad", spec.clone())).await;
        assert_eq!(code(err.expect_err("invalid")), 422, "{spec}");
    }

    // The Lease strategy of a stock cluster (the CoordinatedLeaderElection gate off): strategy
    // and preferredHolder are dropped from a create and from an update of a Lease without them,
    // before validation (a preferred holder alone is no error).
    let both = json!({"holderIdentity": "a", "strategy": "OldestEmulationVersion",
        "preferredHolder": "b"});
    let created = leases
        .create(&params, &lease("gate-off", both.clone()))
        .await
        .expect("created");
    let spec = created.spec.clone().expect("spec");
    assert_eq!((spec.strategy, spec.preferred_holder), (None, None));
    let mut asked = created.clone();
    asked.spec = lease("gate-off", both.clone()).spec;
    let updated = leases
        .replace("gate-off", &params, &asked)
        .await
        .expect("updated");
    let spec = updated.spec.expect("spec");
    assert_eq!((spec.strategy, spec.preferred_holder), (None, None));
    leases
        .create(
            &params,
            &lease(
                "alone",
                json!({"holderIdentity": "a", "preferredHolder": "b"}),
            ),
        )
        .await
        .expect("a preferred holder alone is dropped");
    // With the gate on, they are kept, and a preferred holder needs a strategy.
    api.enable_coordinated_leader_election();
    let kept = leases
        .create(&params, &lease("gate-on", both))
        .await
        .expect("created");
    let spec = kept.spec.expect("spec");
    assert_eq!(spec.preferred_holder.as_deref(), Some("b"));
    let err = leases
        .create(
            &params,
            &lease(
                "bad",
                json!({"holderIdentity": "a", "preferredHolder": "b"}),
            ),
        )
        .await;
    assert_eq!(code(err.expect_err("a preferred holder alone")), 422);

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
            &apply(
                "applied",
                json!({"holderIdentity": "c", "leaseDurationSeconds": 10}),
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
    let lock = |identity: &str| {
        LeaseLock::new(client(&api), "default", "watched", identity).expect("valid names")
    };
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
        apply(
            "ssa",
            json!({"holderIdentity": holder, "leaseDurationSeconds": 15}),
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
    let mut stale = lease_json("ssa", json!({"holderIdentity": "c"}));
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
            &apply("typed", json!({"leaseDurationSeconds": "15"})),
        )
        .await;
    assert_eq!(code(err.expect_err("a string for an int32")), 400);
    let applied = leases
        .patch(
            "unknown",
            &PatchParams::apply("t"),
            &apply("unknown", json!({"holderIdentity": "a", "bogus": 1})),
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
    // Strategies are validated where the feature gate keeps them.
    api.enable_coordinated_leader_election();
    for strategy in ["Newest", "example.com/-x", "a/b/c"] {
        let err = leases
            .create(
                &PostParams::default(),
                &lease("strategy", json!({"strategy": strategy})),
            )
            .await;
        assert_eq!(
            code(err.expect_err("an invalid strategy")),
            422,
            "{strategy}"
        );
    }
}

/// A Lease sent back with the uid it was read with is never written once that Lease is gone:
/// kube-apiserver makes the uid a precondition, so the PUT is 409 whether the Lease was deleted
/// or deleted and created again (it is not created afresh). DELETE keeps its preconditions.
#[tokio::test]
async fn a_deleted_lease_is_never_written_from_its_old_copy() {
    let api = KubeApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(client(&api), "default");
    let params = PostParams::default();
    let read = leases
        .create(&params, &lease("gone", json!({"holderIdentity": "a"})))
        .await
        .expect("created");
    let uid = read.metadata.uid.clone().expect("a uid");
    let stale = |uid: Option<&str>, version: Option<&str>| DeleteParams {
        preconditions: Some(Preconditions {
            uid: uid.map(str::to_owned),
            resource_version: version.map(str::to_owned),
        }),
        ..DeleteParams::default()
    };
    let err = leases.delete("gone", &stale(Some("other"), None)).await;
    assert_eq!(code(err.expect_err("another uid")), 409);
    let err = leases.delete("gone", &stale(Some(&uid), Some("999"))).await;
    assert_eq!(code(err.expect_err("a stale version")), 409);
    leases
        .delete(
            "gone",
            &stale(Some(&uid), read.metadata.resource_version.as_deref()),
        )
        .await
        .expect("deleted");
    let err = leases.delete("gone", &DeleteParams::default()).await;
    assert_eq!(code(err.expect_err("gone")), 404);

    let err = leases.replace("gone", &params, &read).await;
    assert_eq!(code(err.expect_err("the deleted Lease's uid")), 409);
    assert!(api.lease("default", "gone").is_none(), "not created afresh");
    leases
        .create(&params, &lease("gone", json!({"holderIdentity": "b"})))
        .await
        .expect("created again");
    let mut old = read.clone();
    old.metadata.resource_version =
        api.lease("default", "gone").expect("lease")["metadata"]["resourceVersion"]
            .as_str()
            .map(str::to_owned);
    let err = leases.replace("gone", &params, &old).await;
    assert_eq!(code(err.expect_err("the old uid on the new Lease")), 409);
    assert_eq!(
        api.lease("default", "gone").expect("lease")["spec"]["holderIdentity"],
        "b"
    );
}

/// `application/json-patch+json` (RFC 6902): operations in order; a `test` that fails is 422,
/// a body that is not a patch 400, a missing Lease 404; a patched `resourceVersion` other than
/// the stored one is a failed precondition (409).
#[tokio::test]
async fn json_patches_are_applied_as_the_real_server_does() {
    let api = KubeApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(client(&api), "default");
    let created = leases
        .create(
            &PostParams::default(),
            &lease("patched", json!({"holderIdentity": "a"})),
        )
        .await
        .expect("created");
    let version = created.metadata.resource_version.expect("version");
    let url = api.url().to_owned();
    let patch = |name: &'static str, body: serde_json::Value| {
        let url = url.clone();
        async move { raw_patch(&url, name, "application/json-patch+json", body).await }
    };
    let ok = json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": version},
        {"op": "replace", "path": "/spec/holderIdentity", "value": "b"},
    ]);
    assert_eq!(patch("patched", ok.clone()).await, 200);
    assert_eq!(
        api.lease("default", "patched").expect("lease")["spec"]["holderIdentity"],
        "b"
    );
    assert_eq!(patch("patched", ok).await, 422, "the version changed");
    assert_eq!(patch("patched", json!({"op": "add"})).await, 400);
    assert_eq!(
        patch(
            "patched",
            json!([{"op": "replace", "path": "/metadata/resourceVersion", "value": "1"}])
        )
        .await,
        409
    );
    assert_eq!(patch("missing", json!([])).await, 404);
}

/// A PATCH with `content_type` over plain HTTP/1.1 (kube's client sends no JSON patch without
/// a feature we do not build); the status code.
async fn raw_patch(url: &str, name: &str, content_type: &str, body: serde_json::Value) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    let body = body.to_string();
    let request = format!(
        "PATCH /apis/coordination.k8s.io/v1/namespaces/default/leases/{name} HTTP/1.1\r\nHost: {address}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("read");
    answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {answer}"))
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
