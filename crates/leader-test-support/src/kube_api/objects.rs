//! The stored objects, their `resourceVersion`s and history, and what the registry does to a
//! Lease before it stores it (validation, defaults, time normalisation).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;

use serde_json::{Value, json};

/// Changes kept for watches from a `resourceVersion` (the watch cache keeps a window too).
const HISTORY: usize = 1000;

/// `(namespace, name)`.
pub(crate) type Key = (String, String);

/// One change, as a watch sends it.
#[derive(Clone, Debug)]
pub(crate) struct Change {
    pub(crate) revision: u64,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub(crate) kind: &'static str,
    pub(crate) object: Value,
}

/// Every stored object, under one revision counter as etcd keeps them.
#[derive(Debug, Default)]
pub(crate) struct Objects {
    pub(crate) revision: u64,
    pub(crate) leases: BTreeMap<Key, Value>,
    pub(crate) history: VecDeque<Change>,
}

impl Objects {
    /// Reads what [`Objects::save`] wrote; nothing if there is no file yet.
    pub(crate) fn load(path: &Path) -> std::io::Result<Self> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(err) => return Err(err),
        };
        let saved: Value = serde_json::from_str(&text).map_err(std::io::Error::other)?;
        let mut objects = Self {
            revision: saved["revision"].as_u64().unwrap_or(0),
            ..Self::default()
        };
        for lease in saved["leases"].as_array().into_iter().flatten() {
            let key = key_of(lease);
            objects.leases.insert(key, lease.clone());
        }
        Ok(objects)
    }

    /// Writes the objects and the revision (not the history: after a restart, the watch cache
    /// starts again from the current revision) to `path`, atomically.
    pub(crate) fn save(&self, path: &Path) -> std::io::Result<()> {
        let saved = json!({"revision": self.revision,
                           "leases": self.leases.values().collect::<Vec<_>>()});
        let temporary = path.with_extension("tmp");
        std::fs::write(&temporary, saved.to_string())?;
        std::fs::rename(temporary, path)
    }

    /// Stores `object` under `key` with a new `resourceVersion` (keeping `uid` and
    /// `creationTimestamp` of the object it replaces, or giving new ones), records the change,
    /// and returns it.
    pub(crate) fn store(&mut self, key: &Key, mut object: Value) -> Change {
        self.revision += 1;
        let previous = self.leases.get(key);
        object["apiVersion"] = json!(LEASE_API_VERSION);
        object["kind"] = json!("Lease");
        object["metadata"]["name"] = json!(key.1);
        object["metadata"]["namespace"] = json!(key.0);
        object["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        let kind = match previous {
            Some(previous) => {
                object["metadata"]["uid"] = previous["metadata"]["uid"].clone();
                object["metadata"]["creationTimestamp"] =
                    previous["metadata"]["creationTimestamp"].clone();
                "MODIFIED"
            }
            None => {
                object["metadata"]["uid"] = json!(uid(self.revision));
                object["metadata"]["creationTimestamp"] =
                    json!(chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string());
                "ADDED"
            }
        };
        self.leases.insert(key.clone(), object.clone());
        self.record(kind, object)
    }

    /// Removes the object under `key`, recording a `DELETED` change with a new revision.
    pub(crate) fn remove(&mut self, key: &Key) -> Option<(Value, Change)> {
        let removed = self.leases.remove(key)?;
        self.revision += 1;
        let mut deleted = removed.clone();
        deleted["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        Some((removed, self.record("DELETED", deleted)))
    }

    fn record(&mut self, kind: &'static str, object: Value) -> Change {
        let change = Change {
            revision: self.revision,
            kind,
            object,
        };
        self.history.push_back(change.clone());
        if self.history.len() > HISTORY {
            self.history.pop_front();
        }
        change
    }

    /// The oldest revision a watch can start after; older ones are 410 Gone.
    pub(crate) fn oldest_watchable(&self) -> u64 {
        self.history
            .front()
            .map_or(self.revision, |c| c.revision.saturating_sub(1))
    }
}

/// The `apiVersion` of Leases.
pub(crate) const LEASE_API_VERSION: &str = "coordination.k8s.io/v1";

/// A uid in the form the API server gives (RFC 4122 text), unique within a server's life.
fn uid(revision: u64) -> String {
    let random = fastrand::u64(..);
    format!(
        "{:08x}-{:04x}-4{:03x}-a{:03x}-{:012x}",
        (random >> 32) as u32,
        (random >> 16) as u16,
        (random & 0xfff) as u16,
        (revision & 0xfff) as u16,
        revision
    )
}

/// The key of a stored object.
pub(crate) fn key_of(object: &Value) -> Key {
    (
        object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

/// The strategies a Lease may name (`validLeaseStrategies`).
const STRATEGIES: [&str; 1] = ["OldestEmulationVersion"];

/// The fields of `LeaseSpec` and their JSON types (`staging/src/k8s.io/api/coordination/v1/
/// types.go`).
const SPEC_FIELDS: [(&str, Type); 7] = [
    ("holderIdentity", Type::String),
    ("leaseDurationSeconds", Type::Int32),
    ("acquireTime", Type::MicroTime),
    ("renewTime", Type::MicroTime),
    ("leaseTransitions", Type::Int32),
    ("strategy", Type::String),
    ("preferredHolder", Type::String),
];

#[derive(Clone, Copy)]
enum Type {
    String,
    Int32,
    MicroTime,
}

/// Prepares a Lease as the registry does before it stores one, or says why it is refused.
///
/// - Decoding (`staging/src/k8s.io/apimachinery/pkg/runtime/serializer/json`): a field of the
///   wrong JSON type is 400 `BadRequest`; fields `LeaseSpec` does not have are dropped (the
///   server's default field validation, `Warn`, drops them and warns).
/// - Validation (`pkg/apis/coordination/validation/validation.go`, `ValidateLease`): the name
///   is a DNS subdomain; a set `leaseDurationSeconds` is greater than 0 and a set
///   `leaseTransitions` at least 0; `strategy`, when set, is `OldestEmulationVersion` or a
///   qualified name with a `/`; a non-empty `preferredHolder` needs a `strategy`. Answered 422
///   `Invalid`.
/// - `MicroTime` (`staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/micro_time.go`) is stored
///   and returned as RFC 3339 UTC with exactly six fractional digits, whatever precision or
///   offset the client sent.
pub(crate) fn admit(lease: &mut Value, name: &str) -> Result<(), Refusal> {
    if !is_dns_subdomain(name) {
        return Err(Refusal::Invalid(format!(
            "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        )));
    }
    match lease.get("spec") {
        // `Spec` is a struct, not a pointer: a Lease without one has an empty one.
        None | Some(Value::Null) => lease["spec"] = json!({}),
        Some(Value::Object(_)) => {}
        Some(_) => {
            return Err(Refusal::BadRequest(
                "json: cannot unmarshal into Go struct field Lease.spec of type v1.LeaseSpec"
                    .into(),
            ));
        }
    }
    if let Some(spec) = lease["spec"].as_object_mut() {
        spec.retain(|key, value| {
            !value.is_null() && SPEC_FIELDS.iter().any(|(field, _)| field == key)
        });
        for (field, kind) in SPEC_FIELDS {
            let Some(value) = spec.get_mut(field) else {
                continue;
            };
            let ok = match kind {
                Type::String => value.is_string(),
                Type::Int32 => value.as_i64().is_some_and(|v| i32::try_from(v).is_ok()),
                Type::MicroTime => match value.as_str().map(chrono::DateTime::parse_from_rfc3339) {
                    Some(Ok(time)) => {
                        *value = json!(
                            time.with_timezone(&chrono::Utc)
                                .format("%Y-%m-%dT%H:%M:%S%.6fZ")
                                .to_string()
                        );
                        true
                    }
                    _ => false,
                },
            };
            if !ok {
                return Err(Refusal::BadRequest(format!(
                    "json: cannot unmarshal {value} into Go struct field LeaseSpec.spec.{field}"
                )));
            }
        }
    }
    let spec = &lease["spec"];
    let mut errors = Vec::new();
    if let Some(seconds) = spec["leaseDurationSeconds"].as_i64()
        && seconds <= 0
    {
        errors.push(format!(
            "spec.leaseDurationSeconds: Invalid value: {seconds}: must be greater than 0"
        ));
    }
    if let Some(transitions) = spec["leaseTransitions"].as_i64()
        && transitions < 0
    {
        errors.push(format!(
            "spec.leaseTransitions: Invalid value: {transitions}: must be greater than or equal to 0"
        ));
    }
    if let Some(strategy) = spec["strategy"].as_str()
        && !valid_strategy(strategy)
    {
        errors.push(format!(
            "spec.strategy.strategy: Unsupported value: {strategy:?}: supported values: \"OldestEmulationVersion\""
        ));
    }
    if spec["preferredHolder"]
        .as_str()
        .is_some_and(|h| !h.is_empty())
        && spec["strategy"].as_str().is_none_or(str::is_empty)
    {
        errors.push(
            "spec.preferredHolder: Forbidden: may only be specified if `strategy` is defined"
                .into(),
        );
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(Refusal::Invalid(errors.join(", ")))
    }
}

fn valid_strategy(strategy: &str) -> bool {
    match strategy.split_once('/') {
        None => STRATEGIES.contains(&strategy),
        Some((prefix, name)) => {
            is_dns_subdomain(prefix)
                && !name.is_empty()
                && name.len() <= 63
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        }
    }
}

/// `IsDNS1123Subdomain`: at most 253 characters of lower-case letters, digits, `-` and `.`,
/// starting and ending with a letter or digit.
pub(crate) fn is_dns_subdomain(name: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !name.is_empty()
        && name.len() <= 253
        && name.chars().all(|c| alnum(c) || c == '-' || c == '.')
        && name.starts_with(alnum)
        && name.ends_with(alnum)
}

/// Why a write is refused before it reaches the store.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// 400 `BadRequest`: the body does not decode as a Lease.
    BadRequest(String),
    /// 422 `Invalid`: it decodes and fails validation.
    Invalid(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_follows_the_lease_validation() {
        let admit_spec = |spec: Value| admit(&mut json!({"spec": spec}), "l");
        assert!(admit_spec(json!({"holderIdentity": "a", "leaseDurationSeconds": 1})).is_ok());
        assert!(matches!(
            admit_spec(json!({"leaseDurationSeconds": 0})),
            Err(Refusal::Invalid(_))
        ));
        assert!(matches!(
            admit_spec(json!({"leaseTransitions": -1})),
            Err(Refusal::Invalid(_))
        ));
        assert!(matches!(
            admit_spec(json!({"preferredHolder": "b"})),
            Err(Refusal::Invalid(_))
        ));
        assert!(admit_spec(json!({"preferredHolder": ""})).is_ok());
        assert!(
            admit_spec(json!({"strategy": "OldestEmulationVersion", "preferredHolder": "b"}))
                .is_ok()
        );
        assert!(admit_spec(json!({"strategy": "example.com/mine"})).is_ok());
        assert!(matches!(
            admit_spec(json!({"strategy": "Newest"})),
            Err(Refusal::Invalid(_))
        ));
        assert!(matches!(
            admit_spec(json!({"holderIdentity": 5})),
            Err(Refusal::BadRequest(_))
        ));
        assert!(matches!(
            admit_spec(json!({"leaseDurationSeconds": 3_000_000_000_i64})),
            Err(Refusal::BadRequest(_))
        ));
        assert!(matches!(
            admit(&mut json!({"spec": {}}), "Not_A_Name"),
            Err(Refusal::Invalid(_))
        ));
    }

    #[test]
    fn a_lease_without_a_spec_has_an_empty_one() {
        let mut lease = json!({"metadata": {"name": "l"}});
        admit(&mut lease, "l").expect("admitted");
        assert_eq!(lease["spec"], json!({}));
    }

    #[test]
    fn unknown_fields_are_dropped_and_times_normalised() {
        let mut lease = json!({"spec": {"holderIdentity": "a", "bogus": 1,
            "renewTime": "2026-11-21T10:00:00.5+01:00"}});
        admit(&mut lease, "l").expect("admitted");
        assert!(lease["spec"].get("bogus").is_none());
        assert_eq!(lease["spec"]["renewTime"], "2026-11-21T09:00:00.500000Z");
    }

    #[test]
    fn objects_survive_a_save_and_load_with_their_revision() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.json");
        let mut objects = Objects::default();
        objects.store(
            &("default".into(), "l".into()),
            json!({"metadata": {}, "spec": {"holderIdentity": "a"}}),
        );
        objects.save(&path).expect("save");
        let loaded = Objects::load(&path).expect("load");
        assert_eq!(loaded.revision, 1);
        assert_eq!(
            loaded.leases[&("default".into(), "l".into())]["spec"]["holderIdentity"],
            "a"
        );
        assert!(loaded.history.is_empty());
        assert_eq!(loaded.oldest_watchable(), 1);
    }
}
