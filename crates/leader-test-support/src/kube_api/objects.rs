//! The stored objects, their `resourceVersion`s and history, and what the registry does to a
//! Lease or a LeaseCandidate before it stores it (validation, defaults, time normalisation).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;

use serde_json::{Value, json};

mod admit;

pub(crate) use admit::*;

/// Changes kept for watches from a `resourceVersion` (the watch cache keeps a window too).
const HISTORY: usize = 1000;

/// The kinds of object the server keeps: the `coordination.k8s.io` group's, and core/v1 Pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Resource {
    /// `coordination.k8s.io/v1` Lease.
    Lease,
    /// `coordination.k8s.io/v1beta1` LeaseCandidate (coordinated leader election).
    LeaseCandidate,
    /// core/v1 Pod (its metadata, for clients that label Pods; see `pods`).
    Pod,
}

impl Resource {
    /// The resource a URL's API group (`""` for the core group, under `/api`), version and
    /// plural name, such as `coordination.k8s.io`, `v1` and `leases`, serve.
    pub(crate) fn of_path(group: &str, version: &str, plural: &str) -> Option<Self> {
        match (group, version, plural) {
            ("coordination.k8s.io", "v1", "leases") => Some(Self::Lease),
            ("coordination.k8s.io", "v1beta1", "leasecandidates") => Some(Self::LeaseCandidate),
            ("", "v1", "pods") => Some(Self::Pod),
            _ => None,
        }
    }

    pub(crate) fn api_version(self) -> &'static str {
        match self {
            Self::Lease => "coordination.k8s.io/v1",
            Self::LeaseCandidate => "coordination.k8s.io/v1beta1",
            Self::Pod => "v1",
        }
    }

    pub(crate) fn kind(self) -> &'static str {
        match self {
            Self::Lease => "Lease",
            Self::LeaseCandidate => "LeaseCandidate",
            Self::Pod => "Pod",
        }
    }

    pub(crate) fn plural(self) -> &'static str {
        match self {
            Self::Lease => "leases",
            Self::LeaseCandidate => "leasecandidates",
            Self::Pod => "pods",
        }
    }

    /// The API group, `""` for the core group.
    pub(crate) fn group(self) -> &'static str {
        match self {
            Self::Lease | Self::LeaseCandidate => "coordination.k8s.io",
            Self::Pod => "",
        }
    }

    /// `what` (the plural or the kind) qualified by the group, as error messages name a
    /// resource (`GroupResource.String()`): `leases.coordination.k8s.io`, `pods`.
    pub(crate) fn qualified(self, what: &str) -> String {
        match self.group() {
            "" => what.to_owned(),
            group => format!("{what}.{group}"),
        }
    }

    /// The strategy's `AllowCreateOnUpdate`: a PUT of a missing Lease or LeaseCandidate
    /// creates it (`pkg/registry/coordination/lease/strategy.go`); one of a missing Pod is 404
    /// (`pkg/registry/core/pod/strategy.go`).
    pub(crate) fn allows_create_on_update(self) -> bool {
        self != Self::Pod
    }

    /// The strategy's `AllowUnconditionalUpdate`: a PUT without `resourceVersion` is 422 for a
    /// Lease or a LeaseCandidate, and overwrites a Pod.
    pub(crate) fn allows_unconditional_update(self) -> bool {
        self == Self::Pod
    }

    fn of_kind(kind: &str) -> Self {
        match kind {
            "LeaseCandidate" => Self::LeaseCandidate,
            "Pod" => Self::Pod,
            _ => Self::Lease,
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
    /// The object before a modification, for watches that select by label.
    pub(crate) previous: Option<Value>,
}

/// What [`Objects::store`] did.
#[derive(Clone, Debug)]
pub(crate) enum Write {
    /// The object changed: a new revision, sent to watches.
    Changed(Change),
    /// The object was already stored as written: nothing changed, nothing is sent.
    Unchanged(Value),
}

impl Write {
    /// The object as stored.
    pub(crate) fn object(&self) -> &Value {
        match self {
            Self::Changed(change) => &change.object,
            Self::Unchanged(object) => object,
        }
    }
}

impl Change {
    /// The event a watch that selects objects with `selects` sends for this change, if any, as
    /// the watch cache converts it (`staging/src/k8s.io/apiserver/pkg/storage/cacher/
    /// cache_watcher.go` `convertToWatchEvent`): a modification that brings an object into the
    /// selection is `ADDED`, one that takes it out is `DELETED` (with the object as it was).
    pub(crate) fn seen_by(
        &self,
        selects: impl Fn(&Value) -> bool,
    ) -> Option<(&'static str, Value)> {
        let now = selects(&self.object);
        let before = self.previous.as_ref().is_some_and(&selects);
        match (self.kind, before, now) {
            ("MODIFIED", false, true) => Some(("ADDED", self.object.clone())),
            ("MODIFIED", true, false) => self.previous.clone().map(|mut previous| {
                // The object as it was, with the change's resourceVersion.
                previous["metadata"]["resourceVersion"] = json!(self.revision.to_string());
                ("DELETED", previous)
            }),
            (_, _, true) => Some((self.kind, self.object.clone())),
            _ => None,
        }
    }
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
    /// and returns it. An update that leaves the object as stored is skipped, as
    /// kube-apiserver skips it: `GuaranteedUpdate` (`staging/src/k8s.io/apiserver/pkg/storage/
    /// etcd3/store.go`) compares the encoded object with the stored bytes and, when equal,
    /// answers the stored object with its `resourceVersion` unchanged, writes nothing to etcd
    /// and so sends no watch event.
    pub(crate) fn store(&mut self, key: &Key, mut object: Value) -> Write {
        let previous = self.items.get(key).cloned();
        object["apiVersion"] = json!(key.0.api_version());
        object["kind"] = json!(key.0.kind());
        object["metadata"]["name"] = json!(key.2);
        object["metadata"]["namespace"] = json!(key.1);
        if let Some(previous) = &previous {
            object["metadata"]["uid"] = previous["metadata"]["uid"].clone();
            object["metadata"]["creationTimestamp"] =
                previous["metadata"]["creationTimestamp"].clone();
            // The stored bytes carry no resourceVersion (`PrepareObjectForStorage` clears it).
            object["metadata"]["resourceVersion"] = previous["metadata"]["resourceVersion"].clone();
            if object == *previous {
                return Write::Unchanged(object);
            }
        }
        self.revision += 1;
        object["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        let kind = if previous.is_some() {
            "MODIFIED"
        } else {
            object["metadata"]["uid"] = json!(uid(self.revision));
            object["metadata"]["creationTimestamp"] =
                json!(chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string());
            "ADDED"
        };
        self.items.insert(key.clone(), object.clone());
        Write::Changed(self.record(kind, object, previous))
    }

    /// Removes the object under `key`, recording a `DELETED` change with a new revision.
    pub(crate) fn remove(&mut self, key: &Key) -> Option<(Value, Change)> {
        let removed = self.items.remove(key)?;
        self.revision += 1;
        let mut deleted = removed.clone();
        deleted["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        Some((removed, self.record("DELETED", deleted, None)))
    }

    fn record(&mut self, kind: &'static str, object: Value, previous: Option<Value>) -> Change {
        let change = Change {
            revision: self.revision,
            kind,
            object,
            previous,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube_api::validation::{Refusal, is_dns_subdomain, is_qualified_name};

    /// Decodes and admits, as a write on a server with the feature gate `gate_on`.
    fn write(
        resource: Resource,
        object: &mut Value,
        name: &str,
        old: Option<&Value>,
        gate_on: bool,
    ) -> Result<(), Refusal> {
        decode(resource, object)?;
        admit(resource, object, name, old, gate_on)
    }

    #[test]
    fn admission_follows_the_lease_validation() {
        let admit_spec =
            |spec: Value| write(Resource::Lease, &mut json!({"spec": spec}), "l", None, true);
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
            write(
                Resource::Lease,
                &mut json!({"spec": {}}),
                "Not_A_Name",
                None,
                true
            ),
            Err(Refusal::Invalid(_))
        ));
    }

    #[test]
    fn admission_follows_the_lease_candidate_validation() {
        let candidate = |spec: Value| {
            write(
                Resource::LeaseCandidate,
                &mut json!({ "spec": spec }),
                "pod-1_x",
                None,
                false,
            )
        };
        let good = json!({"leaseName": "l", "binaryVersion": "1.2.3",
            "emulationVersion": "1.2.0", "strategy": "OldestEmulationVersion",
            "renewTime": "2026-11-23T10:00:00Z"});
        assert!(candidate(good.clone()).is_ok());
        for (field, value) in [
            ("leaseName", json!("")),
            ("binaryVersion", json!("")),
            ("binaryVersion", json!("1.2")),
            ("emulationVersion", json!("0.0.0")),
            ("strategy", json!("example.com/-mine")),
            ("strategy", json!("Example.com/mine")),
            ("strategy", json!("a/b/c")),
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
        assert!(candidate(third_party.clone()).is_ok());
        third_party["binaryVersion"] = json!("");
        assert!(
            matches!(candidate(third_party), Err(Refusal::Invalid(m)) if m.contains("binaryVersion: Required"))
        );
        let mut built = good.clone();
        built["binaryVersion"] = json!("1.2.3+build-1");
        built["emulationVersion"] = json!("1.2.3-rc.1");
        assert!(candidate(built).is_ok());
        let renamed = write(
            Resource::LeaseCandidate,
            &mut json!({ "spec": good.clone() }),
            "pod-1",
            Some(&json!({"spec": {"leaseName": "other"}})),
            false,
        );
        assert!(matches!(renamed, Err(Refusal::Invalid(m)) if m.contains("immutable")));
        assert!(matches!(
            write(
                Resource::LeaseCandidate,
                &mut json!({ "spec": good }),
                "a/b",
                None,
                false
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
        assert!(strict("1.2.3-rc.2") < strict("1.2.3-rc.10"));
        assert!(strict("1.2.3-rc.10") < strict("1.2.3-rc.a"));
        assert!(strict("1.2.3-rc") < strict("1.2.3-rc.1"));
        assert_eq!(strict("1.0.0+build-1"), strict("1.0.0+other"));
        assert!(strict("1.0.0+build-1").is_some());
        assert!(strict("1.0.0-").is_none());
        assert!(strict("1.0.0-01").is_none());
        assert!(strict("1.9.0") < strict("1.10.0"));
        assert_eq!(tolerant("v1.33"), tolerant("1.33.0"));
        assert!(tolerant("1.32.9") < tolerant("1.33"));
        assert_eq!(tolerant("v01.002.3"), tolerant("1.2.3"));
        assert!(SemVer::parse_tolerant("1.2-rc.1").is_none());
    }

    #[test]
    fn with_the_gate_off_strategy_and_preferred_holder_are_dropped_unless_stored_before() {
        let spec = json!({"holderIdentity": "a", "strategy": "OldestEmulationVersion",
            "preferredHolder": "b"});
        let mut created = json!({ "spec": spec.clone() });
        write(Resource::Lease, &mut created, "l", None, false).expect("admitted");
        assert_eq!(created["spec"], json!({"holderIdentity": "a"}));
        let mut kept = json!({ "spec": spec.clone() });
        write(Resource::Lease, &mut kept, "l", None, true).expect("admitted");
        assert_eq!(kept["spec"], spec);
        // An update keeps each field the stored Lease already has, and no other.
        let old = json!({"spec": {"holderIdentity": "a", "strategy": "OldestEmulationVersion"}});
        let mut updated = json!({ "spec": spec.clone() });
        write(Resource::Lease, &mut updated, "l", Some(&old), false).expect("admitted");
        assert_eq!(
            updated["spec"],
            json!({"holderIdentity": "a", "strategy": "OldestEmulationVersion"})
        );
        // Dropped before validation: a preferred holder alone is no error.
        let mut alone = json!({"spec": {"preferredHolder": "b"}});
        write(Resource::Lease, &mut alone, "l", None, false).expect("admitted");
        assert_eq!(alone["spec"], json!({}));
    }

    #[test]
    fn names_are_dns_subdomains_label_by_label() {
        for good in ["a", "a.b-c", "0.9", &"a".repeat(253)] {
            assert!(is_dns_subdomain(good), "{good}");
        }
        for bad in [
            "",
            "a..b",
            "a.-b",
            "a-.b",
            ".a",
            "A",
            "nightly_cleanup",
            &"a".repeat(254),
        ] {
            assert!(!is_dns_subdomain(bad), "{bad}");
        }
        assert!(is_qualified_name("example.com/by-zone_1.x"));
        assert!(!is_qualified_name("example.com/"));
        assert!(!is_qualified_name("/name"));
        assert!(!is_qualified_name(&format!(
            "example.com/{}",
            "a".repeat(64)
        )));
    }

    #[test]
    fn a_lease_without_a_spec_has_an_empty_one() {
        let mut lease = json!({"metadata": {"name": "l"}});
        write(Resource::Lease, &mut lease, "l", None, false).expect("admitted");
        assert_eq!(lease["spec"], json!({}));
    }

    #[test]
    fn unknown_fields_are_dropped_and_times_normalised() {
        let mut lease = json!({"spec": {"holderIdentity": "a", "bogus": 1,
            "renewTime": "2026-11-21T10:00:00.5+01:00"}});
        write(Resource::Lease, &mut lease, "l", None, false).expect("admitted");
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
