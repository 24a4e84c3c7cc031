//! The admission policy that narrows the label's `patch` (`deploy/kubernetes/
//! policy-pod-label.yaml`), its CEL expressions evaluated on the writes the election makes
//! (allowed) and on writes it must not be able to make (refused).

mod common;

use common::policy::{ELECTION_USER, Policy, Verdict, election_in, election_unbound};
use serde_json::{Value, json};

const KEY: &str = "leader-rs.io/leader";
const CHANGE_ONLY: &str =
    "the election may change only the label leader-rs.io/leader of a Pod and its term";
const VALUE: &str = "the label leader-rs.io/leader can only be leader-example, the election's name";
const TOGETHER: &str = "the label leader-rs.io/leader and its term (the annotation leader-rs.io/leader, a fencing token in decimal digits) are set and removed together";
const OWN_POD: &str =
    "the election may set the label leader-rs.io/leader only on the Pod it runs in";

/// A Pod of the example's Deployment, as the API server stores it.
fn pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "default", "uid": format!("uid-of-{name}"),
            "resourceVersion": "41",
            "labels": {"app.kubernetes.io/name": "leader-example", "pod-template-hash": "5d8f7"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2025-06-01T10:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": "leader-example-5d8f7", "uid": "rs-uid", "controller": true,
                "blockOwnerDeletion": true}],
        },
        "spec": {"serviceAccountName": "leader-example",
            "containers": [{"name": "example", "image": "leader-example:latest"}]},
        "status": {"phase": "Running"},
    })
}

/// `pod` labelled by the term `term` (no annotation for `None`, as an earlier release wrote).
fn labelled(name: &str, term: Option<&str>) -> Value {
    let mut pod = pod(name);
    pod["metadata"]["labels"][KEY] = json!("leader-example");
    if let Some(term) = term {
        pod["metadata"]["annotations"][KEY] = json!(term);
    }
    pod
}

/// RFC 7386, as kube-apiserver applies a merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = json!({});
            }
            for (key, value) in fields {
                if value.is_null() {
                    target.as_object_mut().expect("object").remove(key);
                } else {
                    merge(&mut target[key], value);
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// The patch the label sends: set (with `term`) or remove.
fn label_patch(term: Option<&str>) -> Value {
    let value = term.map(|_| "leader-example");
    json!({"metadata": {"resourceVersion": "41", "labels": {KEY: value}, "annotations": {KEY: term}}})
}

fn patched(old: &Value, patch: &Value) -> Value {
    let mut new = old.clone();
    merge(&mut new, patch);
    new
}

#[test]
fn the_policy_allows_the_elections_writes() {
    let policy = Policy::load();
    let web1 = election_in("web-1");
    for (what, old, patch) in [
        ("label its own Pod", pod("web-1"), label_patch(Some("7"))),
        (
            "move its own Pod's label to its term",
            labelled("web-1", Some("3")),
            label_patch(Some("7")),
        ),
        (
            "label its own Pod over an earlier release's label",
            labelled("web-1", None),
            label_patch(Some("7")),
        ),
        (
            "the largest term",
            pod("web-1"),
            label_patch(Some("18446744073709551615")),
        ),
        (
            "remove its own label",
            labelled("web-1", Some("7")),
            label_patch(None),
        ),
        (
            "remove an ended term's label from another Pod",
            labelled("web-2", Some("6")),
            label_patch(None),
        ),
        (
            "remove an earlier release's label from another Pod",
            labelled("web-2", None),
            label_patch(None),
        ),
        (
            "remove a label that is gone",
            pod("web-2"),
            label_patch(None),
        ),
    ] {
        let new = patched(&old, &patch);
        assert_eq!(policy.admit(&old, &new, &web1), Verdict::Allowed, "{what}");
    }
}

#[test]
fn the_policy_refuses_every_other_write_of_the_election() {
    let policy = Policy::load();
    let web1 = election_in("web-1");
    let refused = |what: &str, old: &Value, new: &Value, user: &Value, expected: &str| {
        assert_eq!(
            policy.admit(old, new, user),
            Verdict::Denied(expected.to_owned()),
            "{what}"
        );
    };
    let set = |old: &Value, labels: Value, annotations: Value| {
        patched(
            old,
            &json!({"metadata": {"labels": labels, "annotations": annotations}}),
        )
    };
    // Where the label goes.
    let old = pod("web-2");
    refused(
        "label another Pod",
        &old,
        &patched(&old, &label_patch(Some("7"))),
        &web1,
        OWN_POD,
    );
    let old = labelled("web-2", Some("5"));
    refused(
        "move another Pod's label to another term",
        &old,
        &patched(&old, &label_patch(Some("7"))),
        &web1,
        OWN_POD,
    );
    let old = pod("web-1");
    let new = patched(&old, &label_patch(Some("7")));
    refused(
        "label from a token bound to no Pod",
        &old,
        &new,
        &election_unbound(),
        OWN_POD,
    );
    // What the label and its term say.
    for value in ["someone-else", "true", "leader-example2"] {
        refused(
            value,
            &old,
            &set(&old, json!({KEY: value}), json!({KEY: "7"})),
            &web1,
            VALUE,
        );
    }
    for term in ["7a", "-1", "", "1.5", "0x10", "123456789012345678901"] {
        refused(
            term,
            &old,
            &set(&old, json!({KEY: "leader-example"}), json!({KEY: term})),
            &web1,
            TOGETHER,
        );
    }
    refused(
        "a label without a term",
        &old,
        &set(&old, json!({KEY: "leader-example"}), json!({})),
        &web1,
        TOGETHER,
    );
    let old = labelled("web-1", Some("7"));
    refused(
        "a term left without its label",
        &old,
        &set(&old, json!({KEY: null}), json!({})),
        &web1,
        TOGETHER,
    );
    refused(
        "a term without a label",
        &pod("web-1"),
        &set(&pod("web-1"), json!({}), json!({KEY: "7"})),
        &web1,
        TOGETHER,
    );
    // Anything else on the Pod.
    let old = pod("web-1");
    for (what, patch) in [
        (
            "an image",
            json!({"spec": {"containers": [{"name": "example", "image": "evil:latest"}]}}),
        ),
        (
            "another label",
            json!({"metadata": {"labels": {"tier": "front"}}}),
        ),
        (
            "another label's value",
            json!({"metadata": {"labels": {"app.kubernetes.io/name": "other"}}}),
        ),
        (
            "another label removed",
            json!({"metadata": {"labels": {"pod-template-hash": null}}}),
        ),
        (
            "another annotation",
            json!({"metadata": {"annotations": {"example.com/x": "y"}}}),
        ),
        (
            "another annotation removed",
            json!({"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": null}}}),
        ),
        (
            "a finalizer",
            json!({"metadata": {"finalizers": ["example.com/hold"]}}),
        ),
        ("the owners", json!({"metadata": {"ownerReferences": null}})),
    ] {
        let mut patch = patch;
        merge(&mut patch, &label_patch(Some("7")));
        refused(what, &old, &patched(&old, &patch), &web1, CHANGE_ONLY);
    }
}

#[test]
fn the_policy_leaves_other_users_alone() {
    let policy = Policy::load();
    let old = pod("web-1");
    let new = patched(
        &old,
        &json!({"spec": {"containers": [{"name": "example", "image": "leader-example:v2"}]}}),
    );
    for user in [
        json!({"username": "system:serviceaccount:kube-system:replicaset-controller"}),
        json!({"username": "system:serviceaccount:other:leader-example",
               "extra": {"authentication.kubernetes.io/pod-name": ["web-1"]}}),
        json!({"username": "kubernetes-admin", "groups": ["system:masters"]}),
    ] {
        assert_eq!(
            policy.admit(&old, &new, &user),
            Verdict::NotMatched,
            "{user}"
        );
    }
    assert_eq!(
        policy.admit(&old, &new, &election_in("web-1")),
        Verdict::Denied(CHANGE_ONLY.to_owned())
    );
    assert_eq!(
        election_in("web-1")["username"],
        ELECTION_USER,
        "the account deploy/kubernetes/rbac.yaml creates"
    );
}
