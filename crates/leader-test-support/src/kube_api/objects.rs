//! The stored objects, their `resourceVersion`s and history, and what the registry does to a
//! Lease or a LeaseCandidate before it stores it (validation, defaults, time normalisation).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;

use serde_json::{Value, json};

/// Changes kept for watches from a `resourceVersion` (the watch cache keeps a window too).
const HISTORY: usize = 1000;

/// The kinds of object the server keeps, both in the `coordination.k8s.io` group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Resource {
    /// `coordination.k8s.io/v1` Lease.
    Lease,
    /// `coordination.k8s.io/v1beta1` LeaseCandidate (coordinated leader election).
    LeaseCandidate,
}

impl Resource {
    /// The resource a URL's group version and plural name, such as `v1` and `leases`, serve.
    pub(crate) fn of_path(version: &str, plural: &str) -> Option<Self> {
        match (version, plural) {
            ("v1", "leases") => Some(Self::Lease),
            ("v1beta1", "leasecandidates") => Some(Self::LeaseCandidate),
            _ => None,
        }
    }

    pub(crate) fn api_version(self) -> &'static str {
        match self {
            Self::Lease => "coordination.k8s.io/v1",
            Self::LeaseCandidate => "coordination.k8s.io/v1beta1",
        }
    }

    pub(crate) fn kind(self) -> &'static str {
        match self {
            Self::Lease => "Lease",
            Self::LeaseCandidate => "LeaseCandidate",
        }
    }

    pub(crate) fn plural(self) -> &'static str {
        match self {
            Self::Lease => "leases",
            Self::LeaseCandidate => "leasecandidates",
        }
    }

    fn of_kind(kind: &str) -> Self {
        if kind == "LeaseCandidate" {
            Self::LeaseCandidate
        } else {
            Self::Lease
        }
    }
}

/// `(resource, namespace, name)`.
pub(crate) type Key = (Resource, String, String);

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
    pub(crate) items: BTreeMap<Key, Value>,
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
        for object in saved["objects"].as_array().into_iter().flatten() {
            objects.items.insert(key_of(object), object.clone());
        }
        Ok(objects)
    }

    /// Writes the objects and the revision (not the history: after a restart, the watch cache
    /// starts again from the current revision) to `path`, atomically.
    pub(crate) fn save(&self, path: &Path) -> std::io::Result<()> {
        let saved = json!({"revision": self.revision,
                           "objects": self.items.values().collect::<Vec<_>>()});
        let temporary = path.with_extension("tmp");
        std::fs::write(&temporary, saved.to_string())?;
        std::fs::rename(temporary, path)
    }

    /// Stores `object` under `key` with a new `resourceVersion` (keeping `uid` and
    /// `creationTimestamp` of the object it replaces, or giving new ones), records the change,
    /// and returns it.
    pub(crate) fn store(&mut self, key: &Key, mut object: Value) -> Change {
        self.revision += 1;
        let previous = self.items.get(key);
        object["apiVersion"] = json!(key.0.api_version());
        object["kind"] = json!(key.0.kind());
        object["metadata"]["name"] = json!(key.2);
        object["metadata"]["namespace"] = json!(key.1);
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
        self.items.insert(key.clone(), object.clone());
        self.record(kind, object)
    }

    /// Removes the object under `key`, recording a `DELETED` change with a new revision.
    pub(crate) fn remove(&mut self, key: &Key) -> Option<(Value, Change)> {
        let removed = self.items.remove(key)?;
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
        Resource::of_kind(object["kind"].as_str().unwrap_or_default()),
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
const LEASE_FIELDS: [(&str, Type); 7] = [
    ("holderIdentity", Type::String),
    ("leaseDurationSeconds", Type::Int32),
    ("acquireTime", Type::MicroTime),
    ("renewTime", Type::MicroTime),
    ("leaseTransitions", Type::Int32),
    ("strategy", Type::String),
    ("preferredHolder", Type::String),
];

/// The fields of `LeaseCandidateSpec` and their JSON types (`staging/src/k8s.io/api/
/// coordination/v1beta1/types.go`).
const CANDIDATE_FIELDS: [(&str, Type); 6] = [
    ("leaseName", Type::String),
    ("pingTime", Type::MicroTime),
    ("renewTime", Type::MicroTime),
    ("binaryVersion", Type::String),
    ("emulationVersion", Type::String),
    ("strategy", Type::String),
];

#[derive(Clone, Copy)]
enum Type {
    String,
    Int32,
    MicroTime,
}

/// Prepares an object as the registry does before it stores one, or says why it is refused;
/// `old` is the object an update replaces.
///
/// - Decoding (`staging/src/k8s.io/apimachinery/pkg/runtime/serializer/json`): a field of the
///   wrong JSON type is 400 `BadRequest`; fields the spec does not have are dropped (the
///   server's default field validation, `Warn`, drops them and warns).
/// - `MicroTime` (`staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/micro_time.go`) is stored
///   and returned as RFC 3339 UTC with exactly six fractional digits, whatever precision or
///   offset the client sent.
/// - Validation (`pkg/apis/coordination/validation/validation.go`), answered 422 `Invalid`:
///   see [`validate_lease`] and [`validate_candidate`].
pub(crate) fn admit(
    resource: Resource,
    object: &mut Value,
    name: &str,
    old: Option<&Value>,
) -> Result<(), Refusal> {
    let errors = match resource {
        Resource::Lease => {
            if !is_dns_subdomain(name) {
                return Err(Refusal::Invalid(format!(
                    "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
                )));
            }
            decode_spec(object, "LeaseSpec", &LEASE_FIELDS)?;
            validate_lease(&object["spec"])
        }
        Resource::LeaseCandidate => {
            if !is_config_map_key(name) {
                return Err(Refusal::Invalid(format!(
                    "metadata.name: Invalid value: {name:?}: a valid config key must consist of alphanumeric characters, '-', '_' or '.'"
                )));
            }
            decode_spec(object, "LeaseCandidateSpec", &CANDIDATE_FIELDS)?;
            validate_candidate(&object["spec"], old.map(|old| &old["spec"]))
        }
    };
    if errors.is_empty() {
        Ok(())
    } else {
        Err(Refusal::Invalid(errors.join(", ")))
    }
}

/// Decodes `object`'s spec as a Go struct with `fields`: a missing spec is an empty one (`Spec`
/// is a struct, not a pointer), unknown fields are dropped, a wrong type is refused, times are
/// normalised.
fn decode_spec(
    object: &mut Value,
    type_name: &str,
    fields: &[(&str, Type)],
) -> Result<(), Refusal> {
    match object.get("spec") {
        None | Some(Value::Null) => object["spec"] = json!({}),
        Some(Value::Object(_)) => {}
        Some(_) => {
            return Err(Refusal::BadRequest(format!(
                "json: cannot unmarshal into Go struct field .spec of type {type_name}"
            )));
        }
    }
    let Some(spec) = object["spec"].as_object_mut() else {
        return Ok(());
    };
    spec.retain(|key, value| !value.is_null() && fields.iter().any(|(field, _)| field == key));
    for &(field, kind) in fields {
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
                "json: cannot unmarshal {value} into Go struct field {type_name}.spec.{field}"
            )));
        }
    }
    Ok(())
}

/// `ValidateLeaseSpec`: a set `leaseDurationSeconds` is greater than 0 and a set
/// `leaseTransitions` at least 0; `strategy`, when set, is `OldestEmulationVersion` or a
/// qualified name with a `/`; a non-empty `preferredHolder` needs a `strategy`.
fn validate_lease(spec: &Value) -> Vec<String> {
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
    errors
}

/// `ValidateLeaseCandidateSpec` and, on an update, `ValidateLeaseCandidateSpecUpdate`:
/// `leaseName` is required and immutable; `binaryVersion` and `emulationVersion`, when set, are
/// semantic versions, the binary's not older than the emulated one; `strategy` is required and
/// valid, and `OldestEmulationVersion` needs both versions.
fn validate_candidate(spec: &Value, old: Option<&Value>) -> Vec<String> {
    let mut errors = Vec::new();
    let text = |field: &str| spec[field].as_str().unwrap_or_default();
    if text("leaseName").is_empty() {
        errors.push("spec.leaseName: Required value".to_owned());
    }
    let mut version = |field: &str| {
        let value = text(field);
        if value.is_empty() {
            return None;
        }
        let parsed = SemVer::parse(value);
        if parsed.is_none() {
            errors.push(format!(
                "spec.{field}: Invalid value: {value:?}: must be a valid semantic version"
            ));
        }
        parsed
    };
    let emulation = version("emulationVersion");
    let binary = version("binaryVersion");
    if let (Some(binary), Some(emulation)) = (&binary, &emulation)
        && binary < emulation
    {
        errors.push(format!(
            "spec.binaryVersion: Invalid value: {:?}: must be greater than or equal to `emulationVersion`",
            text("binaryVersion")
        ));
    }
    let strategy = text("strategy");
    if strategy.is_empty() {
        errors.push("spec.strategy: Required value".to_owned());
    } else if !valid_strategy(strategy) {
        errors.push(format!(
            "spec.strategy: Unsupported value: {strategy:?}: supported values: \"OldestEmulationVersion\""
        ));
    } else if strategy == STRATEGIES[0] {
        if text("binaryVersion").is_empty() {
            errors.push("spec.binaryVersion: Required value: must be specified when `strategy` is 'OldestEmulationVersion'".to_owned());
        }
        if text("emulationVersion").is_empty() {
            errors.push("spec.emulationVersion: Required value: must be specified when `strategy` is 'OldestEmulationVersion'".to_owned());
        }
    }
    if let Some(old) = old
        && old["leaseName"] != spec["leaseName"]
    {
        errors.push(format!(
            "spec.leaseName: Invalid value: {}: field is immutable",
            spec["leaseName"]
        ));
    }
    errors
}

/// A semantic version as `blang/semver` compares them: major, minor, patch, and a pre-release
/// (which sorts before the release). [`SemVer::parse`] is strict (`semver.Parse`, used by
/// validation); [`SemVer::parse_tolerant`] also takes a leading `v` and missing minor or patch
/// (`semver.ParseTolerant`, used by the coordinator).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SemVer {
    numbers: [u64; 3],
    pre_release: Option<String>,
}

impl SemVer {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let (core, pre_release) = match text.split_once('-') {
            Some((core, pre)) => (core, Some(pre.to_owned())),
            None => (text.split('+').next().unwrap_or(text), None),
        };
        let parts: Vec<&str> = core.split('.').collect();
        if parts.len() != 3 {
            return None;
        }
        let mut numbers = [0; 3];
        for (number, part) in numbers.iter_mut().zip(parts) {
            if part.is_empty() || (part.len() > 1 && part.starts_with('0')) {
                return None;
            }
            *number = part.parse().ok()?;
        }
        Some(Self {
            numbers,
            pre_release: pre_release.filter(|p| !p.is_empty()),
        })
    }

    pub(crate) fn parse_tolerant(text: &str) -> Option<Self> {
        let text = text.trim().trim_start_matches('v');
        let (core, rest) = match text.find(['-', '+']) {
            Some(at) => text.split_at(at),
            None => (text, ""),
        };
        let mut parts: Vec<String> = core
            .split('.')
            .map(|p| {
                let trimmed = p.trim_start_matches('0');
                if trimmed.is_empty() {
                    "0".into()
                } else {
                    trimmed.into()
                }
            })
            .collect();
        while parts.len() < 3 {
            parts.push("0".into());
        }
        Self::parse(&format!("{}{rest}", parts.join(".")))
    }
}

impl PartialOrd for SemVer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for SemVer {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.numbers.cmp(&other.numbers).then_with(|| {
            match (&self.pre_release, &other.pre_release) {
                (None, None) => std::cmp::Ordering::Equal,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (Some(_), None) => std::cmp::Ordering::Less,
                (Some(a), Some(b)) => a.cmp(b),
            }
        })
    }
}

/// `IsConfigMapKey`: at most 253 characters of letters, digits, `-`, `_` and `.`, and neither
/// `.` nor `..`.
fn is_config_map_key(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name != "."
        && name != ".."
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
        let admit_spec =
            |spec: Value| admit(Resource::Lease, &mut json!({"spec": spec}), "l", None);
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
            admit(
                Resource::Lease,
                &mut json!({"spec": {}}),
                "Not_A_Name",
                None
            ),
            Err(Refusal::Invalid(_))
        ));
    }

    #[test]
    fn admission_follows_the_lease_candidate_validation() {
        let candidate = |spec: Value| {
            admit(
                Resource::LeaseCandidate,
                &mut json!({ "spec": spec }),
                "pod-1_x",
                None,
            )
        };
        let good = json!({"leaseName": "l", "binaryVersion": "1.2.3",
            "emulationVersion": "1.2.0", "strategy": "OldestEmulationVersion",
            "renewTime": "2026-11-23T10:00:00Z"});
        assert!(candidate(good.clone()).is_ok());
        for (field, value) in [
            ("leaseName", json!("")),
            ("binaryVersion", json!("1.2")),
            ("binaryVersion", json!("1.1.0")),
            ("emulationVersion", json!("")),
            ("strategy", json!("")),
            ("strategy", json!("Newest")),
        ] {
            let mut spec = good.clone();
            spec[field] = value.clone();
            assert!(
                matches!(candidate(spec), Err(Refusal::Invalid(_))),
                "{field} = {value}"
            );
        }
        let mut third_party = good.clone();
        third_party["strategy"] = json!("example.com/mine");
        third_party["emulationVersion"] = json!("");
        assert!(candidate(third_party).is_ok());
        let renamed = admit(
            Resource::LeaseCandidate,
            &mut json!({ "spec": good.clone() }),
            "pod-1",
            Some(&json!({"spec": {"leaseName": "other"}})),
        );
        assert!(matches!(renamed, Err(Refusal::Invalid(m)) if m.contains("immutable")));
        assert!(matches!(
            admit(
                Resource::LeaseCandidate,
                &mut json!({ "spec": good }),
                "a/b",
                None
            ),
            Err(Refusal::Invalid(_))
        ));
    }

    #[test]
    fn versions_compare_as_semantic_versions() {
        let strict = |t: &str| SemVer::parse(t);
        let tolerant = |t: &str| SemVer::parse_tolerant(t).expect(t);
        assert!(strict("1.2").is_none());
        assert!(strict("01.2.3").is_none());
        assert!(strict("1.2.3-rc.1") < strict("1.2.3"));
        assert!(strict("1.9.0") < strict("1.10.0"));
        assert_eq!(tolerant("v1.33"), tolerant("1.33.0"));
        assert!(tolerant("1.32.9") < tolerant("1.33"));
    }

    #[test]
    fn a_lease_without_a_spec_has_an_empty_one() {
        let mut lease = json!({"metadata": {"name": "l"}});
        admit(Resource::Lease, &mut lease, "l", None).expect("admitted");
        assert_eq!(lease["spec"], json!({}));
    }

    #[test]
    fn unknown_fields_are_dropped_and_times_normalised() {
        let mut lease = json!({"spec": {"holderIdentity": "a", "bogus": 1,
            "renewTime": "2026-11-21T10:00:00.5+01:00"}});
        admit(Resource::Lease, &mut lease, "l", None).expect("admitted");
        assert!(lease["spec"].get("bogus").is_none());
        assert_eq!(lease["spec"]["renewTime"], "2026-11-21T09:00:00.500000Z");
    }

    #[test]
    fn objects_survive_a_save_and_load_with_their_revision() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.json");
        let mut objects = Objects::default();
        objects.store(
            &(Resource::Lease, "default".into(), "l".into()),
            json!({"metadata": {}, "spec": {"holderIdentity": "a"}}),
        );
        objects.save(&path).expect("save");
        let loaded = Objects::load(&path).expect("load");
        assert_eq!(loaded.revision, 1);
        assert_eq!(
            loaded.items[&(Resource::Lease, "default".into(), "l".into())]["spec"]["holderIdentity"],
            "a"
        );
        assert!(loaded.history.is_empty());
        assert_eq!(loaded.oldest_watchable(), 1);
    }
}
