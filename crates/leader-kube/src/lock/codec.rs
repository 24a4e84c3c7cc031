//! A record as a Lease and back, as client-go writes it: the spec, the fields the API server
//! may drop kept in an annotation, and the record read from a Lease.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use leader_core::{LeaderElectionRecord, LockError, Observed, Version};

use super::FENCING_TOKEN_ANNOTATION;
use crate::error::BACKEND;
use crate::time::{chrono_of, micro};

/// The Lease spec for a record, as client-go writes it over the spec `old` (if any).
pub(super) fn spec_of(record: &LeaderElectionRecord, old: Option<&LeaseSpec>) -> LeaseSpec {
    // Whole seconds in the API: round up, so that followers never wait less than asked. A
    // release writes 1 s, as client-go does: others take a free Lease over at once. One that
    // hands over (or reserves the Lease for its holder's return) keeps the lease, which the
    // candidates stand back for from when they see the request (client-go's candidates take a
    // Lease without a holder whatever its duration).
    let seconds = if record.is_free() && record.handover_to().is_none() {
        1
    } else {
        record.lease_duration.as_millis().div_ceil(1000).max(1)
    };
    // client-go: one more transition whenever the holder changes; valid (>= 0) for every client.
    let old_transitions = old.and_then(|s| s.lease_transitions).unwrap_or(0).max(0);
    let old_holder = old.and_then(|s| s.holder_identity.as_deref()).unwrap_or("");
    let transitions = if !record.is_free() && old.is_some() && old_holder != record.holder_identity
    {
        old_transitions.checked_add(1).unwrap_or(0)
    } else {
        old_transitions
    };
    LeaseSpec {
        holder_identity: Some(record.holder_identity.clone()),
        lease_duration_seconds: Some(i32::try_from(seconds).unwrap_or(i32::MAX)),
        acquire_time: Some(micro(record.acquire_time)),
        renew_time: Some(micro(record.renew_time)),
        lease_transitions: Some(transitions),
        // As client-go writes them; a stock API server drops both (the feature gate is off),
        // which is why the record's are kept in the annotation too (`KeptFields`).
        strategy: record.strategy.clone(),
        // Only a request already in the spec (the coordinator's) is written back there: the API
        // server takes a preferred holder only beside a strategy, and only with the gate on.
        preferred_holder: old
            .and_then(|s| s.preferred_holder.clone())
            .filter(|p| Some(p.as_str()) == record.handover_to()),
    }
}

/// The `strategy` that earlier versions of this lock wrote beside a handover request's
/// `preferredHolder`; it is still read back as no strategy, and no longer written.
pub const HANDOVER_STRATEGY: &str = "leader-rs.io/handover";

/// The annotation on the Lease that keeps the record's handover request and strategy where
/// every API server keeps them. With kube-apiserver's `CoordinatedLeaderElection` feature gate
/// off (the default, also at beta), its Lease strategy drops `spec.preferredHolder` and
/// `spec.strategy` from every create and update; annotations stay, and other clients that
/// rewrite the Lease (client-go's `LeaseLock`, which sends back the Lease it read; kubert,
/// which patches only the spec) leave them alone.
///
/// Its value is JSON naming the term it was written in:
/// `{"holderIdentity":"a","leaseTransitions":7,"preferredHolder":"b"}` (and `"strategy"` when
/// the record has one). It counts only while the Lease's `holderIdentity` and
/// `leaseTransitions` are still those: once another client takes the Lease (a new holder, one
/// more transition) it is stale and read as no request.
pub const COORDINATION_ANNOTATION: &str = "leader-rs.io/coordination";

/// The annotation on the Lease that keeps the record's
/// [`extensions`](leader_core::LeaderElectionRecord::extensions), as a JSON object of strings.
/// Other clients that rewrite the Lease keep annotations (client-go sends back the Lease it
/// read; kubert patches only the spec).
pub const EXTENSIONS_ANNOTATION: &str = "leader-rs.io/extensions";

/// The content of [`COORDINATION_ANNOTATION`].
#[derive(Debug, PartialEq, Eq)]
pub(super) struct KeptFields {
    holder_identity: String,
    lease_transitions: i32,
    preferred_holder: Option<String>,
    strategy: Option<String>,
}

impl KeptFields {
    /// What a write of `record` as `spec` keeps in the annotation; `None` when there is nothing
    /// to keep.
    pub(super) fn of(record: &LeaderElectionRecord, spec: &LeaseSpec) -> Option<Self> {
        let kept = Self {
            holder_identity: spec.holder_identity.clone().unwrap_or_default(),
            lease_transitions: spec.lease_transitions.unwrap_or(0),
            preferred_holder: record.handover_to().map(str::to_owned),
            strategy: record.strategy.clone(),
        };
        (kept.preferred_holder.is_some() || kept.strategy.is_some()).then_some(kept)
    }

    /// The annotation's fields, if it is there, well formed, and written in the Lease's
    /// current term.
    pub(super) fn read(lease: &Lease) -> Option<Self> {
        let text = lease
            .metadata
            .annotations
            .as_ref()?
            .get(COORDINATION_ANNOTATION)?;
        let value: serde_json::Value = serde_json::from_str(text).ok()?;
        let string = |field: &str| value[field].as_str().map(str::to_owned);
        let kept = Self {
            holder_identity: string("holderIdentity")?,
            lease_transitions: i32::try_from(value["leaseTransitions"].as_i64()?).ok()?,
            preferred_holder: string("preferredHolder").filter(|p| !p.is_empty()),
            strategy: string("strategy"),
        };
        let spec = lease.spec.as_ref();
        let holder = spec
            .and_then(|s| s.holder_identity.as_deref())
            .unwrap_or("");
        let transitions = spec.and_then(|s| s.lease_transitions).unwrap_or(0);
        (kept.holder_identity == holder && kept.lease_transitions == transitions).then_some(kept)
    }

    pub(super) fn to_json(&self) -> String {
        let mut value = serde_json::json!({
            "holderIdentity": self.holder_identity,
            "leaseTransitions": self.lease_transitions,
        });
        if let Some(to) = &self.preferred_holder {
            value["preferredHolder"] = serde_json::json!(to);
        }
        if let Some(strategy) = &self.strategy {
            value["strategy"] = serde_json::json!(strategy);
        }
        value.to_string()
    }
}

/// The record in a Lease, read as client-go reads it: missing fields are empty or zero.
pub(super) fn record_of(context: &str, lease: &Lease) -> Result<Observed, LockError> {
    let bad = |reason: String| LockError::invalid_record(BACKEND, format!("{context}: {reason}"));
    let spec = lease.spec.clone().unwrap_or_default();
    let seconds = spec.lease_duration_seconds.unwrap_or(0);
    let transitions = spec.lease_transitions.unwrap_or(0);
    let acquire = spec.acquire_time.as_ref().map(chrono_of);
    let renew = spec.renew_time.as_ref().map(chrono_of);
    let kept = KeptFields::read(lease);
    let extensions = match lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(EXTENSIONS_ANNOTATION))
    {
        Some(json) => serde_json::from_str(json).map_err(|err| {
            bad(format!(
                "annotation {EXTENSIONS_ANNOTATION} is not a JSON object of strings: {err}"
            ))
        })?,
        None => Default::default(),
    };
    // The fencing token: the high-water mark we keep, or what other clients counted if higher.
    let high_water = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(FENCING_TOKEN_ANNOTATION))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let record = {
        let mut record = LeaderElectionRecord::new(
            spec.holder_identity.unwrap_or_default(),
            Duration::from_secs(
                u64::try_from(seconds)
                    .map_err(|_| bad(format!("negative leaseDurationSeconds {seconds}")))?,
            ),
            acquire.flatten().or(renew.flatten()).unwrap_or_default(),
            u64::try_from(transitions)
                .map_err(|_| bad(format!("negative leaseTransitions {transitions}")))?
                .max(high_water),
        );
        record.renew_time = renew.flatten().or(acquire.flatten()).unwrap_or_default();
        // The spec's fields (written by the coordinator, or kept by a server with the gate on),
        // else what the annotation keeps for this term.
        record.strategy = spec
            .strategy
            .filter(|s| s != HANDOVER_STRATEGY)
            .or_else(|| kept.as_ref().and_then(|k| k.strategy.clone()));
        record.preferred_holder = spec
            .preferred_holder
            .filter(|p| !p.is_empty())
            .or_else(|| kept.and_then(|k| k.preferred_holder));
        record.extensions = extensions;
        record
    };
    let version = lease
        .metadata
        .resource_version
        .clone()
        .ok_or_else(|| bad("the Lease has no resourceVersion".into()))?;
    Ok(Observed {
        record,
        version: Version::new(version),
    })
}
