//! Making a lock: from a client, another lock's clients, the environment or a kubeconfig;
//! coordinated leader election; and the requests and answers every operation shares.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use leader_core::{LeaderElectionRecord, LockError, Observed, Version};

use super::codec::{
    COORDINATION_ANNOTATION, EXTENSIONS_ANNOTATION, KeptFields, record_of, spec_of,
};
use super::{
    Coordinated, FENCING_TOKEN_ANNOTATION, LeaseLock, WATCH_TIMEOUT, client_with_timeouts,
};
use crate::candidate::{Candidate, Coordination, Problem};
use crate::error::{BACKEND, map};
use crate::names;

impl LeaseLock {
    /// A lock on the Lease `name` in `namespace`, for candidate `identity`.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] naming the rule when the API server would refuse the
    /// namespace (a DNS-1123 label) or the Lease name (a DNS-1123 subdomain), such as
    /// `nightly_cleanup`: names are refused here rather than changed, since two elections whose
    /// names map to one Lease would share it.
    pub fn new(
        client: kube::Client,
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Result<Self, LockError> {
        Self::with_clients(client.clone(), client, namespace, name, identity)
    }

    pub(super) fn with_clients(
        client: kube::Client,
        watch_client: kube::Client,
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Result<Self, LockError> {
        let namespace = namespace.into();
        let name = name.into();
        names::check_lease(&namespace, &name)?;
        Ok(Self {
            api: Api::namespaced(client.clone(), &namespace),
            watch_api: Api::namespaced(watch_client, &namespace),
            events: Api::namespaced(client, &namespace),
            namespace,
            name,
            identity: identity.into(),
            last: Arc::default(),
            highest_token: Arc::default(),
            coordinated: None,
        })
    }

    /// A lock on the Lease `name` in the same namespace, for candidate `identity`, through the
    /// same clients: the records of a shard set share one connection pool.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] for a name the API server would refuse.
    pub fn sibling(
        &self,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Result<Self, LockError> {
        let name = name.into();
        names::check_lease(&self.namespace, &name)?;
        Ok(Self {
            api: self.api.clone(),
            watch_api: self.watch_api.clone(),
            events: self.events.clone(),
            namespace: self.namespace.clone(),
            name,
            identity: identity.into(),
            last: Arc::default(),
            highest_token: Arc::default(),
            coordinated: None,
        })
    }

    /// Takes part in Kubernetes' coordinated leader election (KEP-4355, client-go's
    /// `Coordinated` mode) instead of contending for the Lease:
    ///
    /// - The lock announces the candidate with a `coordination.k8s.io/v1beta1` LeaseCandidate
    ///   named after its identity (`leaseName`, `binaryVersion`, `emulationVersion`,
    ///   `strategy`, `renewTime`), created at the elector's first attempt, renewed every five
    ///   minutes and at once when the coordinator pings it (`pingTime` after `renewTime`), and
    ///   deleted when the elector stops.
    /// - It never takes the Lease itself: kube-apiserver's coordinator gives it to the best
    ///   candidate (under [`Coordination::OLDEST_EMULATION_VERSION`], the oldest version), and
    ///   the candidate it names takes up the term with a compare-and-swap (the next fencing
    ///   token) as soon as its watch sees the assignment.
    /// - The holder renews as usual, and steps down as on a handover request when the
    ///   coordinator sets `preferredHolder` to a better candidate: its work stops, then it
    ///   releases, and the coordinator gives the Lease to that candidate.
    ///
    /// Candidates that are not coordinated may share the Lease: they contend as usual, and the
    /// coordinator asks them to step down for a coordinated candidate as it asks any holder.
    /// The coordinator decides expiry from `renewTime` and its own clock, so coordinated
    /// election relies on clocks in step across the cluster, as client-go's does; plain
    /// candidates never do. Without a coordinator (the `CoordinatedLeaderElection` feature
    /// gate off), a coordinated candidate never leads: the lock warns after 30 s without one.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] when the identity cannot name a LeaseCandidate, or a version
    /// or the strategy would be refused by the API server.
    pub fn coordinated(mut self, coordination: Coordination) -> Result<Self, LockError> {
        coordination.validate(&self.identity)?;
        // The LeaseCandidate through the same two clients as the Lease.
        let candidate = Candidate {
            api: Api::namespaced(self.api.clone().into_client(), &self.namespace),
            watch_api: Api::namespaced(self.watch_api.clone().into_client(), &self.namespace),
            namespace: self.namespace.clone(),
            name: self.identity.clone(),
            lease_name: self.name.clone(),
            coordination,
        };
        self.coordinated = Some(Arc::new(Coordinated {
            candidate,
            keeper: Mutex::new(None),
            problem: Problem::default(),
            unassigned_since: Mutex::new(None),
            warned: AtomicBool::new(false),
        }));
        Ok(self)
    }

    /// A lock with a client from the environment: in-cluster configuration in a pod, else the
    /// kubeconfig (`KUBECONFIG`, `~/.kube/config`), with the timeouts of
    /// [`from_config`](Self::from_config).
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] without a configuration, or for names the API server would
    /// refuse (see [`new`](Self::new)).
    pub async fn from_env(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
        timeout: Duration,
    ) -> Result<Self, LockError> {
        let config = kube::Config::infer()
            .await
            .map_err(|err| LockError::Misconfigured {
                backend: BACKEND,
                message: format!("no Kubernetes configuration (in-cluster or kubeconfig): {err}"),
            })?;
        Self::from_config(config, namespace, name, identity, timeout)
    }

    /// A lock with clients built from `config`, set up as kube-rs documents for long-lived
    /// clients: requests connect, write and read within `timeout` (keep it below the elector's
    /// renew deadline), counted from when a request is sent, not from when its pooled connection
    /// went idle (`reset_reader_on_write`). The follower's watch has a client of its own whose
    /// read timeout outlasts the server's watch timeout, so a quiet watch is not cut.
    ///
    /// Retries: the clients retry nothing themselves (kube-rs's default retries 429, 503 and
    /// 504 up to fifteen times from 5 ms, some ten requests within a request timeout): a
    /// 429 or a 5xx is [`LockError::Unavailable`], and the elector tries again after its retry
    /// period, backing off while failures last (S9).
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] when no client can be built, or for names the API server
    /// would refuse (see [`new`](Self::new)).
    pub fn from_config(
        config: kube::Config,
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
        timeout: Duration,
    ) -> Result<Self, LockError> {
        let watch_read = WATCH_TIMEOUT + timeout.max(Duration::from_secs(5));
        Self::with_clients(
            client_with_timeouts(config.clone(), timeout, timeout)?,
            client_with_timeouts(config, timeout, watch_read)?,
            namespace,
            name,
            identity,
        )
    }

    pub(super) fn context(&self) -> String {
        format!("lease {}/{}", self.namespace, self.name)
    }

    pub(super) fn map(&self, verb: &str, err: kube::Error) -> LockError {
        map(&self.context(), verb, err)
    }

    /// A Lease carrying `record`: `base` (the Lease as read, with its metadata and the version
    /// to replace) with its spec and fencing token replaced, or a new one.
    pub(super) fn lease(&self, record: &LeaderElectionRecord, base: Option<Lease>) -> Lease {
        let mut lease = base.unwrap_or_else(|| Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: None,
        });
        let spec = spec_of(record, lease.spec.as_ref());
        let kept = KeptFields::of(record, &spec);
        lease.spec = Some(spec);
        let annotations = lease
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        annotations.insert(
            FENCING_TOKEN_ANNOTATION.to_owned(),
            record.leader_transitions.to_string(),
        );
        match kept {
            Some(kept) => annotations.insert(COORDINATION_ANNOTATION.to_owned(), kept.to_json()),
            None => annotations.remove(COORDINATION_ANNOTATION),
        };
        if record.extensions.is_empty() {
            annotations.remove(EXTENSIONS_ANNOTATION);
        } else {
            annotations.insert(
                EXTENSIONS_ANNOTATION.to_owned(),
                serde_json::to_string(&record.extensions).unwrap_or_default(),
            );
        }
        // Fields the server sets; it ignores them on an update anyway.
        lease.metadata.managed_fields = None;
        lease
    }

    /// Remembers the Lease as the server returned it, and reads its record.
    pub(super) fn keep(&self, lease: Lease) -> Result<Observed, LockError> {
        let observed = record_of(&self.context(), &lease)?;
        self.highest_token
            .fetch_max(observed.record.leader_transitions, Ordering::Relaxed);
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        Ok(observed)
    }

    /// Keeps the Lease the server stored for a write of `record` and checks that it holds what
    /// was asked: a handover request or strategy the server dropped (an admission webhook or
    /// policy that rewrites Leases) is an error, never a request reported as made.
    pub(super) fn stored(
        &self,
        lease: Lease,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let observed = self.keep(lease)?;
        let stored = &observed.record;
        if stored.handover_to() != record.handover_to() || stored.strategy != record.strategy {
            return Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "{}: the API server did not keep what was written (handover request {:?} and strategy {:?} stored as {:?} and {:?}): something rewrites the Lease, such as an admission webhook or policy that changes its annotation {COORDINATION_ANNOTATION}",
                    self.context(),
                    record.handover_to(),
                    record.strategy,
                    stored.handover_to(),
                    stored.strategy,
                ),
            });
        }
        Ok(observed)
    }

    /// The Lease at `version`: the one last seen if it is that version, else read again.
    pub(super) async fn at_version(&self, version: &Version) -> Result<Option<Lease>, LockError> {
        let at =
            |lease: &Lease| lease.metadata.resource_version.as_deref() == Some(version.as_str());
        let cached = self
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .filter(at);
        if cached.is_some() {
            return Ok(cached);
        }
        let current = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|err| self.map("get", err))?;
        Ok(current.filter(at))
    }
}
