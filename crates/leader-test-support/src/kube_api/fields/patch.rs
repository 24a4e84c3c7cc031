//! The patch forms a Lease client sends: RFC 7386 merge patch, strategic merge patch and RFC
//! 6902 JSON patch.

use serde_json::Value;

/// RFC 7386 JSON merge patch: objects merge key by key, `null` removes, anything else replaces.
/// An object patched onto what is not one (a map the object lacks) patches an empty object, so
/// a `null` in it removes nothing and is not stored.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(serde_json::Map::new());
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

/// A strategic merge patch on a Lease (`staging/src/k8s.io/apimachinery/pkg/util/
/// strategicpatch`): as a merge patch, except for the lists the schema marks
/// `patchStrategy: merge`: `metadata.ownerReferences` merges by `uid` (an element with
/// `"$patch": "delete"` removes that reference) and `metadata.finalizers` is a union.
pub(crate) fn strategic_merge_patch(target: &mut Value, patch: &Value) {
    let mut patch = patch.clone();
    // `get_mut`, not indexing, which would add `"metadata": null` to the patch.
    let metadata = patch.get_mut("metadata").and_then(Value::as_object_mut);
    let (references, finalizers) = match metadata {
        Some(metadata) => (
            metadata.remove("ownerReferences"),
            metadata.remove("finalizers"),
        ),
        None => (None, None),
    };
    merge_patch(target, &patch);
    if let Some(Value::Array(items)) = references {
        let current = metadata_list(target, "ownerReferences");
        for item in items {
            let uid = item["uid"].clone();
            let position = current.iter().position(|c| c["uid"] == uid);
            match (item["$patch"].as_str(), position) {
                (Some("delete"), Some(at)) => {
                    current.remove(at);
                }
                (Some("delete"), None) => {}
                (_, Some(at)) => merge_patch(&mut current[at], &item),
                (_, None) => current.push(item),
            }
        }
    }
    if let Some(Value::Array(items)) = finalizers {
        let current = metadata_list(target, "finalizers");
        for item in items {
            if !current.contains(&item) {
                current.push(item);
            }
        }
    }
}

/// The list at `metadata.{field}` of `target`, an empty one put there when it has none.
fn metadata_list<'a>(target: &'a mut Value, field: &str) -> &'a mut Vec<Value> {
    let list = &mut target["metadata"][field];
    if !list.is_array() {
        *list = Value::Array(Vec::new());
    }
    list.as_array_mut().expect("made a list above")
}

/// Why a JSON patch was not applied.
#[derive(Debug)]
pub(crate) enum JsonPatchError {
    /// The body is not a list of operations (400 `BadRequest`).
    Decode(String),
    /// An operation failed on the object (422).
    Apply(String),
}

/// RFC 6902 JSON patch (`application/json-patch+json`, applied with `evanphx/json-patch` by
/// `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go` `applyJSPatch`): `add`,
/// `remove`, `replace`, `move`, `copy` and `test`, in order, on a copy of `target`, with RFC
/// 6901 pointers (`~1` for `/`, `~0` for `~`; `-` appends to an array). Any failing operation
/// fails the whole patch.
pub(crate) fn json_patch(target: &Value, patch: &Value) -> Result<Value, JsonPatchError> {
    let decode = |message: &str| JsonPatchError::Decode(message.to_owned());
    let operations = patch
        .as_array()
        .ok_or_else(|| decode("a JSON patch is a list of operations"))?;
    let mut object = target.clone();
    for operation in operations {
        let op = operation["op"]
            .as_str()
            .ok_or_else(|| decode("an operation without \"op\""))?;
        let path =
            pointer(&operation["path"]).ok_or_else(|| decode("a missing or bad \"path\""))?;
        let value = || {
            operation
                .get("value")
                .cloned()
                .ok_or_else(|| decode("an operation without \"value\""))
        };
        let from =
            || pointer(&operation["from"]).ok_or_else(|| decode("a missing or bad \"from\""));
        let failed =
            |what: &str| JsonPatchError::Apply(format!("{op} {}: {what}", operation["path"]));
        match op {
            "add" => add_at(&mut object, &path, value()?).ok_or_else(|| failed("no parent"))?,
            "remove" => {
                take_at(&mut object, &path).ok_or_else(|| failed("no such path"))?;
            }
            "replace" => {
                take_at(&mut object, &path).ok_or_else(|| failed("no such path"))?;
                add_at(&mut object, &path, value()?).ok_or_else(|| failed("no parent"))?;
            }
            "move" => {
                let moved = take_at(&mut object, &from()?).ok_or_else(|| failed("no such from"))?;
                add_at(&mut object, &path, moved).ok_or_else(|| failed("no parent"))?;
            }
            "copy" => {
                let copied = get_at(&object, &from()?)
                    .cloned()
                    .ok_or_else(|| failed("no such from"))?;
                add_at(&mut object, &path, copied).ok_or_else(|| failed("no parent"))?;
            }
            "test" => {
                if get_at(&object, &path) != Some(&value()?) {
                    return Err(failed("testing value failed"));
                }
            }
            other => return Err(decode(&format!("unknown operation {other:?}"))),
        }
    }
    Ok(object)
}

/// The reference tokens of an RFC 6901 pointer, or `None` if it is not one.
pub(super) fn pointer(value: &Value) -> Option<Vec<String>> {
    let text = value.as_str()?;
    if text.is_empty() {
        return Some(Vec::new());
    }
    let rest = text.strip_prefix('/')?;
    Some(
        rest.split('/')
            .map(|token| token.replace("~1", "/").replace("~0", "~"))
            .collect(),
    )
}

pub(super) fn get_at<'a>(object: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(object, |value, token| match value {
        Value::Object(map) => map.get(token),
        Value::Array(items) => items.get(token.parse::<usize>().ok()?),
        _ => None,
    })
}

/// Adds `value` at `path` (RFC 6902 `add`): an object member is set, an array element inserted.
pub(super) fn add_at(object: &mut Value, path: &[String], value: Value) -> Option<()> {
    let Some((last, parent)) = path.split_last() else {
        *object = value;
        return Some(());
    };
    match parent_at(object, parent)? {
        Value::Object(map) => {
            map.insert(last.clone(), value);
        }
        Value::Array(items) => {
            let at = if last == "-" {
                items.len()
            } else {
                last.parse::<usize>().ok().filter(|at| *at <= items.len())?
            };
            items.insert(at, value);
        }
        _ => return None,
    }
    Some(())
}

/// Removes and returns what is at `path`.
pub(super) fn take_at(object: &mut Value, path: &[String]) -> Option<Value> {
    let (last, parent) = path.split_last()?;
    match parent_at(object, parent)? {
        Value::Object(map) => map.remove(last),
        Value::Array(items) => {
            let at = last.parse::<usize>().ok().filter(|at| *at < items.len())?;
            Some(items.remove(at))
        }
        _ => None,
    }
}

pub(super) fn parent_at<'a>(object: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    path.iter().try_fold(object, |value, token| match value {
        Value::Object(map) => map.get_mut(token),
        Value::Array(items) => items.get_mut(token.parse::<usize>().ok()?),
        _ => None,
    })
}
