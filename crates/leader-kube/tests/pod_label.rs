//! The leader's Pod label (`PodLabel`) on the test API server, through a real `kube::Client`:
//! added once a replica leads, removed on step-down, on handover and on shutdown, moved from a
//! crashed leader's Pod, never on two Pods at once (every change of the labelled set watched),
//! a label write that fails or hangs never holds up the election, an old leader that resumes
//! or a write that lands late never removes the current term's label, and every write passes
//! the admission policy of `deploy/kubernetes`. First, the Pod API of the test server that
//! these tests rely on, as kube-apiserver serves it.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::policy::{Policy, client_with_token, token_of};
use common::{KubeApiServer, client, code, granted};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use leader_core::background::Candidate;
use leader_core::{CancellationToken, LeaderElector, LeaderState, Leadership, MemoryStore};
use leader_kube::{POD_LABEL, PodLabel};
use serde_json::{Value, json};
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep, timeout};

const SELECTOR: &str = "leader-rs.io/leader=jobs";
/// The label of the example's election, the one the admission policy allows.
const EXAMPLE_SELECTOR: &str = "leader-rs.io/leader=leader-example";
const RETRY: Duration = Duration::from_millis(100);
const REMOVAL: Duration = Duration::from_millis(300);

fn pods(api: &KubeApiServer) -> Api<Pod> {
    Api::namespaced(client(api), "default")
}

fn labels(pod: &Pod) -> BTreeSet<(String, String)> {
    pod.metadata
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect()
}

#[tokio::test]
async fn the_test_api_server_writes_pod_labels_as_kube_apiserver_does() {
    let api = KubeApiServer::start().await;
    api.put_pod("default", "web-1", &[("app", "web")]);
    let pods = pods(&api);
    let params = PatchParams::default();

    // Merge and strategic merge patches: a key added, a key removed with null.
    let patch = json!({"metadata": {"labels": {"leader-rs.io/leader": "jobs"}}});
    let pod = pods
        .patch("web-1", &params, &Patch::Merge(&patch))
        .await
        .expect("merge patch");
    assert_eq!(
        labels(&pod),
        BTreeSet::from([
            ("app".into(), "web".into()),
            ("leader-rs.io/leader".into(), "jobs".into())
        ])
    );
    let patch = json!({"metadata": {"labels": {"leader-rs.io/leader": null}}});
    let pod = pods
        .patch("web-1", &params, &Patch::Strategic(&patch))
        .await
        .expect("strategic merge patch");
    assert_eq!(labels(&pod), BTreeSet::from([("app".into(), "web".into())]));
    // Removing a label the Pod does not carry is a no-op for a merge patch.
    pods.patch("web-1", &params, &Patch::Merge(&patch))
        .await
        .expect("nothing to remove");

    // Validation: a label value the API refuses, a spec change, status kept.
    for (patch, expected) in [
        (
            json!({"metadata": {"labels": {"leader-rs.io/leader": "not a value"}}}),
            "metadata.labels: Invalid value",
        ),
        (
            json!({"metadata": {"labels": {"bad key/x/y": "v"}}}),
            "metadata.labels: Invalid value",
        ),
        (
            json!({"spec": {"containers": [{"name": "app", "image": "app:1", "command": ["sh"]}]}}),
            "pod updates may not change fields",
        ),
    ] {
        match pods.patch("web-1", &params, &Patch::Merge(&patch)).await {
            Err(kube::Error::Api(status)) => {
                assert_eq!(status.code, 422, "{patch}");
                assert!(status.message.contains(expected), "{}", status.message);
                assert!(
                    status.message.starts_with("Pod \"web-1\" is invalid"),
                    "{}",
                    status.message
                );
            }
            other => panic!("{patch}: {other:?}"),
        }
    }
    let status = json!({"status": {"phase": "Failed"}});
    for patch in [Patch::Merge(&status), Patch::Strategic(&status)] {
        let pod = pods
            .patch("web-1", &params, &patch)
            .await
            .expect("a patch of the status through the Pod");
        assert_eq!(
            pod.status.clone().and_then(|s| s.phase).as_deref(),
            Some("Running"),
            "the Pod strategy keeps the status: {patch:?}"
        );
        assert_eq!(
            labels(&pod),
            BTreeSet::from([("app".into(), "web".into())]),
            "a patch without metadata leaves the metadata alone: {patch:?}"
        );
    }
    // Preconditions and a missing Pod.
    let stale = json!({"metadata": {"resourceVersion": "1", "labels": {"a": "b"}}});
    let err = pods
        .patch("web-1", &params, &Patch::Merge(&stale))
        .await
        .expect_err("stale");
    assert_eq!(code(err), 409);
    let err = pods
        .patch("gone", &params, &Patch::Merge(&patch))
        .await
        .expect_err("missing");
    assert_eq!(code(err), 404);
    // PUT: no create on update, an update without resourceVersion overwrites.
    let mut replaced = pods.get("web-1").await.expect("get");
    replaced.metadata.resource_version = None;
    replaced
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("tier".into(), "front".into());
    let replaced = pods
        .replace("web-1", &PostParams::default(), &replaced)
        .await
        .expect("an unconditional update");
    assert!(labels(&replaced).contains(&("tier".into(), "front".into())));
    let mut missing = replaced.clone();
    missing.metadata.name = Some("missing".into());
    missing.metadata.uid = None; // else a uid precondition, 409 for a missing object too
    let err = pods
        .replace("missing", &PostParams::default(), &missing)
        .await
        .expect_err("no create on update");
    assert_eq!(code(err), 404);
    // A create needs containers; it starts Pending.
    let mut created = replaced.clone();
    created.metadata = kube::api::ObjectMeta {
        name: Some("web-2".into()),
        labels: replaced.metadata.labels.clone(),
        ..Default::default()
    };
    let created = pods
        .create(&PostParams::default(), &created)
        .await
        .expect("create");
    assert_eq!(
        created.status.and_then(|s| s.phase).as_deref(),
        Some("Pending")
    );

    // The same for a Lease: a patch of its spec alone keeps its labels and annotations.
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client(&api), "default");
    let lease = serde_json::from_value(json!({
        "metadata": {"name": "jobs", "labels": {"app": "web"},
                     "annotations": {"leader-rs.io/fencing-token": "7"}},
        "spec": {"holderIdentity": "a"}}))
    .expect("a Lease");
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create");
    for patch in [
        Patch::Merge(json!({"spec": {"holderIdentity": "b"}})),
        Patch::Strategic(json!({"spec": {"holderIdentity": "c"}})),
    ] {
        let lease = leases.patch("jobs", &params, &patch).await.expect("patch");
        assert!(
            lease.metadata.labels.is_some_and(|l| l["app"] == "web")
                && lease
                    .metadata
                    .annotations
                    .is_some_and(|a| a["leader-rs.io/fencing-token"] == "7"),
            "{patch:?}"
        );
    }

    // Annotations: a merge patch sets and removes them; a `null` for one the Pod lacks is not
    // stored (RFC 7386); keys are qualified names (any case), values strings.
    let patch = json!({"metadata": {"annotations": {"leader-rs.io/leader": null}}});
    let pod = pods
        .patch("web-2", &params, &Patch::Merge(&patch))
        .await
        .expect("nothing to remove");
    assert!(
        pod.metadata.annotations.unwrap_or_default().is_empty(),
        "no annotation stored"
    );
    let patch =
        json!({"metadata": {"annotations": {"leader-rs.io/leader": "7", "Example.com/X": "y"}}});
    let pod = pods
        .patch("web-2", &params, &Patch::Merge(&patch))
        .await
        .expect("annotations");
    assert_eq!(
        pod.metadata.annotations.unwrap_or_default()["leader-rs.io/leader"],
        "7"
    );
    for (patch, expected_code) in [
        (json!({"metadata": {"annotations": {"bad key": "v"}}}), 422),
        (json!({"metadata": {"annotations": {"a/b/c": "v"}}}), 422),
        (json!({"metadata": {"annotations": {"n": 7}}}), 400),
        (json!({"metadata": {"annotations": "v"}}), 400),
    ] {
        let err = pods
            .patch("web-2", &params, &Patch::Merge(&patch))
            .await
            .expect_err("refused");
        assert_eq!(code(err), expected_code, "{patch}");
    }
    // A list by name (a field selector), as a client with `list` but not `get` reads one Pod.
    let by_name = pods
        .list(&ListParams::default().fields("metadata.name=web-2"))
        .await
        .expect("list");
    assert_eq!(by_name.items.len(), 1);
    assert_eq!(by_name.items[0].metadata.name.as_deref(), Some("web-2"));

    // Lists and watches by label selector.
    let selected = |selector: &str| {
        let pods = pods.clone();
        let selector = selector.to_owned();
        async move {
            let list = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .expect("list");
            list.items
                .into_iter()
                .filter_map(|p| p.metadata.name)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(selected("app=web").await, ["web-1", "web-2"]);
    assert_eq!(
        selected("app=web,tier in (front)").await,
        ["web-1", "web-2"]
    );
    assert!(selected("app!=web").await.is_empty());
    let err = pods
        .list(&ListParams::default().labels("app=not valid"))
        .await
        .expect_err("bad selector");
    assert_eq!(code(err), 400);
    let mut watch = pods
        .watch(&WatchParams::default().labels(SELECTOR), "0")
        .await
        .expect("watch")
        .boxed();
    for (value, expected) in [(json!("jobs"), "ADDED"), (json!(null), "DELETED")] {
        let patch = json!({"metadata": {"labels": {"leader-rs.io/leader": value}}});
        pods.patch("web-2", &params, &Patch::Merge(&patch))
            .await
            .expect("patch");
        let event = timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("an event")
            .expect("open")
            .expect("decodes");
        let kind = match event {
            WatchEvent::Added(_) => "ADDED",
            WatchEvent::Deleted(_) => "DELETED",
            other => panic!("{other:?}"),
        };
        assert_eq!(kind, expected, "a Pod entering or leaving the selection");
    }
}

/// What tests make the server do beyond kube-apiserver's contract: a Pod write held back and
/// applied late, to the Pod as stored then (a precondition that no longer holds is 409); a
/// validating admission policy refusing a Pod update with the API server's status.
#[tokio::test]
async fn the_test_api_server_holds_pod_writes_and_runs_an_admission_policy() {
    let api = KubeApiServer::start().await;
    api.put_pod("default", "web-1", &[("app", "web")]);
    let pods = pods(&api);
    let read = pods.get("web-1").await.expect("get");
    let version = read.metadata.resource_version.clone().expect("a version");
    let mut held = api.hold_next_pod_write();
    let late = {
        let pods = pods.clone();
        let patch = json!({"metadata": {"resourceVersion": version, "labels": {"late": "yes"}}});
        tokio::spawn(async move {
            pods.patch("web-1", &PatchParams::default(), &Patch::Merge(&patch))
                .await
        })
    };
    timeout(Duration::from_secs(5), held.arrived())
        .await
        .expect("held");
    // The client gives up; the server still has the request.
    late.abort();
    let patch = json!({"metadata": {"labels": {"early": "yes"}}});
    pods.patch("web-1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("a later write goes through");
    assert_eq!(held.release().await, 409, "the held write's precondition");
    let pod = pods.get("web-1").await.expect("get");
    assert!(!labels(&pod).contains(&("late".into(), "yes".into())));
    // Without a precondition the held write lands, late.
    let mut held = api.hold_next_pod_write();
    let late = {
        let pods = pods.clone();
        tokio::spawn(async move {
            let patch = json!({"metadata": {"labels": {"late": "yes"}}});
            pods.patch("web-1", &PatchParams::default(), &Patch::Merge(&patch))
                .await
        })
    };
    held.arrived().await;
    assert_eq!(held.release().await, 200);
    late.await.expect("joined").expect("answered");

    api.admit_pod_updates("no-late", |_old, new, token| {
        if new["metadata"]["labels"]["late"] == "again" && token != "admin" {
            Err(format!("not by {token:?}"))
        } else {
            Ok(())
        }
    });
    let patch = json!({"metadata": {"labels": {"late": "again"}}});
    let err = pods
        .patch("web-1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect_err("refused");
    match err {
        kube::Error::Api(status) => {
            assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
            assert_eq!(
                status.message,
                "pods \"web-1\" is forbidden: ValidatingAdmissionPolicy 'no-late' with binding 'no-late' denied request: not by \"\""
            );
        }
        other => panic!("{other:?}"),
    }
    let admin: Api<Pod> = Api::namespaced(client_with_token(&api, "admin"), "default");
    admin
        .patch("web-1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("the policy tells requests apart by their bearer token");
}

/// Every change of the set of labelled Pods, as a label-selector watch sees them in order.
#[derive(Clone, Default)]
struct Labelled(Arc<Mutex<Vec<BTreeSet<String>>>>);

impl Labelled {
    async fn watch(api: &KubeApiServer) -> Self {
        Self::watch_selected(api, SELECTOR).await
    }

    async fn watch_selected(api: &KubeApiServer, selector: &str) -> Self {
        let labelled = Self::default();
        let history = labelled.clone();
        let mut events = pods(api)
            .watch(&WatchParams::default().labels(selector), "0")
            .await
            .expect("watch")
            .boxed();
        tokio::spawn(async move {
            let mut current = BTreeSet::new();
            while let Some(Ok(event)) = events.next().await {
                match event {
                    WatchEvent::Added(pod) | WatchEvent::Modified(pod) => {
                        current.insert(pod.metadata.name.unwrap_or_default());
                    }
                    WatchEvent::Deleted(pod) => {
                        current.remove(&pod.metadata.name.unwrap_or_default());
                    }
                    _ => continue,
                }
                history.0.lock().unwrap().push(current.clone());
            }
        });
        labelled
    }

    fn history(&self) -> Vec<BTreeSet<String>> {
        self.0.lock().unwrap().clone()
    }

    /// The set now (as far as the watch has seen).
    fn now(&self) -> BTreeSet<String> {
        self.history().last().cloned().unwrap_or_default()
    }

    /// Waits until exactly `pod` is labelled.
    async fn wait_for(&self, pod: &str) {
        let expected = BTreeSet::from([pod.to_owned()]);
        timeout(Duration::from_secs(10), async {
            while self.now() != expected {
                sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{pod} labelled: {:?}", self.history()));
    }

    /// Asserts that once exactly `pod` was labelled, nothing else ever was: the label never
    /// left it and no other Pod gained it.
    fn stayed_on(&self, pod: &str) {
        let expected = BTreeSet::from([pod.to_owned()]);
        let history = self.history();
        let from = history
            .iter()
            .position(|set| *set == expected)
            .unwrap_or_else(|| panic!("{pod} never labelled alone: {history:?}"));
        assert!(
            history[from..].iter().all(|set| *set == expected),
            "the label left {pod}, or another Pod gained it: {history:?}"
        );
    }

    fn never_two(&self) {
        let history = self.history();
        assert!(
            history.iter().all(|set| set.len() <= 1),
            "two Pods labelled at once: {history:?}"
        );
    }
}

/// Denies on the server every verb on Pods that `deploy/kubernetes/rbac-pod-label.yaml` does
/// not grant, so that the label is tested with exactly the rights a deployment gives it.
fn deny_what_the_role_does_not_grant(api: &KubeApiServer) {
    let granted = granted("rbac-pod-label.yaml", "pods");
    for verb in [
        "get", "list", "watch", "create", "update", "patch", "delete",
    ] {
        if !granted.iter().any(|g| g == verb) {
            api.deny_on("pods", verb);
        }
    }
}

/// A test API server that allows on Pods only what the Role grants, a watch of the Pods it
/// labels, and a store for the replicas' election.
async fn with_the_roles_rights() -> (KubeApiServer, Labelled, MemoryStore) {
    let api = KubeApiServer::start().await;
    let labelled = Labelled::watch(&api).await;
    deny_what_the_role_does_not_grant(&api);
    (api, labelled, MemoryStore::new())
}

/// A replica: a Pod, and an elector (on a memory lock shared by the replicas) whose terms hold
/// the Pod's label. At the start of each term it notes which Pods carried the label then.
struct Replica {
    candidate: Candidate,
    at_term_start: Arc<Mutex<Vec<Vec<String>>>>,
}

fn replica(api: &KubeApiServer, store: &MemoryStore, pod: &str) -> Replica {
    replica_of(api, store, pod, "jobs", &token_of(pod))
}

/// A replica in the election `election`, whose requests carry the bearer token `token`.
fn replica_of(
    api: &KubeApiServer,
    store: &MemoryStore,
    pod: &str,
    election: &str,
    token: &str,
) -> Replica {
    api.put_pod("default", pod, &[("app", "jobs")]);
    let label = PodLabel::new(client_with_token(api, token), "default", pod, election)
        .expect("valid names")
        .retry(RETRY)
        .removal_timeout(REMOVAL);
    let selector = label.selector();
    let at_term_start = Arc::new(Mutex::new(Vec::new()));
    let seen = at_term_start.clone();
    let server = api.clone();
    let builder = LeaderElector::builder(store.lock("jobs", pod))
        .lease_duration(RETRY * 20)
        .renew_deadline(RETRY * 10)
        .retry_period(RETRY)
        .beside_work(move |leadership| {
            seen.lock()
                .unwrap()
                .push(server.pods_selected("default", &selector));
            let label = label.clone();
            async move { label.hold(leadership).await }
        });
    Replica {
        candidate: Candidate::build(builder),
        at_term_start,
    }
}

/// The replica that leads, other than `not`, once there is one; its name and token.
async fn leader_other_than(
    replicas: &[(&'static str, Replica)],
    not: Option<&str>,
    within: Duration,
) -> (&'static str, u64) {
    timeout(within, async {
        loop {
            for (pod, replica) in replicas {
                if Some(*pod) != not
                    && let Some(token) = replica.candidate.leading_token()
                {
                    return (*pod, token);
                }
            }
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("a leader in time")
}

async fn leader_of(replicas: &[(&'static str, Replica)]) -> (&'static str, u64) {
    leader_other_than(replicas, None, Duration::from_secs(10)).await
}

/// Stops every replica.
async fn stop_all(replicas: Vec<(&'static str, Replica)>) {
    for (_, replica) in replicas {
        replica.candidate.stop().await;
    }
}

/// Stops the replica `pod` and takes it out of `replicas`.
async fn stop_one(replicas: &mut Vec<(&'static str, Replica)>, pod: &str) {
    let at = replicas
        .iter()
        .position(|(name, _)| *name == pod)
        .expect("replica");
    let (_, stopped) = replicas.remove(at);
    stopped.candidate.stop().await;
}

/// The term of the replica `pod`, which leads.
fn leadership_of(replicas: &[(&'static str, Replica)], pod: &str) -> Leadership {
    replicas
        .iter()
        .find(|(name, _)| *name == pod)
        .and_then(|(_, r)| r.candidate.state.borrow().leadership().cloned())
        .expect("leads")
}

/// Asks the leader `pod` to step down; when it was asked.
fn step_down(replicas: &[(&'static str, Replica)], pod: &str) -> Instant {
    let leadership = leadership_of(replicas, pod);
    let asked = Instant::now();
    leadership.step_down().expect("step down");
    asked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_label_follows_the_leader_and_is_never_on_two_pods() {
    let (api, labelled, store) = with_the_roles_rights().await;
    let mut replicas: Vec<(&'static str, Replica)> = ["a", "b", "c"]
        .into_iter()
        .map(|pod| (pod, replica(&api, &store, pod)))
        .collect();
    let (first, _) = leader_of(&replicas).await;
    labelled.wait_for(first).await;
    assert_eq!(
        api.pod("default", first).expect("pod")["metadata"]["labels"][POD_LABEL],
        "jobs"
    );

    // A step-down: the label moves with the lease.
    step_down(&replicas, first);
    let (second, _) = leader_other_than(&replicas, Some(first), Duration::from_secs(5)).await;
    labelled.wait_for(second).await;

    // A handover to a named replica.
    let third = ["a", "b", "c"]
        .into_iter()
        .find(|p| *p != second)
        .expect("another");
    leadership_of(&replicas, second)
        .hand_over(third)
        .expect("hand over");
    labelled.wait_for(third).await;
    let (leading, _) = leader_of(&replicas).await;
    assert_eq!(leading, third);

    // A shutdown of the leader: it releases, the label moves on.
    stop_one(&mut replicas, third).await;
    assert!(
        !api.pods_selected("default", SELECTOR)
            .contains(&third.to_owned()),
        "removed before the release"
    );
    let (fourth, _) = leader_of(&replicas).await;
    labelled.wait_for(fourth).await;

    for (_, replica) in replicas {
        for seen in replica.at_term_start.lock().unwrap().iter() {
            assert!(
                seen.is_empty(),
                "a term began while another Pod carried the label: {seen:?}"
            );
        }
        replica.candidate.stop().await;
    }
    labelled.never_two();
    sleep(RETRY).await;
    assert!(
        api.pods_selected("default", SELECTOR).is_empty(),
        "nobody leads, nobody is labelled: {:?}",
        labelled.history()
    );
}

/// A label write that lands on another Pod during the term (an earlier leader's PATCH,
/// delayed, or sent by a process frozen and resumed) is removed at once, and a label someone
/// removes from the leader's own Pod comes back: the label stays on the leader's Pod alone for
/// the whole term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_label_on_another_pod_is_removed_during_the_term() {
    let (api, labelled, store) = with_the_roles_rights().await;
    let replicas = vec![("a", replica(&api, &store, "a"))];
    api.put_pod("default", "old-leader", &[("app", "jobs")]);
    let (leader, token) = leader_of(&replicas).await;
    labelled.wait_for(leader).await;
    let patch = |pod: &'static str, value: Option<&'static str>| {
        let pods = pods(&api);
        async move {
            let labels = json!({"metadata": {"labels": {POD_LABEL: value}}});
            pods.patch(pod, &PatchParams::default(), &Patch::Merge(&labels))
                .await
                .expect("patch");
        }
    };
    for round in 0..3 {
        patch("old-leader", Some("jobs")).await;
        let landed = Instant::now();
        labelled.wait_for(leader).await;
        assert!(
            landed.elapsed() < Duration::from_secs(2),
            "round {round}: the late label stayed {:?}",
            landed.elapsed()
        );
    }
    // Someone removes the leader's own label: it comes back.
    patch(leader, None).await;
    timeout(Duration::from_secs(2), async {
        while api.pods_selected("default", SELECTOR) != [leader] {
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the leader's Pod labelled again");
    assert_eq!(replicas[0].1.candidate.leading_token(), Some(token));
    stop_all(replicas).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_leaders_label_is_removed_before_the_next_labels_its_own() {
    let api = KubeApiServer::start().await;
    // The Pod of a leader that was killed: its label stayed.
    api.put_pod(
        "default",
        "crashed",
        &[("app", "jobs"), (POD_LABEL, "jobs")],
    );
    // Another election's label stays where it is.
    api.put_pod("default", "other", &[(POD_LABEL, "billing")]);
    let labelled = Labelled::watch(&api).await;
    labelled.wait_for("crashed").await;
    deny_what_the_role_does_not_grant(&api);
    let store = MemoryStore::new();
    let replicas = vec![("a", replica(&api, &store, "a"))];
    leader_of(&replicas).await;
    labelled.wait_for("a").await;
    labelled.never_two();
    assert_eq!(
        api.pods_selected("default", &format!("{POD_LABEL}=billing")),
        ["other"]
    );
    stop_all(replicas).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_that_cannot_be_written_never_holds_up_the_election() {
    let api = KubeApiServer::start().await;
    let labelled = Labelled::watch(&api).await;
    let store = MemoryStore::new();
    api.deny_on("pods", "patch");
    let replicas: Vec<(&'static str, Replica)> = ["a", "b"]
        .into_iter()
        .map(|pod| (pod, replica(&api, &store, pod)))
        .collect();
    let (first, _) = leader_of(&replicas).await;
    sleep(RETRY * 5).await;
    assert!(
        api.pods_selected("default", SELECTOR).is_empty(),
        "patch denied: no label"
    );
    // The step-down is as quick as without a label: nothing was labelled, nothing to remove.
    let asked = step_down(&replicas, first);
    let (second, _) = leader_other_than(&replicas, Some(first), RETRY * 10).await;
    eprintln!(
        "step-down to the next term with patch denied: {:?}",
        asked.elapsed()
    );
    // Allowed again: the leader labels its Pod at its next attempt.
    api.allow_on("pods", "patch");
    labelled.wait_for(second).await;

    // Now every Pod write hangs for longer than the removal timeout: the end of the term waits
    // for the removal no longer than that, and the label is still never on two Pods (the next
    // leader removes the old one's before it labels its own).
    api.delay_pod_writes(REMOVAL * 4);
    let asked = step_down(&replicas, second);
    let (third, _) = leader_other_than(&replicas, Some(second), RETRY * 20).await;
    let took = asked.elapsed();
    eprintln!("step-down to the next term with every Pod write hanging: {took:?}");
    assert!(
        took < REMOVAL + RETRY * 5,
        "the release waited for the hanging removal {took:?} (removal timeout {REMOVAL:?})"
    );
    labelled.wait_for(third).await;
    labelled.never_two();
    api.delay_pod_writes(Duration::ZERO);
    stop_all(replicas).await;
}

#[test]
fn labels_the_api_server_would_refuse_are_refused_when_built() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let api = KubeApiServer::start().await;
        let long = "x".repeat(64);
        for (pod, election, expected) in [
            ("web-1", long.as_str(), "not a label value"),
            ("web-1", "with space", "not a label value"),
            ("Web_1", "jobs", "not a namespace and a Pod name"),
        ] {
            let err = PodLabel::new(client(&api), "default", pod, election)
                .expect_err(election)
                .to_string();
            assert!(err.contains(expected), "{err}");
        }
        let label = PodLabel::new(client(&api), "default", "web-1", "jobs").expect("valid");
        assert_eq!(label.selector(), "leader-rs.io/leader=jobs");
        let err = label
            .label("not/a/key", "jobs")
            .expect_err("key")
            .to_string();
        assert!(err.contains("not a label key"), "{err}");
        // A switch copied from an on/off setting is no key.
        for switch in ["true", "ON", "1"] {
            let err = PodLabel::new(client(&api), "default", "web-1", "jobs")
                .expect("valid")
                .label(switch, "jobs")
                .expect_err(switch)
                .to_string();
            assert!(err.contains("is a switch, not a label key"), "{err}");
        }
        let label = PodLabel::new(client(&api), "default", "web-1", "jobs")
            .expect("valid")
            .label("example.com/billing-leader", "true")
            .expect("valid");
        assert_eq!(label.selector(), "example.com/billing-leader=true");
    });
}

/// An elector on a runtime and a thread of its own, whose label task runs on the test's
/// runtime: blocking that thread freezes the elector (its term neither renewed nor cancelled,
/// as in a process stopped and resumed before its term's timer ran, or an elector whose runtime
/// is stuck) while the label task goes on.
struct FreezableReplica {
    state: watch::Receiver<LeaderState>,
    runtime: tokio::runtime::Handle,
    shutdown: CancellationToken,
    thread: std::thread::JoinHandle<()>,
}

impl FreezableReplica {
    fn start(api: &KubeApiServer, store: &MemoryStore, pod: &str) -> Self {
        api.put_pod("default", pod, &[("app", "jobs")]);
        let label = PodLabel::new(client(api), "default", pod, "jobs")
            .expect("valid names")
            .retry(RETRY)
            .removal_timeout(REMOVAL);
        let lock = store.lock("jobs", pod);
        let tests = tokio::runtime::Handle::current();
        let (started, elector) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let builder = LeaderElector::builder(lock)
                    .lease_duration(RETRY * 20)
                    .renew_deadline(RETRY * 10)
                    .retry_period(RETRY)
                    .beside_work(move |leadership| {
                        let label = label.clone();
                        let task = tests.spawn(async move { label.hold(leadership).await });
                        async move {
                            let _ = task.await;
                        }
                    });
                let candidate = Candidate::build(builder);
                let handles = (
                    candidate.state.clone(),
                    tokio::runtime::Handle::current(),
                    candidate.shutdown.clone(),
                );
                started.send(handles).expect("the test waits");
                let _ = candidate.task.await;
            });
        });
        let (state, runtime, shutdown) = elector.recv().expect("started");
        Self {
            state,
            runtime,
            shutdown,
            thread,
        }
    }

    fn leading_token(&self) -> Option<u64> {
        self.state
            .borrow()
            .leadership()
            .map(leader_core::Leadership::fencing_token)
    }

    /// Blocks the elector's thread until the returned sender is dropped.
    async fn freeze(&self) -> std::sync::mpsc::Sender<()> {
        let (thaw, frozen) = std::sync::mpsc::channel::<()>();
        let (blocked, is_blocked) = oneshot::channel();
        self.runtime.spawn(async move {
            let _ = blocked.send(());
            let _ = frozen.recv();
        });
        is_blocked.await.expect("frozen");
        thaw
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::task::spawn_blocking(move || self.thread.join().expect("the elector's thread"))
            .await
            .expect("joined");
    }
}

/// A leader whose elector is frozen past its term (its renewals stop, its term is not
/// cancelled) while its label task goes on: the next leader moves the label to its own Pod,
/// and the old one, which finds its renew deadline passed, writes nothing more (one that
/// removed every other Pod's label and labelled its own again would fight the new leader).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_leader_that_resumes_never_removes_the_new_leaders_label() {
    let (api, labelled, store) = with_the_roles_rights().await;
    let old = FreezableReplica::start(&api, &store, "old");
    timeout(Duration::from_secs(10), async {
        while old.leading_token().is_none() {
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the first replica leads");
    labelled.wait_for("old").await;
    let replicas = vec![("new", replica(&api, &store, "new"))];
    let thaw = old.freeze().await;
    let (_, token) = leader_other_than(&replicas, None, Duration::from_secs(10)).await;
    labelled.wait_for("new").await;
    assert_eq!(
        api.pod("default", "new").expect("pod")["metadata"]["annotations"][POD_LABEL],
        token.to_string(),
        "the label carries its term"
    );
    // The old leader's label task runs all this while, on a term it still believes in.
    sleep(RETRY * 10).await;
    assert!(
        old.leading_token().is_some(),
        "its term was never cancelled"
    );
    drop(thaw);
    timeout(Duration::from_secs(5), async {
        while old.leading_token().is_some() {
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the old term ends once its elector runs");
    sleep(RETRY * 5).await;
    labelled.stayed_on("new");
    old.stop().await;
    stop_all(replicas).await;
}

/// A removal that the end of a term sent and that lands late, after the same Pod's next term
/// labelled it again, is refused (409: the Pod changed since the removal's read) and the label
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_that_lands_late_never_strips_the_label_written_since() {
    let (api, labelled, store) = with_the_roles_rights().await;
    let replicas = vec![("a", replica(&api, &store, "a"))];
    let (_, first) = leader_of(&replicas).await;
    labelled.wait_for("a").await;
    let mut held = api.hold_next_pod_write();
    step_down(&replicas, "a");
    timeout(Duration::from_secs(5), held.arrived())
        .await
        .expect("the end of the term sends the removal");
    // Abandoned after the removal timeout; the replica leads again and labels its Pod.
    let second = timeout(Duration::from_secs(10), async {
        loop {
            if let Some(token) = replicas[0].1.candidate.leading_token()
                && token > first
            {
                return token;
            }
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("a second term");
    let term = |pod: Value| {
        pod["metadata"]["annotations"][POD_LABEL]
            .as_str()
            .map(str::to_owned)
    };
    timeout(Duration::from_secs(5), async {
        while term(api.pod("default", "a").expect("pod")) != Some(second.to_string()) {
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the second term's label");
    assert_eq!(
        held.release().await,
        409,
        "the first term's removal, applied late"
    );
    sleep(RETRY * 3).await;
    labelled.stayed_on("a");
    assert_eq!(api.pods_selected("default", SELECTOR), ["a"]);
    stop_all(replicas).await;
}

/// A label whose term is later than the leader's while the leader's term is still renewed
/// cannot be a later term of this election (the fencing tokens restarted, as after a Lease
/// deleted while no candidate saw it): it is removed, and never keeps the leader's Pod
/// unlabelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_term_seen_while_the_term_is_renewed_is_not_one() {
    let api = KubeApiServer::start().await;
    api.put_pod(
        "default",
        "restarted",
        &[("app", "jobs"), (POD_LABEL, "jobs")],
    );
    let term = json!({"metadata": {"annotations": {POD_LABEL: "999"}}});
    pods(&api)
        .patch("restarted", &PatchParams::default(), &Patch::Merge(&term))
        .await
        .expect("a term from before the count restarted");
    let labelled = Labelled::watch(&api).await;
    labelled.wait_for("restarted").await;
    deny_what_the_role_does_not_grant(&api);
    let store = MemoryStore::new();
    let replicas = vec![("a", replica(&api, &store, "a"))];
    let (_, token) = leader_of(&replicas).await;
    assert!(token < 999);
    labelled.wait_for("a").await;
    labelled.never_two();
    stop_all(replicas).await;
}

/// With the admission policy of `deploy/kubernetes/policy-pod-label.yaml` enforced by the
/// server, each replica's requests from a token bound to its own Pod: every write the label
/// makes through a crash's leftovers, a step-down, a handover and a shutdown is allowed. A
/// replica whose token is bound to no Pod leads without a label: the policy refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_of_the_label_passes_the_admission_policy() {
    let api = KubeApiServer::start().await;
    let refused = Policy::load().enforce_on(&api);
    // A crashed leader's label, written by an earlier release (no term).
    api.put_pod(
        "default",
        "web-0",
        &[("app", "jobs"), (POD_LABEL, "leader-example")],
    );
    let labelled = Labelled::watch_selected(&api, EXAMPLE_SELECTOR).await;
    labelled.wait_for("web-0").await;
    deny_what_the_role_does_not_grant(&api);
    let store = MemoryStore::new();
    let mut replicas: Vec<(&'static str, Replica)> = ["web-1", "web-2", "web-3"]
        .into_iter()
        .map(|pod| {
            let replica = replica_of(&api, &store, pod, "leader-example", &token_of(pod));
            (pod, replica)
        })
        .collect();
    let (first, _) = leader_of(&replicas).await;
    labelled.wait_for(first).await;
    step_down(&replicas, first);
    let (second, _) = leader_other_than(&replicas, Some(first), Duration::from_secs(5)).await;
    labelled.wait_for(second).await;
    leadership_of(&replicas, second)
        .hand_over(first)
        .expect("hand over");
    labelled.wait_for(first).await;
    stop_one(&mut replicas, first).await;
    let (fourth, _) = leader_of(&replicas).await;
    labelled.wait_for(fourth).await;
    stop_all(replicas).await;
    labelled.never_two();
    assert!(
        refused.lock().unwrap().is_empty(),
        "refused: {:?}",
        refused.lock().unwrap()
    );

    let mut unbound = replica_of(&api, &store, "web-9", "leader-example", "unbound");
    unbound
        .candidate
        .wait_leading(Duration::from_secs(10))
        .await;
    sleep(RETRY * 5).await;
    assert!(api.pods_selected("default", EXAMPLE_SELECTOR).is_empty());
    let refusals = refused.lock().unwrap().clone();
    assert!(
        refusals
            .iter()
            .any(|r| r.starts_with("web-9") && r.contains("only on the Pod it runs in")),
        "{refusals:?}"
    );
    unbound.candidate.stop().await;
}
