//! Field ownership (`metadata.managedFields`) as server-side apply keeps it, and the two merge
//! patch forms.
//!
//! Sources in the Kubernetes tree: `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/
//! create.go` (`managerOrUserAgent`, `prefixFromUserAgent`: an update's manager is its
//! `fieldManager`, else its User-Agent up to the first `/`); `staging/src/k8s.io/apimachinery/pkg/
//! util/managedfields/internal/conflict.go` (`NewConflictError`: the 409 text and causes);
//! `sigs.k8s.io/structured-merge-diff` `merge/update.go` (an update takes over the fields it
//! changes from every other manager; an apply conflicts on a field another manager owns when it
//! sets another value, shares it when it sets the same value, takes it over with `force`, and
//! removes the fields it applied before and no longer applies when nobody else owns them).
//!
//! What is tracked, as the Lease schema types it: every field of `spec` (all scalars), each key
//! of `metadata.labels` and `metadata.annotations`, and `metadata.ownerReferences` as one field
//! (the real server tracks each reference by its `uid`). A `managedFields` sent by a client is
//! ignored: the server's record stands (the real server would take a non-empty one as given and
//! reset on an empty list).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value, json};

mod patch;

pub(crate) use patch::*;

/// A field: its path of keys from the object's root.
pub(crate) type Path = Vec<String>;

/// One entry of `managedFields`: a manager, the kind of operation, the fields it owns.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    manager: String,
    /// `Apply` or `Update`.
    operation: &'static str,
    time: String,
    fields: BTreeSet<Path>,
}

/// Fields that an apply would take from other managers without `force`: (manager's
/// description, field) pairs, in the order the real server lists them.
#[derive(Debug, Default)]
pub(crate) struct Conflicts(Vec<(String, String)>);

impl Conflicts {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The `Status` message and causes, as `NewConflictError` writes them.
    pub(crate) fn status(&self) -> (String, Value) {
        let causes: Vec<Value> = self
            .0
            .iter()
            .map(|(manager, field)| {
                json!({"type": "FieldManagerConflict",
                       "message": format!("conflict with {manager}"), "field": field})
            })
            .collect();
        let message = if let [(manager, field)] = self.0.as_slice() {
            format!("Apply failed with 1 conflict: conflict with {manager}: {field}")
        } else {
            let mut by_manager: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (manager, field) in &self.0 {
                by_manager.entry(manager).or_default().push(field);
            }
            let lines: Vec<String> = by_manager
                .iter()
                .map(|(manager, fields)| {
                    let fields: Vec<String> = fields.iter().map(|f| format!("- {f}")).collect();
                    format!("conflicts with {manager}:\n{}", fields.join("\n"))
                })
                .collect();
            format!(
                "Apply failed with {} conflicts: {}",
                self.0.len(),
                lines.join("\n")
            )
        };
        (message, json!({ "causes": causes }))
    }
}

/// The manager of a request: `fieldManager`, else the User-Agent before its first `/`, without
/// unprintable characters, at most 128 bytes.
pub(crate) fn manager(field_manager: Option<&str>, user_agent: &str) -> String {
    if let Some(manager) = field_manager.filter(|m| !m.is_empty()) {
        return manager.to_owned();
    }
    let mut out = String::new();
    for c in user_agent.split('/').next().unwrap_or_default().chars() {
        if c.is_control() {
            continue;
        }
        if out.len() + c.len_utf8() > 128 {
            break;
        }
        out.push(c);
    }
    out
}

/// The tracked fields of `object` and their values.
pub(crate) fn leaves(object: &Value) -> BTreeMap<Path, Value> {
    let mut out = BTreeMap::new();
    if let Some(spec) = object["spec"].as_object() {
        for (key, value) in spec {
            if !value.is_null() {
                out.insert(vec!["spec".to_owned(), key.clone()], value.clone());
            }
        }
    }
    for map in ["labels", "annotations"] {
        if let Some(entries) = object["metadata"][map].as_object() {
            for (key, value) in entries {
                out.insert(
                    vec!["metadata".to_owned(), map.to_owned(), key.clone()],
                    value.clone(),
                );
            }
        }
    }
    let references = &object["metadata"]["ownerReferences"];
    if references.is_array() {
        out.insert(
            vec!["metadata".to_owned(), "ownerReferences".to_owned()],
            references.clone(),
        );
    }
    out
}

/// The field as the real server names it in a conflict: `.spec.holderIdentity`.
fn dotted(path: &Path) -> String {
    path.iter().map(|p| format!(".{p}")).collect()
}

fn set_at(object: &mut Value, path: &Path, value: Value) {
    let mut node = object;
    for key in &path[..path.len() - 1] {
        if !node[key.as_str()].is_object() {
            node[key.as_str()] = json!({});
        }
        node = &mut node[key.as_str()];
    }
    node[path[path.len() - 1].as_str()] = value;
}

fn remove_at(object: &mut Value, path: &Path) {
    let mut node = object;
    for key in &path[..path.len() - 1] {
        match node.get_mut(key.as_str()) {
            Some(next) => node = next,
            None => return,
        }
    }
    if let Some(map) = node.as_object_mut() {
        map.remove(path[path.len() - 1].as_str());
    }
}

/// `fieldsV1` of a set of fields: `{"f:spec": {"f:holderIdentity": {}}}`.
fn encode(fields: &BTreeSet<Path>) -> Value {
    let mut root = Map::new();
    for path in fields {
        let mut node = &mut root;
        for key in path {
            node = node
                .entry(format!("f:{key}"))
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("an object");
        }
    }
    Value::Object(root)
}

fn decode(fields: &Value, prefix: &mut Path, out: &mut BTreeSet<Path>) {
    let Some(map) = fields.as_object() else {
        return;
    };
    let children: Vec<_> = map
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("f:")?, v)))
        .collect();
    if children.is_empty() && !prefix.is_empty() {
        out.insert(prefix.clone());
        return;
    }
    for (key, value) in children {
        prefix.push(key.to_owned());
        decode(value, prefix, out);
        prefix.pop();
    }
}

fn entries(object: &Value) -> Vec<Entry> {
    object["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let mut fields = BTreeSet::new();
            decode(&e["fieldsV1"], &mut Vec::new(), &mut fields);
            Some(Entry {
                manager: e["manager"].as_str()?.to_owned(),
                operation: if e["operation"] == "Apply" {
                    "Apply"
                } else {
                    "Update"
                },
                time: e["time"].as_str().unwrap_or_default().to_owned(),
                fields,
            })
        })
        .collect()
}

fn store_entries(object: &mut Value, api_version: &str, entries: Vec<Entry>) {
    let list: Vec<Value> = entries
        .into_iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            json!({"manager": e.manager, "operation": e.operation, "apiVersion": api_version,
                   "time": e.time, "fieldsType": "FieldsV1", "fieldsV1": encode(&e.fields)})
        })
        .collect();
    if list.is_empty() {
        if let Some(meta) = object["metadata"].as_object_mut() {
            meta.remove("managedFields");
        }
    } else {
        object["metadata"]["managedFields"] = Value::Array(list);
    }
}

fn now() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Records a create, an update or a (non-apply) patch by `manager`: it now owns every field it
/// changed, and nobody else does. `new` gets `old`'s record, updated.
pub(crate) fn record_update(
    old: Option<&Value>,
    new: &mut Value,
    manager: &str,
    api_version: &str,
) {
    let before = old.map(leaves).unwrap_or_default();
    let after = leaves(new);
    let changed: BTreeSet<Path> = after
        .iter()
        .filter(|(path, value)| before.get(*path) != Some(value))
        .map(|(path, _)| path.clone())
        .chain(before.keys().filter(|p| !after.contains_key(*p)).cloned())
        .collect();
    let mut owners = old.map(entries).unwrap_or_default();
    for entry in &mut owners {
        entry.fields.retain(|f| !changed.contains(f));
    }
    let ours: BTreeSet<Path> = changed
        .into_iter()
        .filter(|p| after.contains_key(p))
        .collect();
    if !ours.is_empty() {
        match owners
            .iter_mut()
            .find(|e| e.manager == manager && e.operation == "Update")
        {
            Some(entry) => {
                entry.fields.extend(ours);
                entry.time = now();
            }
            None => owners.push(Entry {
                manager: manager.to_owned(),
                operation: "Update",
                time: now(),
                fields: ours,
            }),
        }
    }
    store_entries(new, api_version, owners);
}

/// A server-side apply of `config` by `manager` onto `old` (absent: a create). Returns the new
/// object, or the conflicts when it would change fields other managers own and `force` is off.
pub(crate) fn apply(
    old: Option<&Value>,
    config: &Value,
    manager: &str,
    force: bool,
    api_version: &str,
) -> Result<Value, Conflicts> {
    let current = old.map(leaves).unwrap_or_default();
    let applied = leaves(config);
    let mut owners = old.map(entries).unwrap_or_default();
    let is_applier = |e: &Entry| e.manager == manager && e.operation == "Apply";
    let changes: BTreeSet<&Path> = applied
        .iter()
        .filter(|(path, value)| current.get(*path) != Some(value))
        .map(|(path, _)| path)
        .collect();
    let mut conflicts = Conflicts::default();
    for entry in owners.iter().filter(|e| !is_applier(e)) {
        for path in entry.fields.iter().filter(|p| changes.contains(p)) {
            let who = if entry.operation == "Update" {
                format!("{:?} using {api_version}", entry.manager)
            } else {
                format!("{:?}", entry.manager)
            };
            conflicts.0.push((who, dotted(path)));
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(conflicts);
    }
    let mut object = old.cloned().unwrap_or_else(|| json!({"metadata": {}}));
    for (path, value) in &applied {
        set_at(&mut object, path, value.clone());
    }
    let previously: BTreeSet<Path> = owners
        .iter()
        .find(|e| is_applier(e))
        .map(|e| e.fields.clone())
        .unwrap_or_default();
    for path in previously.difference(&applied.keys().cloned().collect()) {
        let owned_elsewhere = owners
            .iter()
            .any(|e| !is_applier(e) && e.fields.contains(path));
        if !owned_elsewhere {
            remove_at(&mut object, path);
        }
    }
    for entry in owners.iter_mut().filter(|e| !is_applier(e)) {
        entry.fields.retain(|f| !changes.contains(f));
    }
    owners.retain(|e| !is_applier(e));
    owners.push(Entry {
        manager: manager.to_owned(),
        operation: "Apply",
        time: now(),
        fields: applied.into_keys().collect(),
    });
    store_entries(&mut object, api_version, owners);
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = "coordination.k8s.io/v1";

    fn lease(spec: Value) -> Value {
        json!({"metadata": {"name": "l"}, "spec": spec})
    }

    #[test]
    fn the_manager_is_the_field_manager_or_the_user_agent_prefix() {
        assert_eq!(manager(Some("kubert"), "kube-rs/5.0"), "kubert");
        assert_eq!(manager(None, "kube-rs/5.0 (linux)"), "kube-rs");
        assert_eq!(manager(Some(""), "client-go/v1"), "client-go");
        assert_eq!(manager(None, ""), "");
    }

    #[test]
    fn an_update_takes_over_the_fields_it_changes() {
        let mut first = lease(json!({"holderIdentity": "a", "leaseDurationSeconds": 15}));
        record_update(None, &mut first, "ours", V1);
        let mut second = lease(json!({"holderIdentity": "b", "leaseDurationSeconds": 15}));
        record_update(Some(&first), &mut second, "theirs", V1);
        let owners = entries(&second);
        let of = |m: &str| {
            owners
                .iter()
                .find(|e| e.manager == m)
                .map(|e| e.fields.clone())
        };
        assert_eq!(
            of("theirs"),
            Some([vec!["spec".into(), "holderIdentity".into()]].into())
        );
        assert_eq!(
            of("ours"),
            Some([vec!["spec".into(), "leaseDurationSeconds".into()]].into())
        );
    }

    #[test]
    fn an_apply_conflicts_on_another_managers_field_unless_forced() {
        let mut held = lease(json!({"holderIdentity": "a", "leaseDurationSeconds": 15}));
        record_update(None, &mut held, "ours", V1);
        let config = lease(json!({"holderIdentity": "b", "leaseDurationSeconds": 15}));
        let conflicts = apply(Some(&held), &config, "klm", false, V1).expect_err("a conflict");
        let (message, details) = conflicts.status();
        assert_eq!(
            message,
            "Apply failed with 1 conflict: conflict with \"ours\" using coordination.k8s.io/v1: .spec.holderIdentity"
        );
        assert_eq!(details["causes"][0]["field"], ".spec.holderIdentity");
        // The same value is shared, not a conflict; force takes the field over.
        let same = lease(json!({"leaseDurationSeconds": 15}));
        apply(Some(&held), &same, "klm", false, V1).expect("shared");
        let forced = apply(Some(&held), &config, "klm", true, V1).expect("forced");
        assert_eq!(forced["spec"]["holderIdentity"], "b");
        let owners = entries(&forced);
        let ours = owners.iter().find(|e| e.manager == "ours").expect("ours");
        assert!(
            !ours
                .fields
                .contains(&vec!["spec".into(), "holderIdentity".into()])
        );
    }

    #[test]
    fn an_apply_removes_what_it_no_longer_applies_unless_others_own_it() {
        let first = apply(
            None,
            &lease(json!({"holderIdentity": "a", "renewTime": "t"})),
            "klm",
            false,
            V1,
        )
        .expect("create");
        let second = apply(
            Some(&first),
            &lease(json!({"holderIdentity": "a"})),
            "klm",
            false,
            V1,
        )
        .expect("apply");
        assert!(second["spec"].get("renewTime").is_none(), "{second}");
        assert_eq!(second["spec"]["holderIdentity"], "a");
    }

    #[test]
    fn merge_patches_follow_rfc_7386() {
        // The examples of RFC 7386's appendix A that a Lease or a Pod can meet.
        for (target, patch, expected) in [
            (json!({"a": "b"}), json!({"a": "c"}), json!({"a": "c"})),
            (
                json!({"a": "b"}),
                json!({"b": "c"}),
                json!({"a": "b", "b": "c"}),
            ),
            (json!({"a": "b"}), json!({"a": null}), json!({})),
            (
                json!({"a": "b", "b": "c"}),
                json!({"a": null}),
                json!({"b": "c"}),
            ),
            (json!({"a": ["b"]}), json!({"a": "c"}), json!({"a": "c"})),
            (json!({"a": "c"}), json!({"a": ["b"]}), json!({"a": ["b"]})),
            (
                json!({"a": {"b": "c"}}),
                json!({"a": {"b": "d", "c": null}}),
                json!({"a": {"b": "d"}}),
            ),
            (
                json!({"a": [{"b": "c"}]}),
                json!({"a": [1]}),
                json!({"a": [1]}),
            ),
            (
                json!({"e": null}),
                json!({"a": 1}),
                json!({"e": null, "a": 1}),
            ),
            (
                json!([1, 2]),
                json!({"a": "b", "c": null}),
                json!({"a": "b"}),
            ),
            (
                json!({}),
                json!({"a": {"bb": {"ccc": null}}}),
                json!({"a": {"bb": {}}}),
            ),
        ] {
            let mut patched = target.clone();
            merge_patch(&mut patched, &patch);
            assert_eq!(patched, expected, "{target} + {patch}");
        }
    }

    #[test]
    fn strategic_merge_patches_merge_owner_references_by_uid() {
        let mut object = json!({"metadata": {"ownerReferences": [
            {"uid": "1", "name": "a"}, {"uid": "2", "name": "b"}]}});
        strategic_merge_patch(
            &mut object,
            &json!({"metadata": {"ownerReferences": [
                {"uid": "2", "$patch": "delete"}, {"uid": "3", "name": "c"}]}}),
        );
        let names: Vec<&str> = object["metadata"]["ownerReferences"]
            .as_array()
            .expect("list")
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        assert_eq!(names, ["a", "c"]);
    }

    #[test]
    fn json_patches_apply_in_order_and_fail_whole() {
        let lease = json!({"metadata": {"resourceVersion": "5", "annotations": {"a/b": "1"}},
            "spec": {"holderIdentity": "a", "list": [1, 2]}});
        let patched = json_patch(
            &lease,
            &json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "5"},
                {"op": "replace", "path": "/spec/holderIdentity", "value": "b"},
                {"op": "remove", "path": "/metadata/annotations/a~1b"},
                {"op": "add", "path": "/spec/list/-", "value": 3},
                {"op": "copy", "from": "/spec/holderIdentity", "path": "/spec/copied"},
            ]),
        )
        .expect("applied");
        assert_eq!(patched["spec"]["holderIdentity"], "b");
        assert_eq!(patched["metadata"]["annotations"], json!({}));
        assert_eq!(patched["spec"]["list"], json!([1, 2, 3]));
        assert_eq!(patched["spec"]["copied"], "b");
        let stale = json!([{"op": "test", "path": "/metadata/resourceVersion", "value": "4"}]);
        assert!(matches!(
            json_patch(&lease, &stale),
            Err(JsonPatchError::Apply(_))
        ));
        let missing = json!([{"op": "replace", "path": "/spec/nothing", "value": 1}]);
        assert!(matches!(
            json_patch(&lease, &missing),
            Err(JsonPatchError::Apply(_))
        ));
        assert!(matches!(
            json_patch(&lease, &json!({"op": "add"})),
            Err(JsonPatchError::Decode(_))
        ));
    }
}
