//! The lock: one `coordination.k8s.io/v1` Lease, in client-go's layout.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::Utc;
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LeaderEvent, LockError, Observed,
    ResourceLock, Version,
};

use crate::candidate::{Candidate, Coordination, Keeper, Problem};
use crate::error::{BACKEND, map};
use crate::names;
use crate::time::{chrono_of, micro};

/// A [`ResourceLock`] on a `coordination.k8s.io/v1` Lease, written exactly as client-go's
/// `LeaseLock` writes it, so a client-go process and this one can contend for the same Lease.
///
/// - The record maps onto the Lease spec: `holderIdentity`, `leaseDurationSeconds` (whole
///   seconds, rounded up, never down), `acquireTime`, `renewTime`, `leaseTransitions`, `strategy`
///   and `preferredHolder`. A release writes an empty holder and a 1 s lease, as client-go does,
///   so that every client takes a released Lease over at once.
/// - `leaseTransitions` is written as client-go writes it: one more whenever the holder changes,
///   kept otherwise, and never negative (past `i32::MAX` it starts again at 0). The fencing token
///   is the larger of it and a high-water mark kept in the annotation [`FENCING_TOKEN_ANNOTATION`],
///   which other clients leave alone: it grows on every acquisition beyond 32 bits and whatever
///   other clients write into `leaseTransitions`. If the Lease is deleted, or a client removes
///   the annotation, the count starts again from `leaseTransitions`: give a fencing sink its own
///   record of the highest token it accepted.
/// - Compare-and-swap on `metadata.resourceVersion`: an update sends back the Lease it read with
///   the spec replaced (labels, annotations and owner references stay), and the API server
///   answers 409 if it changed; a create that finds the Lease is a conflict too. The holder
///   renews in one request from its cached Lease and reads only when that conflicts (client-go's
///   fast path).
/// - Events "became leader" / "stopped leading" are recorded on the Lease, best effort.
/// - Followers watch the one Lease (a field selector on its name) and try at once on a change.
/// - With [`coordinated`](Self::coordinated), the lock takes part in Kubernetes' coordinated
///   leader election instead of contending: the API server's coordinator gives the Lease to a
///   candidate, and this one only takes up a Lease given to it.
#[derive(Clone)]
pub struct LeaseLock {
    api: Api<Lease>,
    /// The same API through a client whose read timeout outlasts the server's watch timeout.
    watch_api: Api<Lease>,
    events: Api<Event>,
    namespace: String,
    name: String,
    identity: String,
    /// The Lease as last read or written, sent back (spec replaced) by the next update.
    last: Arc<Mutex<Option<Lease>>>,
    /// The highest fencing token this lock has seen in the Lease, so that a Lease it creates
    /// again after a deletion goes on from there.
    highest_token: Arc<AtomicU64>,
    coordinated: Option<Arc<Coordinated>>,
}

/// What a lock in coordinated leader election keeps.
#[derive(Debug)]
struct Coordinated {
    candidate: Candidate,
    /// The task keeping the LeaseCandidate, from the first attempt until [`ResourceLock::close`].
    keeper: Mutex<Option<Keeper>>,
    /// A failure of the keeper that needs a person, reported by the next attempt.
    problem: Problem,
    /// Since when the Lease has had no holder, to warn once when no coordinator acts.
    unassigned_since: Mutex<Option<Instant>>,
    warned: AtomicBool,
}

/// How long a coordinated candidate sees a Lease without holder before it warns that no
/// coordinator seems to run (the coordinator acts within seconds).
const NO_COORDINATOR_AFTER: Duration = Duration::from_secs(30);

/// How long the server keeps a watch open before it ends it (`timeoutSeconds`); the elector
/// then watches again.
const WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// The annotation on the Lease that keeps the highest fencing token handed out, a 64-bit count
/// that other clients leave alone.
pub const FENCING_TOKEN_ANNOTATION: &str = "leader-rs.io/fencing-token";

impl fmt::Debug for LeaseLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseLock")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("identity", &self.identity)
            .field(
                "coordination",
                &self.coordinated.as_ref().map(|c| &c.candidate.coordination),
            )
            .finish_non_exhaustive()
    }
}

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

    fn with_clients(
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
    /// Retries: kube-rs's default policy retries 429, 503 and 504 up to three times, 0.5 s apart
    /// and doubling (it does not read `Retry-After`), always within the elector's request
    /// timeout, as client-go retries them; any other 5xx is [`LockError::Unavailable`], and the
    /// elector tries again after its retry period, backing off while failures last (S9).
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

    fn context(&self) -> String {
        format!("lease {}/{}", self.namespace, self.name)
    }

    fn map(&self, verb: &str, err: kube::Error) -> LockError {
        map(&self.context(), verb, err)
    }

    /// A Lease carrying `record`: `base` (the Lease as read, with its metadata and the version
    /// to replace) with its spec and fencing token replaced, or a new one.
    fn lease(&self, record: &LeaderElectionRecord, base: Option<Lease>) -> Lease {
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
    fn keep(&self, lease: Lease) -> Result<Observed, LockError> {
        let observed = record_of(&self.context(), &lease)?;
        self.highest_token
            .fetch_max(observed.record.leader_transitions, Ordering::Relaxed);
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
        Ok(observed)
    }

    /// Keeps the Lease the server stored for a write of `record` and checks that it holds what
    /// was asked: a handover request or strategy the server dropped (an admission webhook or
    /// policy that rewrites Leases) is an error, never a request reported as made.
    fn stored(&self, lease: Lease, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
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
    async fn at_version(&self, version: &Version) -> Result<Option<Lease>, LockError> {
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

impl LeaseLock {
    pub(crate) fn namespace(&self) -> &str {
        &self.namespace
    }

    pub(crate) fn api(&self) -> &Api<Lease> {
        &self.api
    }

    pub(crate) fn is_coordinated(&self) -> bool {
        self.coordinated.is_some()
    }

    /// The record of `lease` as a list of many found it, remembered as a read of this lock's
    /// Lease: what [`get`](ResourceLock::get) would answer.
    pub(crate) fn absorb(&self, lease: Lease) -> Result<Observed, LockError> {
        self.keep(lease)
    }
}

impl LeaseLock {
    /// Warns once when a coordinated candidate has seen the Lease without a holder for
    /// [`NO_COORDINATOR_AFTER`]: no coordinator seems to run.
    fn note_unassigned(&self, current: Option<&Observed>) {
        let Some(coordinated) = &self.coordinated else {
            return;
        };
        let mut since = coordinated
            .unassigned_since
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if current.is_some_and(|o| !o.record.is_free()) {
            *since = None;
            return;
        }
        let since = *since.get_or_insert_with(Instant::now);
        if since.elapsed() >= NO_COORDINATOR_AFTER
            && !coordinated.warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                lease = %self.describe(),
                waited = ?since.elapsed(),
                "no coordinator has given the Lease a holder: coordinated leader election needs kube-apiserver's CoordinatedLeaderElection feature gate (coordination.k8s.io/v1beta1)"
            );
        }
    }
}

/// What one event of a Lease watch means to a follower.
enum WatchOutcome {
    /// The Lease was deleted or released (no holder), or asks for a handover: worth an
    /// attempt (or, for the leader, a renewal) at once.
    Released,
    /// A renewal, a bookmark: nothing to act on.
    Quiet,
    /// The watch failed (410 Gone, say) and ends.
    Ended,
}

type WatchEvents = std::pin::Pin<Box<dyn futures_util::Stream<Item = WatchOutcome> + Send>>;

/// A watch that ends this soon after it opened counts against [`QUICK_WATCHES`].
const QUICK_WATCH: Duration = Duration::from_millis(100);
/// How many watches in a row may end that soon before the stream gives up.
const QUICK_WATCHES: u32 = 3;

impl LeaseLock {
    /// One watch of this Lease from the current state, as what each event means.
    async fn open_watch(&self) -> Result<WatchEvents, LockError> {
        // A coordinated candidate acts when the coordinator gives it the Lease.
        let assigned_to = self.coordinated.is_some().then(|| self.identity.clone());
        let mut holder_before: Option<String> = None;
        // A handover request wakes candidates once: a holder that is not this toolkit's
        // (client-go, kubert) never acts on it, and each of its renewals would wake every
        // follower again.
        let mut request_before: Option<(String, String)> = None;
        let seconds = u32::try_from(WATCH_TIMEOUT.as_secs()).unwrap_or(290);
        let params = WatchParams::default()
            .fields(&format!("metadata.name={}", self.name))
            .timeout(seconds);
        let stream = self
            .watch_api
            .watch(&params, "0")
            .await
            .map_err(|err| self.map("watch", err))?;
        // Only what a candidate acts on: the Lease deleted, released (no holder), asking for
        // a handover, or given to this coordinated candidate. Renewals and bookmarks wake
        // nobody.
        let outcomes = stream.map(move |event| match event {
            Ok(WatchEvent::Deleted(_)) => {
                holder_before = None;
                request_before = None;
                WatchOutcome::Released
            }
            Ok(WatchEvent::Added(lease) | WatchEvent::Modified(lease)) => {
                let spec = lease.spec.as_ref();
                let holder = spec.and_then(|spec| spec.holder_identity.clone());
                let free = holder.as_deref().is_none_or(str::is_empty);
                // The request as the lock reads it: the spec's, or the one in the annotation;
                // new when it, or the holder it is for, changed.
                let request = record_of("", &lease).ok().and_then(|observed| {
                    let to = observed.record.handover_to()?.to_owned();
                    Some((observed.record.holder_identity, to))
                });
                let handover = request.is_some() && request != request_before;
                request_before = request;
                let assigned =
                    assigned_to.is_some() && holder == assigned_to && holder != holder_before;
                holder_before = holder;
                if free || handover || assigned {
                    WatchOutcome::Released
                } else {
                    WatchOutcome::Quiet
                }
            }
            Ok(WatchEvent::Bookmark(_)) => WatchOutcome::Quiet,
            Ok(WatchEvent::Error(_)) | Err(_) => WatchOutcome::Ended,
        });
        Ok(Box::pin(outcomes))
    }
}

/// The Lease spec for a record, as client-go writes it over the spec `old` (if any).
fn spec_of(record: &LeaderElectionRecord, old: Option<&LeaseSpec>) -> LeaseSpec {
    // Whole seconds in the API: round up, so that followers never wait less than asked. A
    // release writes 1 s, as client-go does: others take a free Lease over at once.
    let seconds = if record.is_free() {
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
struct KeptFields {
    holder_identity: String,
    lease_transitions: i32,
    preferred_holder: Option<String>,
    strategy: Option<String>,
}

impl KeptFields {
    /// What a write of `record` as `spec` keeps in the annotation; `None` when there is nothing
    /// to keep.
    fn of(record: &LeaderElectionRecord, spec: &LeaseSpec) -> Option<Self> {
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
    fn read(lease: &Lease) -> Option<Self> {
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

    fn to_json(&self) -> String {
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
fn record_of(context: &str, lease: &Lease) -> Result<Observed, LockError> {
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
    let record = LeaderElectionRecord {
        holder_identity: spec.holder_identity.unwrap_or_default(),
        lease_duration: Duration::from_secs(
            u64::try_from(seconds)
                .map_err(|_| bad(format!("negative leaseDurationSeconds {seconds}")))?,
        ),
        acquire_time: acquire.flatten().or(renew.flatten()).unwrap_or_default(),
        renew_time: renew.flatten().or(acquire.flatten()).unwrap_or_default(),
        leader_transitions: u64::try_from(transitions)
            .map_err(|_| bad(format!("negative leaseTransitions {transitions}")))?
            .max(high_water),
        // The spec's fields (written by the coordinator, or kept by a server with the gate on),
        // else what the annotation keeps for this term.
        strategy: spec
            .strategy
            .filter(|s| s != HANDOVER_STRATEGY)
            .or_else(|| kept.as_ref().and_then(|k| k.strategy.clone())),
        preferred_holder: spec
            .preferred_holder
            .filter(|p| !p.is_empty())
            .or_else(|| kept.and_then(|k| k.preferred_holder)),
        extensions,
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
        lease.map(|lease| self.keep(lease)).transpose()
    }

    /// A Lease created again after a deletion goes on from the highest fencing token this lock
    /// saw in the one deleted, so tokens keep growing for candidates that saw it.
    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let mut record = record.clone();
        let seen = self.highest_token.load(Ordering::Relaxed);
        if seen > 0 && record.leader_transitions <= seen {
            record.leader_transitions = seen + 1;
        }
        let created = self
            .api
            .create(&PostParams::default(), &self.lease(&record, None))
            .await
            .map_err(|err| self.map("create", err))?;
        self.stored(created, &record)
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let Some(base) = self.at_version(version).await? else {
            return Err(LockError::conflict(BACKEND));
        };
        // An acquisition (a term this identity does not hold yet) goes on from the highest
        // token this lock saw, as a create does: another client may have deleted the Lease and
        // created it again with its own count from 0 and without our annotation (S5).
        let stored = record_of(&self.context(), &base)?.record;
        let renewing = stored.is_held_by(&self.identity)
            && stored.leader_transitions == record.leader_transitions;
        let mut record = record.clone();
        let seen = self.highest_token.load(Ordering::Relaxed);
        if record.is_held_by(&self.identity) && !renewing && record.leader_transitions <= seen {
            record.leader_transitions = seen + 1;
        }
        let record = &record;
        let lease = self.lease(record, Some(base));
        // The Lease goes back with the uid it was read with: the API server makes it a
        // precondition, so a Lease deleted (or deleted and created again) since is a conflict,
        // never created afresh under a term that ended with it.
        let replaced = self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
            .map_err(|err| self.map("update", err))?;
        // kube-apiserver answers an update that leaves the Lease as stored with the same
        // resourceVersion and writes nothing (`GuaranteedUpdate`): no renewal (S14).
        LockError::unless_moved(BACKEND, "update", version, self.stored(replaced, record)?)
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

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }

    /// Plain candidates have no one-request acquisition (the elector reads and writes). A
    /// coordinated candidate takes up the Lease only when the coordinator gave it to this
    /// identity (its holder, without the `acquireTime` a take-up writes) and no handover to
    /// another is pending; otherwise it is unassigned.
    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        let Some(coordinated) = &self.coordinated else {
            return Ok(None);
        };
        {
            let mut keeper = coordinated.keeper.lock().unwrap_or_else(|p| p.into_inner());
            if keeper.is_none() {
                *keeper = Some(
                    coordinated
                        .candidate
                        .clone()
                        .keep(coordinated.problem.clone()),
                );
            }
        }
        let problem = coordinated
            .problem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(problem) = problem {
            return Err(problem);
        }
        let current = self.get().await?;
        // The coordinator gives a Lease with no `acquireTime`; a take-up writes one. A Lease
        // of this identity that has one is a term already taken up, maybe by another process
        // given the same identity (S13): not given to this one.
        let fresh = self
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|lease| lease.spec.as_ref())
            .is_some_and(|spec| spec.acquire_time.is_none());
        let given = current.as_ref().filter(|observed| {
            fresh
                && observed.record.holder_identity == self.identity
                && !observed.record.reserved_for_other_than(&self.identity)
        });
        let Some(given) = given else {
            self.note_unassigned(current.as_ref());
            return Ok(Some(Acquisition::Unassigned(current)));
        };
        let mut taken = desired.clone();
        taken.leader_transitions =
            (given.record.leader_transitions + 1).max(desired.leader_transitions);
        taken.strategy = given.record.strategy.clone();
        taken.preferred_holder = None;
        // The stored extensions, not the candidate's (only a holder writes them).
        taken.extensions = given.record.extensions.clone();
        let stored = self.update(&given.version, &taken).await?;
        Ok(Some(Acquisition::Acquired(stored)))
    }

    /// A coordinated lock stops keeping its LeaseCandidate and deletes it.
    async fn close(&self) {
        self.withdraw().await;
    }

    /// A coordinated lock deletes its LeaseCandidate before the release, so that the
    /// coordinator does not give the released Lease back to a candidate that is leaving.
    async fn withdraw(&self) {
        if let Some(coordinated) = &self.coordinated {
            let keeper = coordinated
                .keeper
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if keeper.is_some() {
                drop(keeper);
                coordinated.candidate.withdraw().await;
            }
        }
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let first = self.open_watch().await?;
        let this = self.clone();
        // A Lease watch ends routinely (the server's timeout, a 410 after a compaction): watch
        // again at once, so a release is never missed in between. A watch that ends right away
        // (under 100 ms) counts against a small allowance; once it is spent, or re-watching
        // fails, the stream ends and the elector subscribes again on its own schedule (S9).
        let state = (Some((first, Instant::now())), 0_u32);
        let changes = futures_util::stream::unfold(state, move |(mut current, mut quick)| {
            let this = this.clone();
            async move {
                loop {
                    let (mut events, opened) = match current.take() {
                        Some(open) => open,
                        None => match this.open_watch().await {
                            Ok(events) => (events, Instant::now()),
                            Err(err) => {
                                tracing::debug!(error = %err, "could not watch the Lease again");
                                return None;
                            }
                        },
                    };
                    match events.next().await {
                        Some(WatchOutcome::Released) => {
                            return Some(((), (Some((events, opened)), 0)));
                        }
                        Some(WatchOutcome::Quiet) => current = Some((events, opened)),
                        Some(WatchOutcome::Ended) | None => {
                            if opened.elapsed() < QUICK_WATCH {
                                quick += 1;
                                if quick > QUICK_WATCHES {
                                    return None;
                                }
                            } else {
                                quick = 0;
                            }
                        }
                    }
                }
            }
        });
        Ok(Some(Box::pin(changes)))
    }
}
/// A client whose requests connect and write within `timeout` and read within `read`, counted
/// from when a request is sent, not from when its pooled connection went idle
/// (`reset_reader_on_write`), as kube-rs documents for long-lived clients.
pub(crate) fn client_with_timeouts(
    mut config: kube::Config,
    timeout: Duration,
    read: Duration,
) -> Result<kube::Client, LockError> {
    config.connect_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    config.read_timeout = Some(read);
    config.reset_reader_on_write = true;
    kube::Client::try_from(config).map_err(|err| LockError::Misconfigured {
        backend: BACKEND,
        message: format!("cannot build a Kubernetes client: {err}"),
    })
}
