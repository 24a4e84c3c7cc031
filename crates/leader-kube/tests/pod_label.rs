//! The leader's Pod label (`PodLabel`) on the test API server, through a real `kube::Client`:
//! added once a replica leads, removed on step-down, on handover and on shutdown, moved from a
//! crashed leader's Pod, never on two Pods at once (every change of the labelled set watched),
//! and a label write that fails or hangs never holds up the election. First, the Pod API of
//! the test server that these tests rely on, as kube-apiserver serves it.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{KubeApiServer, client, code, granted};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use leader_core::background::Candidate;
use leader_core::{LeaderElector, MemoryStore};
use leader_kube::{POD_LABEL, PodLabel};
use serde_json::json;
use tokio::time::{Instant, sleep, timeout};

const SELECTOR: &str = "leader-rs.io/leader=jobs";
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
    let pod = pods
        .patch(
            "web-1",
            &params,
            &Patch::Merge(&json!({"status": {"phase": "Failed"}})),
        )
        .await
        .expect("a patch of the status through the Pod");
    assert_eq!(
        pod.status.clone().and_then(|s| s.phase).as_deref(),
        Some("Running"),
        "the Pod strategy keeps the status"
    );
    assert_eq!(
        labels(&pod),
        BTreeSet::from([("app".into(), "web".into())]),
        "a patch without metadata leaves the metadata alone"
    );
    let pod = pods
        .patch(
            "web-1",
            &params,
            &Patch::Strategic(&json!({"status": {"phase": "Failed"}})),
        )
        .await
        .expect("a strategic merge patch without metadata");
    assert_eq!(labels(&pod), BTreeSet::from([("app".into(), "web".into())]));
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

/// Every change of the set of labelled Pods, as a label-selector watch sees them in order.
#[derive(Clone, Default)]
struct Labelled(Arc<Mutex<Vec<BTreeSet<String>>>>);

impl Labelled {
    async fn watch(api: &KubeApiServer) -> Self {
        let labelled = Self::default();
        let history = labelled.clone();
        let mut events = pods(api)
            .watch(&WatchParams::default().labels(SELECTOR), "0")
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

/// A replica: a Pod, and an elector (on a memory lock shared by the replicas) whose terms hold
/// the Pod's label. At the start of each term it notes which Pods carried the label then.
struct Replica {
    candidate: Candidate,
    at_term_start: Arc<Mutex<Vec<Vec<String>>>>,
}

fn replica(api: &KubeApiServer, store: &MemoryStore, pod: &str) -> Replica {
    api.put_pod("default", pod, &[("app", "jobs")]);
    let label = PodLabel::new(client(api), "default", pod, "jobs")
        .expect("valid names")
        .retry(RETRY)
        .removal_timeout(REMOVAL);
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
                .push(server.pods_selected("default", SELECTOR));
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

/// Asks the leader `pod` to step down; when it was asked.
fn step_down(replicas: &[(&'static str, Replica)], pod: &str) -> Instant {
    let leadership = replicas
        .iter()
        .find(|(name, _)| *name == pod)
        .and_then(|(_, r)| r.candidate.state.borrow().leadership().cloned())
        .expect("leads");
    let asked = Instant::now();
    leadership.step_down().expect("step down");
    asked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_label_follows_the_leader_and_is_never_on_two_pods() {
    let api = KubeApiServer::start().await;
    let labelled = Labelled::watch(&api).await;
    deny_what_the_role_does_not_grant(&api);
    let store = MemoryStore::new();
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
    let leadership = replicas
        .iter()
        .find(|(pod, _)| *pod == second)
        .and_then(|(_, r)| r.candidate.state.borrow().leadership().cloned())
        .expect("leads");
    leadership.hand_over(third).expect("hand over");
    drop(leadership);
    labelled.wait_for(third).await;
    let (leading, _) = leader_of(&replicas).await;
    assert_eq!(leading, third);

    // A shutdown of the leader: it releases, the label moves on.
    let at = replicas
        .iter()
        .position(|(pod, _)| *pod == third)
        .expect("replica");
    let (_, stopped) = replicas.remove(at);
    stopped.candidate.stop().await;
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
    let api = KubeApiServer::start().await;
    let labelled = Labelled::watch(&api).await;
    deny_what_the_role_does_not_grant(&api);
    let store = MemoryStore::new();
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
    for (_, replica) in replicas {
        replica.candidate.stop().await;
    }
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
    for (_, replica) in replicas {
        replica.candidate.stop().await;
    }
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
    for (_, replica) in replicas {
        replica.candidate.stop().await;
    }
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
        let label = PodLabel::new(client(&api), "default", "web-1", "jobs")
            .expect("valid")
            .label("example.com/billing-leader", "true")
            .expect("valid");
        assert_eq!(label.selector(), "example.com/billing-leader=true");
    });
}
