//! The coordinator of coordinated leader election, as kube-apiserver runs it with the
//! `CoordinatedLeaderElection` feature gate (KEP-4355; `pkg/controlplane/controller/
//! leaderelection/leaderelection_controller.go` and `election.go` in the Kubernetes tree).
//!
//! Candidates announce themselves with a `coordination.k8s.io/v1beta1` LeaseCandidate naming the
//! Lease (`spec.leaseName`). For each Lease with candidates, `reconcile` takes one step of an
//! election each time a Lease or a candidate changes (a candidate waiting to answer a ping does
//! not count) and [`REQUEUE`] after each step:
//!
//! - An election is needed when the Lease is missing, has no holder or has expired
//!   (`renewTime + leaseDurationSeconds` before now, by the coordinator's clock), when a
//!   candidate has not renewed for half of [`CANDIDATE_VALID`], or when a better candidate than
//!   the holder exists under the `OldestEmulationVersion` strategy.
//! - Candidates that renewed less than [`ELECTION`] ago count as present; the others are pinged
//!   (`spec.pingTime` set to now) and the vote waits until each answered (renewed after its
//!   ping) or its ping is [`ELECTION`] old.
//! - The strategy is that of the candidates with the highest binary version (candidates at the
//!   same binary version that disagree stop the election); under `OldestEmulationVersion` the
//!   electee is the answered candidate with the oldest emulation version, then the oldest
//!   binary version, then the oldest LeaseCandidate.
//! - A missing Lease is created for the electee with a [`LEASE_SECONDS`] lease; a Lease without
//!   a holder, or expired and naming another, is given to the electee (holder, `renewTime` now,
//!   [`LEASE_SECONDS`], no `acquireTime`, no `preferredHolder`); a live Lease held by another
//!   gets `preferredHolder` set to the electee, which asks its holder to step down ("end of
//!   term"): the coordinator never takes a live Lease from its holder.
//!
//! The real coordinator reads from informer caches and writes with `resourceVersion`
//! preconditions; this one reads and writes the store under its lock, which is the same as a
//! write whose precondition held.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio::time::Instant;

use super::KubeApiServer;
use super::fields;
use super::objects::{Objects, Resource, SemVer};

/// How soon a Lease is looked at again after a step (`defaultRequeueInterval`).
pub const REQUEUE: Duration = Duration::from_secs(5);
/// How long candidates have to answer a ping, and how recent a renewal counts as present
/// (`electionDuration`).
pub const ELECTION: Duration = Duration::from_secs(5);
/// The lease the coordinator writes for an electee (`defaultLeaseDurationSeconds`).
pub const LEASE_SECONDS: i64 = 5;
/// A candidate that has not renewed for this long is ignored (`leaseCandidateValidDuration`).
pub const CANDIDATE_VALID: Duration = Duration::from_secs(30 * 60);

/// The only strategy the coordinator elects under; others are left to other controllers.
const OLDEST_EMULATION_VERSION: &str = "OldestEmulationVersion";
/// The field manager of the coordinator's writes.
const MANAGER: &str = "kube-apiserver";

/// `(namespace, lease name)`.
type LeaseKey = (String, String);

/// Runs the coordinator until the runtime stops.
pub(super) async fn run(server: KubeApiServer) {
    let mut changes = server.shared.changes.subscribe();
    // Lease keys and when each is due for its next step.
    let mut due: BTreeMap<LeaseKey, Instant> = BTreeMap::new();
    {
        let objects = server.shared.objects();
        for (key, object) in &objects.items {
            if key.0 == Resource::LeaseCandidate
                && let Some(lease) = enqueued_for_candidate(object)
            {
                due.insert(lease, Instant::now());
            }
        }
    }
    loop {
        let now = Instant::now();
        let ready: Vec<LeaseKey> = due
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(key, _)| key.clone())
            .collect();
        for key in ready {
            due.remove(&key);
            if let Some(after) = reconcile(&server, &key) {
                let at = Instant::now() + after;
                let entry = due.entry(key).or_insert(at);
                *entry = (*entry).min(at);
            }
        }
        let next = due.values().min().copied();
        let change = tokio::select! {
            change = changes.recv() => change,
            () = sleep_until(next) => continue,
        };
        match change {
            Ok(change) => {
                let object = &change.object;
                let lease = match object["kind"].as_str() {
                    Some("Lease") => Some((
                        text(&object["metadata"]["namespace"]).to_owned(),
                        text(&object["metadata"]["name"]).to_owned(),
                    )),
                    Some("LeaseCandidate") => enqueued_for_candidate(object),
                    _ => None,
                };
                if let Some(lease) = lease {
                    due.insert(lease, Instant::now());
                }
            }
            // Missed changes: look at every Lease that has candidates again.
            Err(broadcast::error::RecvError::Lagged(_)) => {
                let objects = server.shared.objects();
                for object in objects.items.values() {
                    if let Some(lease) = enqueued_for_candidate(object) {
                        due.insert(lease, Instant::now());
                    }
                }
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn text(value: &Value) -> &str {
    value.as_str().unwrap_or_default()
}

fn time(value: &Value) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(value.as_str()?)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

fn micro(time: DateTime<Utc>) -> Value {
    json!(time.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string())
}

fn after(time: DateTime<Utc>, duration: Duration) -> DateTime<Utc> {
    time + chrono::Duration::from_std(duration).unwrap_or_default()
}

/// The Lease a candidate change enqueues (`enqueueCandidate`): none while the candidate has
/// been pinged and not answered, since an election is then under way.
fn enqueued_for_candidate(candidate: &Value) -> Option<LeaseKey> {
    if candidate["kind"].as_str() != Some("LeaseCandidate") {
        return None;
    }
    let spec = &candidate["spec"];
    if let (Some(ping), Some(renew)) = (time(&spec["pingTime"]), time(&spec["renewTime"]))
        && renew < ping
    {
        return None;
    }
    Some((
        text(&candidate["metadata"]["namespace"]).to_owned(),
        text(&spec["leaseName"]).to_owned(),
    ))
}

/// `isLeaseExpired`: no renewal, no duration, or the renewal plus the duration has passed.
fn lease_expired(lease: &Value, now: DateTime<Utc>) -> bool {
    let spec = &lease["spec"];
    match (
        time(&spec["renewTime"]),
        spec["leaseDurationSeconds"].as_i64(),
    ) {
        (Some(renew), Some(seconds)) => renew + chrono::Duration::seconds(seconds) < now,
        _ => true,
    }
}

fn emulation_version(candidate: &Value) -> Option<SemVer> {
    SemVer::parse_tolerant(text(&candidate["spec"]["emulationVersion"]))
}

fn binary_version(candidate: &Value) -> Option<SemVer> {
    SemVer::parse_tolerant(text(&candidate["spec"]["binaryVersion"]))
}

/// `pickBestLeaderOldestEmulationVersion`: among candidates whose versions parse, the oldest
/// emulation version, then the oldest binary version, then the oldest LeaseCandidate.
fn pick_oldest_emulation_version(candidates: &[&Value]) -> Option<String> {
    let mut electee: Option<&Value> = None;
    for &candidate in candidates {
        let (Some(emulation), Some(binary)) =
            (emulation_version(candidate), binary_version(candidate))
        else {
            continue;
        };
        let better = electee.is_none_or(|best| {
            let best_emulation = emulation_version(best);
            let best_binary = binary_version(best);
            match best_emulation.as_ref().cmp(&Some(&emulation)) {
                std::cmp::Ordering::Greater => true,
                std::cmp::Ordering::Less => false,
                std::cmp::Ordering::Equal => match best_binary.as_ref().cmp(&Some(&binary)) {
                    std::cmp::Ordering::Greater => true,
                    std::cmp::Ordering::Less => false,
                    std::cmp::Ordering::Equal => {
                        time(&best["metadata"]["creationTimestamp"])
                            > time(&candidate["metadata"]["creationTimestamp"])
                    }
                },
            }
        });
        if better {
            electee = Some(candidate);
        }
    }
    electee.map(|e| text(&e["metadata"]["name"]).to_owned())
}

/// `pickBestStrategy`: the strategy of the candidates with the highest binary version; an error
/// when two at that version disagree.
fn pick_strategy(candidates: &[&Value]) -> Result<String, String> {
    let first = candidates.first().ok_or("no candidates")?;
    let mut strategy = text(&first["spec"]["strategy"]).to_owned();
    let mut chosen_by = text(&first["metadata"]["name"]).to_owned();
    let zero = SemVer::parse("0.0.0");
    let mut highest = binary_version(first).or_else(|| zero.clone());
    for candidate in &candidates[1..] {
        let version = binary_version(candidate).or_else(|| zero.clone());
        let theirs = text(&candidate["spec"]["strategy"]);
        if highest < version {
            strategy = theirs.to_owned();
            highest = version;
            chosen_by = text(&candidate["metadata"]["name"]).to_owned();
        } else if highest == version && theirs != strategy {
            return Err(format!(
                "candidates {chosen_by:?}, {:?} at same binary version but received differing strategies {strategy}, {theirs}",
                text(&candidate["metadata"]["name"])
            ));
        }
    }
    Ok(strategy)
}

/// Stores `object` under `key` as the coordinator's write.
fn write(server: &KubeApiServer, objects: &mut Objects, resource: Resource, mut object: Value) {
    let key = (
        resource,
        text(&object["metadata"]["namespace"]).to_owned(),
        text(&object["metadata"]["name"]).to_owned(),
    );
    let current = objects.items.get(&key).cloned();
    fields::record_update(
        current.as_ref(),
        &mut object,
        MANAGER,
        resource.api_version(),
    );
    let write = objects.store(&key, object);
    server.shared.written(objects, &write);
}

/// One step of the election for a Lease (`reconcileElectionStep`); returns when to look again.
fn reconcile(server: &KubeApiServer, (namespace, lease_name): &LeaseKey) -> Option<Duration> {
    let mut objects = server.shared.objects();
    let now = Utc::now();
    let candidates: Vec<Value> = objects
        .items
        .iter()
        .filter(|((resource, ns, _), candidate)| {
            *resource == Resource::LeaseCandidate
                && ns == namespace
                && text(&candidate["spec"]["leaseName"]) == lease_name
                && time(&candidate["spec"]["renewTime"])
                    .is_some_and(|renew| after(renew, CANDIDATE_VALID) >= now)
        })
        .map(|(_, candidate)| candidate.clone())
        .collect();
    if candidates.is_empty() {
        return None;
    }
    let all: Vec<&Value> = candidates.iter().collect();
    let lease_key = (Resource::Lease, namespace.clone(), lease_name.clone());
    let lease = objects.items.get(&lease_key).cloned();

    // electionNeeded
    let holder = lease
        .as_ref()
        .map(|l| text(&l["spec"]["holderIdentity"]).to_owned())
        .unwrap_or_default();
    let needed = lease.is_none()
        || lease.as_ref().is_some_and(|l| lease_expired(l, now))
        || holder.is_empty()
        || all.iter().any(|c| {
            time(&c["spec"]["renewTime"])
                .is_some_and(|renew| after(renew, CANDIDATE_VALID / 2) < now)
        })
        || match pick_strategy(&all) {
            Err(_) => return Some(REQUEUE),
            Ok(strategy) if strategy != OLDEST_EMULATION_VERSION => false,
            Ok(_) => pick_oldest_emulation_version(&all).is_some_and(|best| best != holder),
        };
    if !needed {
        return Some(REQUEUE);
    }

    // Ping candidates that have not renewed lately; wait for those pinged to answer.
    let mut can_vote = true;
    for candidate in &candidates {
        let spec = &candidate["spec"];
        let ping = time(&spec["pingTime"]);
        let renew = time(&spec["renewTime"]);
        if let (Some(ping), Some(renew)) = (ping, renew)
            && after(ping, ELECTION) > now
            && renew < ping
        {
            can_vote = false;
            continue;
        }
        if renew.is_some_and(|renew| after(renew, ELECTION) > now) {
            continue;
        }
        let answered_last = matches!((ping, renew), (Some(ping), Some(renew)) if ping < renew);
        if ping.is_none() || (ping.is_some_and(|p| after(p, ELECTION) < now) && answered_last) {
            let mut pinged = candidate.clone();
            pinged["spec"]["pingTime"] = micro(now);
            write(server, &mut objects, Resource::LeaseCandidate, pinged);
            can_vote = false;
        }
    }
    if !can_vote {
        return Some(REQUEUE);
    }
    for candidate in &candidates {
        let spec = &candidate["spec"];
        let Some(ping) = time(&spec["pingTime"]) else {
            continue;
        };
        if time(&spec["renewTime"]).is_some_and(|renew| ping < renew) {
            continue;
        }
        if after(ping, ELECTION) > now {
            return None;
        }
    }
    let acked: Vec<&Value> = candidates
        .iter()
        .filter(|c| time(&c["spec"]["renewTime"]).is_some_and(|r| after(r, ELECTION) > now))
        .collect();
    if acked.is_empty() {
        return None;
    }
    let Ok(strategy) = pick_strategy(&acked) else {
        return None;
    };
    let electee = if strategy == OLDEST_EMULATION_VERSION {
        match pick_oldest_emulation_version(&acked) {
            Some(electee) => Some(electee),
            None => return None,
        }
    } else {
        // Another controller elects under this strategy; the Lease is still created.
        None
    };

    let Some(existing) = lease else {
        let mut spec = json!({"strategy": strategy, "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": micro(now)});
        if let Some(electee) = &electee {
            spec["holderIdentity"] = json!(electee);
        }
        let created = json!({"metadata": {"name": lease_name, "namespace": namespace},
            "spec": spec});
        write(server, &mut objects, Resource::Lease, created);
        return Some(REQUEUE);
    };
    let mut updated = existing.clone();
    let spec = &mut updated["spec"];
    if text(&spec["strategy"]) != strategy {
        spec["strategy"] = json!(strategy);
    }
    if let Some(electee) = &electee {
        let current = text(&existing["spec"]["holderIdentity"]);
        let no_holder = current.is_empty();
        let expired_and_new = lease_expired(&existing, now) && current != electee;
        if no_holder || expired_and_new {
            if let Some(spec) = spec.as_object_mut() {
                spec.remove("preferredHolder");
                spec.remove("acquireTime");
            }
            spec["holderIdentity"] = json!(electee);
            spec["renewTime"] = micro(now);
            spec["leaseDurationSeconds"] = json!(LEASE_SECONDS);
        } else if current != electee {
            spec["preferredHolder"] = json!(electee);
        }
    }
    if updated != existing {
        write(server, &mut objects, Resource::Lease, updated);
    }
    Some(REQUEUE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(name: &str, emulation: &str, binary: &str, created: &str) -> Value {
        json!({"kind": "LeaseCandidate", "metadata": {"name": name, "creationTimestamp": created},
            "spec": {"leaseName": "l", "emulationVersion": emulation, "binaryVersion": binary,
                     "strategy": OLDEST_EMULATION_VERSION}})
    }

    #[test]
    fn the_oldest_emulation_version_wins_then_binary_then_age() {
        let a = candidate("a", "1.33.0", "1.34.0", "2026-01-01T00:00:02Z");
        let b = candidate("b", "1.32.0", "1.34.0", "2026-01-01T00:00:03Z");
        let c = candidate("c", "1.32.0", "1.33.0", "2026-01-01T00:00:04Z");
        let d = candidate("d", "1.32.0", "1.33.0", "2026-01-01T00:00:01Z");
        assert_eq!(
            pick_oldest_emulation_version(&[&a, &b]).as_deref(),
            Some("b")
        );
        assert_eq!(
            pick_oldest_emulation_version(&[&a, &b, &c]).as_deref(),
            Some("c")
        );
        assert_eq!(
            pick_oldest_emulation_version(&[&c, &d]).as_deref(),
            Some("d")
        );
        let unparsable = candidate("e", "latest", "1.0.0", "2026-01-01T00:00:00Z");
        assert_eq!(
            pick_oldest_emulation_version(&[&unparsable, &a]).as_deref(),
            Some("a")
        );
    }

    #[test]
    fn the_highest_binary_version_chooses_the_strategy() {
        let mut new = candidate("new", "1.33.0", "1.35.0", "2026-01-01T00:00:00Z");
        new["spec"]["strategy"] = json!("example.com/mine");
        let old = candidate("old", "1.33.0", "1.34.0", "2026-01-01T00:00:00Z");
        assert_eq!(
            pick_strategy(&[&old, &new]).as_deref(),
            Ok("example.com/mine")
        );
        let mut same = candidate("same", "1.33.0", "1.35.0", "2026-01-01T00:00:00Z");
        same["spec"]["strategy"] = json!(OLDEST_EMULATION_VERSION);
        assert!(pick_strategy(&[&old, &new, &same]).is_err());
    }

    #[test]
    fn a_pinged_candidate_that_has_not_answered_enqueues_nothing() {
        let mut c = candidate("a", "1.33.0", "1.33.0", "2026-01-01T00:00:00Z");
        c["metadata"]["namespace"] = json!("ns");
        c["spec"]["renewTime"] = json!("2026-01-01T00:00:01.000000Z");
        assert_eq!(
            enqueued_for_candidate(&c),
            Some(("ns".to_owned(), "l".to_owned()))
        );
        c["spec"]["pingTime"] = json!("2026-01-01T00:00:02.000000Z");
        assert_eq!(enqueued_for_candidate(&c), None);
    }
}
