//! The lock: one `coordination.k8s.io/v1` Lease, in client-go's layout. Making it is in
//! `lock/build.rs`, a record as a Lease and back in `lock/codec.rs`, the Lease's watch in
//! `lock/watch.rs`; this file holds the lock and its `ResourceLock` face.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::Utc;
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Api, PostParams};
use leader_core::backend::HolderCheck;
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LeaderEvent, LockError, Observed,
    ResourceLock, Version,
};

use crate::candidate::{Candidate, Keeper, Problem};
use crate::error::BACKEND;
use crate::time::micro;

mod build;
mod codec;
mod watch;

use codec::record_of;
pub use codec::{COORDINATION_ANNOTATION, EXTENSIONS_ANNOTATION, HANDOVER_STRATEGY};
use watch::{QUICK_WATCH, QUICK_WATCHES, WatchOutcome};

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

    /// Forgets the wait for a coordinator once the Lease has a holder given by one (this
    /// candidate's term, taken up or taken back): a later free Lease starts the wait anew.
    fn note_assigned(&self) {
        if let Some(coordinated) = &self.coordinated {
            *coordinated
                .unassigned_since
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = None;
        }
    }
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
        leader_core::backend::unless_moved(
            BACKEND,
            "update",
            version,
            self.stored(replaced, record)?,
        )
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
    /// another is pending. A Lease this identity already took up is held (the elector decides
    /// as for any holder); any other is unassigned.
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
        // The coordinator gives a Lease with no `acquireTime`; a take-up writes one.
        let fresh = self
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|lease| lease.spec.as_ref())
            .is_some_and(|spec| spec.acquire_time.is_none());
        let Some(given) = current
            .as_ref()
            .filter(|observed| observed.record.holder_identity == self.identity)
        else {
            self.note_unassigned(current.as_ref());
            return Ok(Some(Acquisition::Unassigned(current)));
        };
        // A Lease of this identity already taken up is a term: this process's own, or
        // another's given the same identity (S13). The elector judges it as any holder's: its
        // own term it takes again at once, another's only once it stayed unrenewed for a
        // lease. Never unassigned: the coordinator elects an expired holder again without
        // writing (`reconcileElectionStep` writes a holder only to a Lease with none, or an
        // expired one going to another identity), so a holder whose term lapsed (renewals
        // failed past the deadline, a process restarted under its Pod name) would wait for a
        // Lease never given anew, and nobody would lead.
        self.note_assigned();
        if !fresh {
            return Ok(Some(Acquisition::Held {
                observed: given.clone(),
                expires_in: None,
                renewed_in_store: false,
            }));
        }
        if given.record.reserved_for_other_than(&self.identity) {
            self.note_unassigned(current.as_ref());
            return Ok(Some(Acquisition::Unassigned(current)));
        }
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

    /// A coordinated lock's Leases are the coordinator's to give ([`HolderCheck::Assigned`]);
    /// any other has no one-request acquisition.
    fn holder_check(&self) -> HolderCheck {
        if self.coordinated.is_some() {
            HolderCheck::Assigned
        } else {
            HolderCheck::Record
        }
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
    // kube-rs retries 429, 503 and 504 by default up to 15 times from 5 ms, doubling
    // (`RetryPolicy::server_retry`): some ten requests within a request timeout for each one
    // the lock sends, per replica and per shard, at an API server that is shedding load. The
    // elector retries after its retry period and backs off while failures last (S9).
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|err| LockError::Misconfigured {
        backend: BACKEND,
        message: format!("cannot build a Kubernetes client: {err}"),
    })
}
