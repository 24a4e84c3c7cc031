//! The leader's own Pod labelled while it leads, so that a Service selecting the label sends
//! traffic to the leader only.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use leader_core::backend::{Backoff, Jitter};
use leader_core::{Leadership, LockError};

use crate::error::BACKEND;
use crate::lock::client_with_timeouts;
use crate::names;

mod term;

use term::{Alone, Term, Watched};

/// The label key [`PodLabel`] writes unless told otherwise; its value is the election's name.
pub const POD_LABEL: &str = "leader-rs.io/leader";

/// How long a term's end waits for the label's removal by default.
const DEFAULT_REMOVAL_TIMEOUT: Duration = Duration::from_secs(1);

/// How long one watch of the labelled Pods lasts before the server ends it (and a list
/// starts the next): below kube-apiserver's own cap on a watch's `timeoutSeconds`.
const WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// The label on the leader's own Pod (`leader-rs.io/leader: ELECTION` by default), for a
/// Service whose selector includes it: traffic goes to the leader only, while every replica
/// stays ready (so rolling updates go on; see the `leader` command's README for the
/// trade-off against readiness that follows leadership).
///
/// Each label carries its term: the annotation of the label's key (`leader-rs.io/leader:
/// "7"`) holds the fencing token of the term that wrote it. Each write is a merge patch
/// conditional on the Pod's `resourceVersion` as read (the API server answers 409 once the
/// Pod changed), and goes out only while the term's renew deadline has not passed (checked
/// after each read and before each write).
///
/// [`hold`](Self::hold) runs for one term, as a task
/// [`beside_work`](leader_core::LeaderElectorBuilder::beside_work): it does not keep the term,
/// so the term still ends when the work returns (as an `on_started_leading` callback it would
/// keep the lease and the label after the work had returned):
///
/// 1. Once leadership is acquired, it removes the label from every other Pod of the namespace
///    that still carries it (a leader that crashed, or whose removal failed, left it), then
///    labels its own Pod with its term. A label whose term is not earlier than this one, read
///    while this term is still renewed, is not a later term's (a later term begins only after
///    this term's renew deadline, S2 and S3): fencing tokens that restarted (a Lease deleted
///    while no candidate saw it) or another election with the same label; it is removed too,
///    so that it never keeps the leader's Pod unlabelled. A label without a term (an earlier
///    release's, or one set by hand) counts as an ended term's. A request that fails is tried
///    again, backing off from the retry period, while the term lasts; the term itself never
///    waits for the label.
/// 2. For the rest of the term it watches the Pods that carry the label: one that gains it (an
///    earlier leader's write applied late: a request delayed, a process frozen and resumed) is
///    cleared as soon as the watch reports it, and its own Pod labelled again if someone
///    removed the label. A watch that ends is followed by a list and a new watch.
/// 3. When the term ends, it removes the label from its own Pod (unless a later term wrote it)
///    before the term's work counts as stopped: the elector releases the lease only after that
///    (S6), so the next leader, which labels its Pod only after it acquired the lease, finds
///    this Pod clear. A removal that fails or does not answer within the removal timeout
///    (default 1 s, kept below the elector's stop grace) is abandoned: the release waits that
///    long at most, the end of the term (the work's cancellation) not at all, and the next
///    leader removes the label before it labels its own Pod.
///
/// A leader whose term ended without its knowing (its process, or the runtime running its
/// elector, frozen past the renew deadline and resumed) writes nothing more but the removal of
/// its own Pod's label at the term's end: it finds the deadline passed before its next write. A
/// request sent before the deadline that reaches the API server after the next term began can
/// still land: a removal then fails (409) if the Pod was labelled since, so no late write
/// removes the current term's label; a label of its own Pod lands beside the current
/// leader's. So, through the election's writes, at most one Pod carries the label, except after
/// a label write that a leader sent before its term's renew deadline and that the API server
/// applied once the next term had begun: then two Pods carry it until the current leader's
/// watch (or its next list) reports the late one and removes it. Between terms the Service may
/// have no endpoint.
///
/// The label is routing, not fencing: endpoints follow it after the EndpointSlice controller
/// and the proxies catch up, so for a moment after a change (and for a late write, until the
/// watch reports it) a Service can still send new connections to the previous Pod; connections
/// already established keep going to it (kube-proxy clears conntrack entries for UDP only).
/// Guard the leader's writes with its fencing token.
///
/// RBAC: `list`, `watch` and `patch` on `pods` in the namespace (`deploy/kubernetes/rbac-pod-label.yaml`;
/// a Role cannot narrow `patch` to the Pods of one Deployment, whose names are generated).
/// Without `list` it never labels its Pod (it cannot make sure no other carries the label),
/// and says so.
#[derive(Clone)]
pub struct PodLabel {
    api: Api<Pod>,
    /// For watches, which outlast a request's read timeout.
    watch_api: Api<Pod>,
    namespace: String,
    pod: String,
    key: String,
    value: String,
    retry: Duration,
    removal_timeout: Duration,
}

impl fmt::Debug for PodLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PodLabel")
            .field("pod", &format_args!("{}/{}", self.namespace, self.pod))
            .field("label", &self.selector())
            .field("removal_timeout", &self.removal_timeout)
            .finish_non_exhaustive()
    }
}

impl PodLabel {
    /// The label `leader-rs.io/leader: ELECTION` on the Pod `pod` in `namespace`.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] when the namespace, the Pod name or the election's name
    /// (the label's value: at most 63 characters) would be refused by the API server.
    pub fn new(
        client: kube::Client,
        namespace: impl Into<String>,
        pod: impl Into<String>,
        election: impl Into<String>,
    ) -> Result<Self, LockError> {
        let (namespace, pod) = (namespace.into(), pod.into());
        if !names::is_dns_label(&namespace) || !names::is_dns_subdomain(&pod) {
            return Err(misconfigured(format!(
                "pod {namespace}/{pod}: not a namespace and a Pod name the API server accepts"
            )));
        }
        Self {
            api: Api::namespaced(client.clone(), &namespace),
            watch_api: Api::namespaced(client, &namespace),
            namespace,
            pod,
            key: String::new(),
            value: String::new(),
            retry: Duration::from_secs(2),
            removal_timeout: DEFAULT_REMOVAL_TIMEOUT,
        }
        .label(POD_LABEL, election)
    }

    /// The label of this replica's Pod from the downward API (`POD_NAME`, and `POD_NAMESPACE`
    /// or the configuration's namespace), with a client from the environment (in-cluster, else
    /// the kubeconfig) whose requests answer within `timeout` (such as
    /// [`DEFAULT_REQUEST_TIMEOUT`](crate::DEFAULT_REQUEST_TIMEOUT)).
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] without `POD_NAME` or a Kubernetes configuration, or as
    /// [`new`](Self::new).
    pub async fn from_env(
        election: impl Into<String>,
        timeout: Duration,
    ) -> Result<Self, LockError> {
        let pod = std::env::var("POD_NAME").map_err(|_| {
            misconfigured(
                "labelling the leader's Pod needs its name in POD_NAME (the downward API's \
                 fieldRef metadata.name)",
            )
        })?;
        let config = kube::Config::infer().await.map_err(|err| {
            misconfigured(format!(
                "no Kubernetes configuration (in-cluster or kubeconfig): {err}"
            ))
        })?;
        let namespace =
            std::env::var("POD_NAMESPACE").unwrap_or_else(|_| config.default_namespace.clone());
        let client = client_with_timeouts(config.clone(), timeout, timeout)?;
        let watch_client = client_with_timeouts(config, timeout, WATCH_TIMEOUT + timeout)?;
        let mut label = Self::new(client, namespace, pod, election)?;
        label.watch_api = Api::namespaced(watch_client, &label.namespace);
        Ok(label)
    }

    /// Refuses a key that reads as a switch (`true`, `1`, `on`, ...): `leader run
    /// --label-pod=KEY` and `LEADER_LABEL_POD` name the label's key, and `LEADER_LABEL_POD=true`
    /// copied from an on/off setting would label Pods `true=NAME`, which no Service selects.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] naming the key and what to write instead.
    pub fn check_key(key: &str) -> Result<(), LockError> {
        const SWITCHES: [&str; 8] = ["true", "false", "yes", "no", "on", "off", "1", "0"];
        if SWITCHES.contains(&key.to_ascii_lowercase().as_str()) {
            return Err(misconfigured(format!(
                "{key:?} is a switch, not a label key: LEADER_LABEL_POD (and --label-pod=KEY) \
                 names the key of the label the leader's Pod gets, such as {POD_LABEL}"
            )));
        }
        Ok(())
    }

    /// Writes `key: value` instead (for a Pod that takes part in two elections, say).
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] when the API server would refuse the key (a qualified
    /// name) or the value (at most 63 letters, digits, `-`, `_` and `.`).
    pub fn label(
        mut self,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<Self, LockError> {
        let (key, value) = (key.into(), value.into());
        Self::check_key(&key)?;
        if !names::is_qualified_name(&key) {
            return Err(misconfigured(format!(
                "{key:?} is not a label key the API server accepts (a qualified name such as \
                 example.com/leader)"
            )));
        }
        if !names::is_label_value(&value) || value.is_empty() {
            return Err(misconfigured(format!(
                "{value:?} is not a label value the API server accepts (1 to 63 letters, \
                 digits, '-', '_' and '.', starting and ending with a letter or digit); name \
                 the value the label should have"
            )));
        }
        self.key = key;
        self.value = value;
        Ok(self)
    }

    /// The base wait between failed attempts to label the Pod while leading (default 2 s,
    /// doubling up to eight times that).
    #[must_use]
    pub fn retry(mut self, retry: Duration) -> Self {
        self.retry = retry;
        self
    }

    /// How long the end of a term waits for the label's removal (default 1 s). Keep it well
    /// below the elector's stop grace: the lease is released only after it.
    #[must_use]
    pub fn removal_timeout(mut self, timeout: Duration) -> Self {
        self.removal_timeout = timeout;
        self
    }

    /// The label selector of the labelled Pod, `KEY=VALUE`, for a Service's selector or
    /// `kubectl get pods -l`.
    pub fn selector(&self) -> String {
        format!("{}={}", self.key, self.value)
    }

    /// Holds the label for the term of `leadership`: clears the labels of ended terms from
    /// other Pods, labels this one, and removes the label when the term ends (see the type's
    /// documentation). Returns once the term has ended and the removal is done or abandoned; it
    /// never fails, and says what went wrong in `tracing` warnings.
    pub async fn hold(&self, leadership: Leadership) {
        let term = Term::new(self, &leadership);
        let token = leadership.fencing_token();
        let mut sent = false;
        // Failed requests wait the retry period, doubling up to eight times it, each up to a
        // fifth longer so that nothing retries in lockstep.
        let mut backoff =
            Backoff::new(self.retry, self.retry.saturating_mul(8)).jitter(Jitter::Longer(0.2));
        // The label is announced once, and again once it is back after failures.
        let mut announce = true;
        let _ = leadership
            .run(async {
                loop {
                    let watched = Instant::now();
                    let over = match term.alone(&mut sent).await {
                        Ok(Alone::Labelled(version)) => {
                            backoff.succeeded();
                            if announce {
                                tracing::info!(
                                    pod = %self.pod,
                                    label = %self.selector(),
                                    fencing_token = token,
                                    "labelled this Pod as the leader's"
                                );
                                announce = false;
                            }
                            match term.keep_alone(&version).await {
                                Ok(Watched::Again) => false,
                                Ok(Watched::Over) => true,
                                Err(err) => {
                                    tracing::debug!(error = %err, "the watch of labelled Pods ended");
                                    false
                                }
                            }
                        }
                        Ok(Alone::Over) => true,
                        // A Pod changed between its read and the write: read again.
                        Err((_, err)) if err.is_conflict() => false,
                        Err((what, err)) => {
                            let wait = backoff.failed();
                            announce = true;
                            self.warn(what, &err, wait);
                            tokio::time::sleep(wait).await;
                            continue;
                        }
                    };
                    if over {
                        term.stand_aside().await;
                    }
                    // A watch that ends at once (a server that refuses it) is not opened
                    // again at once, nor is a write that conflicts tried again at once.
                    if watched.elapsed() < self.retry {
                        tokio::time::sleep(backoff.wait_after(0)).await;
                    }
                }
            })
            .await;
        leadership.lost().await;
        if !sent {
            return;
        }
        match tokio::time::timeout(self.removal_timeout, term.clear_own()).await {
            Ok(Ok(true)) => tracing::info!(
                pod = %self.pod,
                label = %self.selector(),
                fencing_token = token,
                "removed the leader's label from this Pod"
            ),
            Ok(Ok(false)) => tracing::debug!(
                pod = %self.pod,
                "this Pod no longer carried this term's label"
            ),
            Ok(Err(err)) => tracing::warn!(
                pod = %self.pod,
                error = %err,
                "could not remove the leader's label from this Pod; the next leader removes it before labelling its own"
            ),
            Err(_) => tracing::warn!(
                pod = %self.pod,
                timeout = ?self.removal_timeout,
                "the leader's label was not removed from this Pod in time; the next leader removes it before labelling its own"
            ),
        }
        // Held until here: the elector releases the lease only once the removal is over.
        drop(leadership);
    }

    fn warn(&self, what: &str, err: &LockError, retry_in: Duration) {
        tracing::warn!(
            pod = %self.pod,
            label = %self.selector(),
            error = %err,
            ?retry_in,
            "could not {what} the leader's Pod label; this Pod is not labelled yet"
        );
    }

    fn map(&self, verb: &str, err: kube::Error) -> LockError {
        let context = format!("pods in {} (label {})", self.namespace, self.selector());
        match err {
            kube::Error::Api(status) if status.is_forbidden() => LockError::Forbidden {
                backend: BACKEND,
                message: format!(
                    "{context}: {}; grant this service account the verbs list, watch and patch \
                     on pods in {} (kubectl create role leader-pod-label -n {} \
                     --verb=list,watch,patch --resource=pods, and a RoleBinding to it)",
                    status.message, self.namespace, self.namespace
                ),
            },
            kube::Error::Api(status) if status.is_not_found() => misconfigured(format!(
                "{context}: {} (is POD_NAME this Pod's name, and POD_NAMESPACE its namespace?)",
                status.message
            )),
            other => crate::error::map_on("pods", &context, verb, other),
        }
    }
}

fn misconfigured(message: impl Into<String>) -> LockError {
    LockError::Misconfigured {
        backend: BACKEND,
        message: message.into(),
    }
}
