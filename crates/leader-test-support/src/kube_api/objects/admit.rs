//! What the registry does to a Lease or a LeaseCandidate before it stores it: decoding, field
//! validation, defaults and the strategy's rules.

use serde_json::{Value, json};

use super::Resource;
use crate::kube_api::pods;
use crate::kube_api::validation::{Refusal, is_dns_subdomain, is_qualified_name};

/// The strategies a Lease may name (`validLeaseStrategies`).
pub(super) const STRATEGIES: [&str; 1] = ["OldestEmulationVersion"];

/// The fields of `LeaseSpec` and their JSON types (`staging/src/k8s.io/api/coordination/v1/
/// types.go`).
pub(super) const LEASE_FIELDS: [(&str, Type); 7] = [
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
pub(super) const CANDIDATE_FIELDS: [(&str, Type); 6] = [
    ("leaseName", Type::String),
    ("pingTime", Type::MicroTime),
    ("renewTime", Type::MicroTime),
    ("binaryVersion", Type::String),
    ("emulationVersion", Type::String),
    ("strategy", Type::String),
];

#[derive(Clone, Copy)]
pub(super) enum Type {
    String,
    Int32,
    MicroTime,
}

/// Decodes an object's spec as the handler does before the registry sees it
/// (`staging/src/k8s.io/apimachinery/pkg/runtime/serializer/json`): a field of the wrong JSON
/// type is 400 `BadRequest`; fields the spec does not have are dropped (the server's default
/// field validation, `Warn`, drops them and warns); `MicroTime`s
/// (`staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/micro_time.go`) are stored and returned as
/// RFC 3339 UTC with exactly six fractional digits, whatever precision or offset was sent.
pub(crate) fn decode(resource: Resource, object: &mut Value) -> Result<(), Refusal> {
    match resource {
        Resource::Lease => decode_spec(object, "LeaseSpec", &LEASE_FIELDS),
        Resource::LeaseCandidate => decode_spec(object, "LeaseCandidateSpec", &CANDIDATE_FIELDS),
        Resource::Pod => pods::decode(object),
    }
}

/// What the registry does to a decoded object before it stores it, or why it refuses it; `old`
/// is the object an update replaces, `gate_on` the `CoordinatedLeaderElection` feature gate.
///
/// - The Lease strategy's `PrepareForCreate` / `PrepareForUpdate`
///   (`pkg/registry/coordination/lease/strategy.go`): with the gate off, the default,
///   `spec.strategy` and `spec.preferredHolder` are dropped, on an update unless the stored
///   Lease already has them (each field on its own). This runs before validation, so a
///   `preferredHolder` without `strategy` is dropped, not refused.
/// - Validation (`pkg/apis/coordination/validation/validation.go`), answered 422 `Invalid`:
///   the name (`ValidateObjectMeta`), then [`validate_lease`] or [`validate_candidate`].
pub(crate) fn admit(
    resource: Resource,
    object: &mut Value,
    name: &str,
    old: Option<&Value>,
    gate_on: bool,
) -> Result<(), Refusal> {
    let errors = match resource {
        Resource::Lease => {
            if !gate_on && let Some(spec) = object["spec"].as_object_mut() {
                for field in ["strategy", "preferredHolder"] {
                    if old.is_none_or(|old| old["spec"].get(field).is_none_or(Value::is_null)) {
                        spec.remove(field);
                    }
                }
            }
            if !is_dns_subdomain(name) {
                return Err(Refusal::Invalid(format!(
                    "metadata.name: Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
                )));
            }
            validate_lease(&object["spec"])
        }
        Resource::LeaseCandidate => {
            if !is_config_map_key(name) {
                return Err(Refusal::Invalid(format!(
                    "metadata.name: Invalid value: {name:?}: a valid config key must consist of alphanumeric characters, '-', '_' or '.'"
                )));
            }
            validate_candidate(&object["spec"], old.map(|old| &old["spec"]))
        }
        Resource::Pod => pods::admit(object, name, old),
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
pub(super) fn decode_spec(
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
/// `leaseTransitions` at least 0; `strategy`, when set, passes [`strategy_errors`]; a non-empty
/// `preferredHolder` needs a `strategy`.
pub(super) fn validate_lease(spec: &Value) -> Vec<String> {
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
    if let Some(strategy) = spec["strategy"].as_str() {
        errors.extend(strategy_errors(strategy));
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
/// `leaseName` is required and immutable; `binaryVersion` is always required and, like a set
/// `emulationVersion`, a semantic version (`semver.Parse`), the binary's not older than the
/// emulated one; `strategy` is required and passes [`strategy_errors`]; under
/// `OldestEmulationVersion` the emulation version must not be zero (`ev.EQ(zeroVersion)`: empty,
/// unparsable and `0.0.0` alike).
pub(super) fn validate_candidate(spec: &Value, old: Option<&Value>) -> Vec<String> {
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
    if text("binaryVersion").is_empty() {
        errors.push("spec.binaryVersion: Required value".to_owned());
    }
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
    } else {
        if strategy == STRATEGIES[0] && emulation.is_none_or(|v| v == SemVer::zero()) {
            errors.push("spec.emulationVersion: Required value: must be specified when `strategy` is 'OldestEmulationVersion'".to_owned());
        }
        errors.extend(strategy_errors(strategy));
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

/// `ValidateCoordinatedLeaseStrategy`: without a `/`, one of the strategies Kubernetes defines;
/// with one or more, a qualified name (`IsQualifiedName`).
pub(super) fn strategy_errors(strategy: &str) -> Vec<String> {
    if !strategy.contains('/') {
        if STRATEGIES.contains(&strategy) {
            return Vec::new();
        }
        return vec![format!(
            "spec.strategy.strategy: Unsupported value: {strategy:?}: supported values: \"OldestEmulationVersion\""
        )];
    }
    if is_qualified_name(strategy) {
        Vec::new()
    } else {
        vec![format!(
            "spec.strategy: Invalid value: {strategy:?}: a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character, with an optional DNS subdomain prefix and '/'"
        )]
    }
}

/// A semantic version as kube-apiserver's `blang/semver` reads and orders it:
/// [`SemVer::parse`] is strict (`semver.Parse`, used by validation: `MAJOR.MINOR.PATCH`, no
/// leading zeros, an optional pre-release and build metadata); [`SemVer::parse_tolerant`] is
/// `semver.ParseTolerant` (used by the coordinator: spaces trimmed, a leading `v` dropped,
/// leading zeros removed, a missing patch, or minor and patch, filled with 0). Versions compare
/// by precedence: numbers, then pre-release identifiers (numeric ones by value and before
/// alphanumeric ones, which compare as text; a release after its pre-releases); build metadata
/// does not count.
#[derive(Clone, Debug)]
pub(crate) struct SemVer(semver::Version);

impl SemVer {
    pub(crate) fn parse(text: &str) -> Option<Self> {
        semver::Version::parse(text).ok().map(Self)
    }

    fn zero() -> Self {
        Self(semver::Version::new(0, 0, 0))
    }

    pub(crate) fn parse_tolerant(text: &str) -> Option<Self> {
        let text = text.trim();
        let text = text.strip_prefix('v').unwrap_or(text);
        let mut parts: Vec<String> = text.splitn(3, '.').map(str::to_owned).collect();
        for part in &mut parts {
            if part.len() > 1 {
                let trimmed = part.trim_start_matches('0');
                *part = if trimmed.starts_with(|c: char| c.is_ascii_digit()) {
                    trimmed.to_owned()
                } else {
                    format!("0{trimmed}")
                };
            }
        }
        if parts.len() < 3 {
            if parts.last().is_some_and(|p| p.contains(['+', '-'])) {
                return None;
            }
            parts.resize(3, "0".to_owned());
        }
        Self::parse(&parts.join("."))
    }
}

impl PartialEq for SemVer {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for SemVer {}

impl PartialOrd for SemVer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for SemVer {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.cmp_precedence(&other.0)
    }
}

/// `IsConfigMapKey`: at most 253 characters of letters, digits, `-`, `_` and `.`, and neither
/// `.` nor `..`.
pub(super) fn is_config_map_key(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name != "."
        && name != ".."
}
