//! The lock: one `coordination.k8s.io/v1` Lease, in client-go's layout.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use leader_core::{
    ChangeStream, LeaderElectionRecord, LeaderEvent, LockError, Observed, ResourceLock, Version,
};

use crate::error::{BACKEND, map};

/// A [`ResourceLock`] on a `coordination.k8s.io/v1` Lease, written exactly as client-go's
/// `LeaseLock` writes it, so a client-go process and this one can contend for the same Lease.
///
/// - The record maps onto the Lease spec: `holderIdentity`, `leaseDurationSeconds` (whole
///   seconds, rounded up, never down), `acquireTime`, `renewTime`, `leaseTransitions`, `strategy`
///   and `preferredHolder`.
/// - Compare-and-swap on `metadata.resourceVersion`: an update replaces the Lease with the
///   version it read, and the API server answers 409 if it changed; a create that finds the
///   Lease is a conflict too. The holder renews in one request from its cached Lease and reads
///   only when that conflicts (client-go's fast path).
/// - Events "became leader" / "stopped leading" are recorded on the Lease, best effort.
/// - Followers watch the one Lease (a field selector on its name) and try at once on a change.
#[derive(Clone)]
pub struct LeaseLock {
    api: Api<Lease>,
    events: Api<Event>,
    namespace: String,
    name: String,
    identity: String,
}

impl fmt::Debug for LeaseLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseLock")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl LeaseLock {
    /// A lock on the Lease `name` in `namespace`, for candidate `identity`.
    pub fn new(
        client: kube::Client,
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        let namespace = namespace.into();
        Self {
            api: Api::namespaced(client.clone(), &namespace),
            events: Api::namespaced(client, &namespace),
            namespace,
            name: name.into(),
            identity: identity.into(),
        }
    }

    /// A lock with a client from the environment: in-cluster configuration in a pod, else the
    /// kubeconfig (`KUBECONFIG`, `~/.kube/config`). Requests time out after `timeout`; keep it
    /// below the elector's renew deadline.
    pub async fn from_env(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
        timeout: Duration,
    ) -> Result<Self, LockError> {
        let mut config = kube::Config::infer()
            .await
            .map_err(|err| LockError::Misconfigured {
                backend: BACKEND,
                message: format!("no Kubernetes configuration (in-cluster or kubeconfig): {err}"),
            })?;
        config.connect_timeout = Some(timeout);
        config.read_timeout = Some(timeout);
        config.write_timeout = Some(timeout);
        let client = kube::Client::try_from(config).map_err(|err| LockError::Misconfigured {
            backend: BACKEND,
            message: format!("cannot build a Kubernetes client: {err}"),
        })?;
        Ok(Self::new(client, namespace, name, identity))
    }

    fn context(&self) -> String {
        format!("lease {}/{}", self.namespace, self.name)
    }

    fn map(&self, verb: &str, err: kube::Error) -> LockError {
        map(&self.context(), verb, err)
    }

    /// A Lease carrying `record`, with `resource_version` for a replace.
    fn lease(&self, record: &LeaderElectionRecord, resource_version: Option<String>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                resource_version,
                ..ObjectMeta::default()
            },
            spec: Some(spec_of(record)),
        }
    }
}

fn micro(time: DateTime<Utc>) -> MicroTime {
    let nanos =
        i128::from(time.timestamp()) * 1_000_000_000 + i128::from(time.timestamp_subsec_nanos());
    MicroTime(k8s_openapi::jiff::Timestamp::from_nanosecond(nanos).unwrap_or_default())
}

fn chrono_of(time: &MicroTime) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(
        time.0.as_second(),
        u32::try_from(time.0.subsec_nanosecond()).ok()?,
    )
}

/// The Lease spec for a record, as client-go writes it.
fn spec_of(record: &LeaderElectionRecord) -> LeaseSpec {
    // Whole seconds in the API: round up, so that followers never wait less than asked.
    let seconds = record.lease_duration.as_millis().div_ceil(1000);
    LeaseSpec {
        holder_identity: Some(record.holder_identity.clone()),
        lease_duration_seconds: Some(i32::try_from(seconds).unwrap_or(i32::MAX)),
        acquire_time: Some(micro(record.acquire_time)),
        renew_time: Some(micro(record.renew_time)),
        lease_transitions: Some(i32::try_from(record.leader_transitions).unwrap_or(i32::MAX)),
        strategy: record.strategy.clone(),
        preferred_holder: record.preferred_holder.clone(),
    }
}

/// The record in a Lease, read as client-go reads it: missing fields are empty or zero.
fn record_of(context: &str, lease: &Lease) -> Result<Observed, LockError> {
    let bad = |reason: String| LockError::invalid_record(BACKEND, format!("{context}: {reason}"));
    let spec = lease.spec.clone().unwrap_or_default();
    let seconds = spec.lease_duration_seconds.unwrap_or(0);
    let transitions = spec.lease_transitions.unwrap_or(0);
    let acquire = spec.acquire_time.as_ref().map(chrono_of);
    let renew = spec.renew_time.as_ref().map(chrono_of);
    let record = LeaderElectionRecord {
        holder_identity: spec.holder_identity.unwrap_or_default(),
        lease_duration: Duration::from_secs(
            u64::try_from(seconds)
                .map_err(|_| bad(format!("negative leaseDurationSeconds {seconds}")))?,
        ),
        acquire_time: acquire.flatten().or(renew.flatten()).unwrap_or_default(),
        renew_time: renew.flatten().or(acquire.flatten()).unwrap_or_default(),
        leader_transitions: u64::try_from(transitions)
            .map_err(|_| bad(format!("negative leaseTransitions {transitions}")))?,
        strategy: spec.strategy,
        preferred_holder: spec.preferred_holder,
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

#[async_trait]
impl ResourceLock for LeaseLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let lease = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|err| self.map("get", err))?;
        lease
            .map(|lease| record_of(&self.context(), &lease))
            .transpose()
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let created = self
            .api
            .create(&PostParams::default(), &self.lease(record, None))
            .await
            .map_err(|err| self.map("create", err))?;
        record_of(&self.context(), &created)
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let lease = self.lease(record, Some(version.as_str().to_owned()));
        let replaced = self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
            .map_err(|err| self.map("update", err))?;
        record_of(&self.context(), &replaced)
    }

    async fn record_event(&self, event: &LeaderEvent) {
        let (reason, message) = match event {
            LeaderEvent::BecameLeader { fencing_token } => (
                "LeaderElection",
                format!(
                    "{} became leader (fencing token {fencing_token})",
                    self.identity
                ),
            ),
            LeaderEvent::StoppedLeading { fencing_token } => (
                "LeaderElection",
                format!(
                    "{} stopped leading (fencing token {fencing_token})",
                    self.identity
                ),
            ),
            _ => return,
        };
        let now = Utc::now();
        let time = Time(micro(now).0);
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", self.name)),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some("coordination.k8s.io/v1".into()),
                kind: Some("Lease".into()),
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                ..ObjectReference::default()
            },
            reason: Some(reason.into()),
            message: Some(message),
            type_: Some("Normal".into()),
            source: Some(EventSource {
                component: Some(format!("{}_{}", self.name, self.identity)),
                ..EventSource::default()
            }),
            first_timestamp: Some(time.clone()),
            last_timestamp: Some(time),
            count: Some(1),
            ..Event::default()
        };
        if let Err(err) = self.events.create(&PostParams::default(), &event).await {
            tracing::debug!(error = %err, "could not record a Kubernetes event");
        }
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("kubernetes:{}/{}", self.namespace, self.name)
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let params = WatchParams::default()
            .fields(&format!("metadata.name={}", self.name))
            .timeout(290);
        let stream = self
            .api
            .watch(&params, "0")
            .await
            .map_err(|err| self.map("watch", err))?;
        // Only what a follower acts on: the Lease deleted or released (no holder). Renewals wake
        // nobody. A watch error (410 Gone, say) ends the stream; the elector subscribes again.
        let changes = stream
            .take_while(|event| {
                std::future::ready(matches!(event, Ok(e) if !matches!(e, WatchEvent::Error(_))))
            })
            .filter(|event| {
                std::future::ready(match event {
                    Ok(WatchEvent::Deleted(_)) => true,
                    Ok(WatchEvent::Added(lease) | WatchEvent::Modified(lease)) => lease
                        .spec
                        .as_ref()
                        .and_then(|spec| spec.holder_identity.as_deref())
                        .is_none_or(str::is_empty),
                    _ => false,
                })
            })
            .map(|_| ());
        Ok(Some(Box::pin(changes)))
    }
}
