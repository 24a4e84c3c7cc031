//! core/v1 Pods, for clients that label Pods (a leader labelling its own Pod for a Service):
//! served at `/api/v1/namespaces/{ns}/pods` by the same handlers as Leases (`routes`), with
//! the Pod strategy and the validation kube-apiserver applies to what such clients write.
//!
//! - Strategy (`pkg/registry/core/pod/strategy.go`): `AllowCreateOnUpdate` is false (a PUT of a
//!   missing Pod is 404) and `AllowUnconditionalUpdate` true (a PUT without `resourceVersion`
//!   overwrites); `PrepareForCreate` sets `status` to `{"phase": "Pending"}`,
//!   `PrepareForUpdate` keeps the stored `status` whatever an update or a patch sends.
//! - Patches (`staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go`): JSON patch, merge
//!   patch and strategic merge patch, as for Leases. On `metadata.labels`, a map of strings, a
//!   merge or strategic merge patch adds or replaces each key it names and removes each key it
//!   sets to `null`; a JSON patch `remove` of a label the Pod does not carry fails (422). A
//!   `resourceVersion` in the patch is a precondition (409).
//! - Validation (`pkg/apis/core/validation/validation.go` `ValidatePodCreate`,
//!   `ValidatePodUpdate`, with `ValidateObjectMeta` and `ValidateLabels` from
//!   `staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/validation/validation.go`), 422
//!   `Invalid`: the name is a DNS subdomain; each label key a qualified name and each value a
//!   label value (at most 63 characters); each annotation key a qualified name once lower-cased
//!   (`ValidateAnnotations` in `staging/src/k8s.io/apimachinery/pkg/api/validation/
//!   objectmeta.go`; its 256 KiB limit on all annotations together is not kept); a create
//!   needs `spec.containers`; an update may not change the spec (the real server lets a few
//!   fields change: container images, `activeDeadlineSeconds`, added tolerations; label
//!   writers change none).
//! - Decoding: labels or annotations that are not strings are 400, as the JSON decoder refuses
//!   them.
//!
//! Not served: the `status`, `binding`, `eviction`, `exec` and other subresources, and graceful
//! deletion (a DELETE removes the Pod at once, as for a Pod never scheduled).

use serde_json::{Value, json};

use super::validation::{
    LABEL_VALUE, QUALIFIED_NAME, Refusal, is_dns_subdomain, is_label_value, is_qualified_name,
};

/// Decodes a Pod's metadata: labels and annotations must be maps of strings.
pub(crate) fn decode(object: &mut Value) -> Result<(), Refusal> {
    for map in ["labels", "annotations"] {
        match &object["metadata"][map] {
            Value::Null => {}
            Value::Object(entries) => {
                if let Some((key, value)) = entries.iter().find(|(_, v)| !v.is_string()) {
                    return Err(Refusal::BadRequest(format!(
                        "Pod in version \"v1\" cannot be handled as a Pod: json: cannot unmarshal {} into Go struct field ObjectMeta.metadata.{map} of type string (key {key:?})",
                        json_type(value)
                    )));
                }
            }
            other => {
                return Err(Refusal::BadRequest(format!(
                    "Pod in version \"v1\" cannot be handled as a Pod: json: cannot unmarshal {} into Go struct field ObjectMeta.metadata.{map} of type map[string]string",
                    json_type(other)
                )));
            }
        }
    }
    Ok(())
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The Pod strategy and validation for a create (`old` absent) or an update of `old`.
pub(crate) fn admit(object: &mut Value, name: &str, old: Option<&Value>) -> Vec<String> {
    let mut errors = Vec::new();
    if !is_dns_subdomain(name) {
        errors.push(format!(
            "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        ));
    }
    if let Some(labels) = object["metadata"]["labels"].as_object() {
        for (key, value) in labels {
            if !is_qualified_name(key) {
                errors.push(format!(
                    "metadata.labels: Invalid value: {key:?}: {QUALIFIED_NAME}"
                ));
            }
            let value = value.as_str().unwrap_or_default();
            if !is_label_value(value) {
                errors.push(format!(
                    "metadata.labels: Invalid value: {value:?}: {LABEL_VALUE}"
                ));
            }
        }
    }
    if let Some(annotations) = object["metadata"]["annotations"].as_object() {
        for key in annotations.keys() {
            if !is_qualified_name(&key.to_lowercase()) {
                errors.push(format!(
                    "metadata.annotations: Invalid value: {key:?}: {QUALIFIED_NAME}"
                ));
            }
        }
    }
    match old {
        None => {
            object["status"] = json!({"phase": "Pending"});
            if object["spec"]["containers"]
                .as_array()
                .is_none_or(Vec::is_empty)
            {
                errors.push("spec.containers: Required value".to_owned());
            }
        }
        Some(old) => {
            object["status"] = old["status"].clone();
            if object["spec"] != old["spec"] {
                errors.push(
                    "spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)".to_owned(),
                );
            }
        }
    }
    errors
}
