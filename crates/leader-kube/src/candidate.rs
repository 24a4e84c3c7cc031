//! Coordinated leader election (KEP-4355): the candidate's `coordination.k8s.io/v1beta1`
//! LeaseCandidate, kept as client-go's `leaderelection.LeaseCandidate` keeps it.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1beta1::{LeaseCandidate, LeaseCandidateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, PostParams, WatchEvent, WatchParams};
use leader_core::LockError;
use leader_core::backend::Backoff;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{BACKEND, map_on};
use crate::names::{is_config_map_key, is_qualified_name};
use crate::time::micro;

/// What a candidate announces for coordinated leader election: the strategy the coordinator
/// elects by and the versions it compares.
///
/// Under [`OLDEST_EMULATION_VERSION`](Self::OLDEST_EMULATION_VERSION), the strategy
/// kube-apiserver's coordinator implements, it elects the candidate with the oldest emulation
/// version, then the oldest binary version, then the one that announced itself first; during a
/// rolling upgrade the old version keeps leading until every replica runs the new one. Any other
/// strategy is a qualified name (`example.com/name`) that another controller elects by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coordination {
    strategy: String,
    binary_version: String,
    emulation_version: String,
}

impl Coordination {
    /// The strategy kube-apiserver's coordinator elects by.
    pub const OLDEST_EMULATION_VERSION: &'static str = "OldestEmulationVersion";

    /// Candidacy under [`OLDEST_EMULATION_VERSION`](Self::OLDEST_EMULATION_VERSION), with the
    /// version the binary is (`binary_version`) and the version whose behaviour it keeps
    /// (`emulation_version`, at most `binary_version`; often the same). Both are semantic
    /// versions, such as `1.4.0`.
    pub fn oldest_emulation_version(
        binary_version: impl Into<String>,
        emulation_version: impl Into<String>,
    ) -> Self {
        Self {
            strategy: Self::OLDEST_EMULATION_VERSION.to_owned(),
            binary_version: binary_version.into(),
            emulation_version: emulation_version.into(),
        }
    }

    /// Candidacy under another `strategy`, a qualified name such as `example.com/by-zone`
    /// that a controller of your own elects by; `emulation_version` may be empty.
    pub fn with_strategy(
        strategy: impl Into<String>,
        binary_version: impl Into<String>,
        emulation_version: impl Into<String>,
    ) -> Self {
        Self {
            strategy: strategy.into(),
            binary_version: binary_version.into(),
            emulation_version: emulation_version.into(),
        }
    }

    /// Checks what the API server's validation of a LeaseCandidate would refuse
    /// (`pkg/apis/coordination/validation/validation.go` `ValidateLeaseCandidate`), so that a
    /// bad setting fails when the lock is built rather than at its first request: the identity
    /// names the LeaseCandidate (`IsConfigMapKey`); `binaryVersion` is always required and, like
    /// a set `emulationVersion`, a semantic version as `semver.Parse` reads it (pre-releases and
    /// build metadata allowed), not older than the emulation version by semantic-version
    /// precedence; under `OldestEmulationVersion` an emulation version of `0.0.0` counts as
    /// missing; any other strategy is a qualified name (`example.com/name`).
    pub(crate) fn validate(&self, identity: &str) -> Result<(), LockError> {
        let bad = |message: String| LockError::Misconfigured {
            backend: BACKEND,
            message,
        };
        if !is_config_map_key(identity) {
            return Err(bad(format!(
                "the identity {identity:?} cannot name a LeaseCandidate: use at most 253 letters, digits, '-', '_' or '.'"
            )));
        }
        let version = |field: &str, text: &str| {
            semver::Version::parse(text).map_err(|err| {
                bad(format!(
                    "{field} {text:?} is not a semantic version such as 1.4.0 ({err})"
                ))
            })
        };
        let binary = version("the binary version", &self.binary_version)?;
        let oldest = self.strategy == Self::OLDEST_EMULATION_VERSION;
        let emulation = if self.emulation_version.is_empty() {
            None
        } else {
            Some(version("the emulation version", &self.emulation_version)?)
        };
        if oldest
            && emulation
                .as_ref()
                .is_none_or(|v| *v == semver::Version::new(0, 0, 0))
        {
            return Err(bad(format!(
                "the emulation version {:?} is missing: {} needs one (0.0.0 counts as none)",
                self.emulation_version,
                Self::OLDEST_EMULATION_VERSION
            )));
        }
        if let Some(emulation) = &emulation
            && binary.cmp_precedence(emulation).is_lt()
        {
            return Err(bad(format!(
                "the binary version {} is older than the emulation version {}",
                self.binary_version, self.emulation_version
            )));
        }
        let qualified = self.strategy.contains('/') && is_qualified_name(&self.strategy);
        if !oldest && !qualified {
            return Err(bad(format!(
                "the strategy {:?} is neither {} nor a qualified name such as example.com/name",
                self.strategy,
                Self::OLDEST_EMULATION_VERSION
            )));
        }
        Ok(())
    }
}

/// How often the candidate renews without being asked, as client-go's `requeueInterval`: well
/// within the coordinator's 15 minutes before it calls an election over a stale candidate.
const RENEW_EVERY: Duration = Duration::from_secs(5 * 60);
/// How long the candidate's watch stays open before the server ends it.
const WATCH_SECONDS: u32 = 290;
/// The back-off after a failure, doubling up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// One candidate's LeaseCandidate: named after its identity, naming the Lease.
#[derive(Clone)]
pub(crate) struct Candidate {
    pub(crate) api: Api<LeaseCandidate>,
    /// The same API through the client whose read timeout outlasts a watch.
    pub(crate) watch_api: Api<LeaseCandidate>,
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) lease_name: String,
    pub(crate) coordination: Coordination,
}

impl fmt::Debug for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Candidate")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("lease_name", &self.lease_name)
            .field("coordination", &self.coordination)
            .finish_non_exhaustive()
    }
}

/// Where the keeper leaves a failure for the elector: taken by the next attempt.
pub(crate) type Problem = Arc<Mutex<Option<LockError>>>;

/// The task keeping a candidate, stopped when dropped.
#[derive(Debug)]
pub(crate) struct Keeper(JoinHandle<()>);

impl Drop for Keeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Candidate {
    fn context(&self) -> String {
        format!("lease candidate {}/{}", self.namespace, self.name)
    }

    fn map(&self, verb: &str, err: kube::Error) -> LockError {
        map_on("leasecandidates", &self.context(), verb, err)
    }

    /// Starts keeping the LeaseCandidate in the background: created or renewed at once, renewed
    /// every [`RENEW_EVERY`] and whenever the coordinator pings it, created again if deleted.
    /// A failure that needs a person (a denied verb, LeaseCandidates not served) is left in
    /// `problem` for the elector to report.
    pub(crate) fn keep(self, problem: Problem) -> Keeper {
        Keeper(tokio::spawn(async move {
            let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
            loop {
                let started = Instant::now();
                let served = self.serve().await;
                // The watch ended as watches do: again at once, unless that keeps happening.
                if served.is_ok() && started.elapsed() >= FIRST_BACKOFF {
                    backoff.succeeded();
                    continue;
                }
                let wait = backoff.failed();
                match served {
                    Ok(()) => {}
                    Err(err @ (LockError::Forbidden { .. } | LockError::Misconfigured { .. })) => {
                        *problem.lock().unwrap_or_else(|p| p.into_inner()) = Some(err);
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, retry_in = ?wait, "could not keep the lease candidate");
                    }
                }
                tokio::time::sleep(wait).await;
            }
        }))
    }

    /// Renews the candidate, then answers pings from a watch of it until the watch ends.
    async fn serve(&self) -> Result<(), LockError> {
        let version = self.renew().await?;
        let params = WatchParams::default()
            .fields(&format!("metadata.name={}", self.name))
            .timeout(WATCH_SECONDS);
        let mut events = self
            .watch_api
            .watch(&params, &version)
            .await
            .map_err(|err| self.map("watch", err))?
            .boxed();
        let mut renew_at = Instant::now() + RENEW_EVERY;
        loop {
            let event = tokio::select! {
                () = tokio::time::sleep_until(renew_at) => {
                    self.renew().await?;
                    renew_at = Instant::now() + RENEW_EVERY;
                    continue;
                }
                event = events.next() => event,
            };
            match event {
                Some(Ok(WatchEvent::Modified(candidate))) if pinged(&candidate) => {
                    self.renew().await?;
                    renew_at = Instant::now() + RENEW_EVERY;
                }
                // Deleted (the coordinator's garbage collection, a person): create it again.
                Some(Ok(WatchEvent::Deleted(_) | WatchEvent::Error(_))) | None => return Ok(()),
                Some(Err(err)) => return Err(self.map("watch", err)),
                Some(Ok(_)) => {}
            }
        }
    }

    /// Creates the LeaseCandidate, or renews it (`renewTime` now, the announced versions and
    /// strategy) with its `resourceVersion` as precondition; returns the version written.
    async fn renew(&self) -> Result<String, LockError> {
        // A conflict means the coordinator wrote in between (a ping): read and try again.
        for _ in 0..5 {
            let current = self
                .api
                .get_opt(&self.name)
                .await
                .map_err(|err| self.map("get", err))?;
            let written = match current {
                None => {
                    let candidate = LeaseCandidate {
                        metadata: ObjectMeta {
                            name: Some(self.name.clone()),
                            namespace: Some(self.namespace.clone()),
                            ..ObjectMeta::default()
                        },
                        spec: Some(self.spec(None)),
                    };
                    self.api
                        .create(&PostParams::default(), &candidate)
                        .await
                        .map_err(|err| self.map("create", err))
                }
                Some(mut candidate) => {
                    let named = candidate.spec.as_ref().map(|s| s.lease_name.as_str());
                    if named.is_some_and(|lease| lease != self.lease_name) {
                        return Err(LockError::Misconfigured {
                            backend: BACKEND,
                            message: format!(
                                "{}: it is the candidate for Lease {:?}, not {:?}: give the candidates of each Lease identities of their own",
                                self.context(),
                                named.unwrap_or_default(),
                                self.lease_name
                            ),
                        });
                    }
                    candidate.spec = Some(self.spec(candidate.spec.take()));
                    candidate.metadata.managed_fields = None;
                    self.api
                        .replace(&self.name, &PostParams::default(), &candidate)
                        .await
                        .map_err(|err| self.map("update", err))
                }
            };
            match written {
                Ok(candidate) => {
                    return Ok(candidate.metadata.resource_version.unwrap_or_default());
                }
                Err(err) if err.is_conflict() => {}
                Err(err) => return Err(err),
            }
        }
        Err(LockError::unavailable(
            BACKEND,
            format!("{}: renewals kept conflicting", self.context()),
        ))
    }

    /// The spec this candidate announces, over `old` (keeping the coordinator's `pingTime`).
    fn spec(&self, old: Option<LeaseCandidateSpec>) -> LeaseCandidateSpec {
        let coordination = &self.coordination;
        LeaseCandidateSpec {
            lease_name: self.lease_name.clone(),
            binary_version: coordination.binary_version.clone(),
            emulation_version: Some(coordination.emulation_version.clone())
                .filter(|v| !v.is_empty()),
            strategy: coordination.strategy.clone(),
            ping_time: old.and_then(|old| old.ping_time),
            renew_time: Some(micro(Utc::now())),
        }
    }

    /// Deletes the LeaseCandidate, so that the coordinator stops considering a candidate that
    /// is gone. Best effort.
    pub(crate) async fn withdraw(&self) {
        let deleted = self.api.delete(&self.name, &DeleteParams::default()).await;
        if let Err(err) = deleted {
            let err = self.map("delete", err);
            if !matches!(err, LockError::Misconfigured { .. }) {
                tracing::debug!(error = %err, "could not delete the lease candidate");
            }
        }
    }
}

/// Whether the coordinator asked this candidate to answer: a `pingTime` after its `renewTime`.
fn pinged(candidate: &LeaseCandidate) -> bool {
    candidate
        .spec
        .as_ref()
        .is_some_and(|spec| match (&spec.ping_time, &spec.renew_time) {
            (Some(ping), Some(renew)) => ping.0 > renew.0,
            (Some(_), None) => true,
            _ => false,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_the_api_server_would_refuse_fail_early() {
        let ok = Coordination::oldest_emulation_version("1.4.0", "1.3.0");
        assert!(ok.validate("pod-1_a.b").is_ok());
        assert!(ok.validate("pod/1").is_err());
        assert!(ok.validate("").is_err());
        for (binary, emulation) in [("1.4", "1.4.0"), ("1.4.0", ""), ("1.3.0", "1.4.0")] {
            let bad = Coordination::oldest_emulation_version(binary, emulation);
            assert!(bad.validate("a").is_err(), "{binary} {emulation}");
        }
        let own = Coordination::with_strategy("example.com/by-zone", "2.0.0", "");
        assert!(own.validate("a").is_ok());
        let unknown = Coordination::with_strategy("Newest", "2.0.0", "");
        assert!(unknown.validate("a").is_err());
    }

    #[test]
    fn versions_are_read_and_ordered_as_semantic_versions() {
        let ok = |binary: &str, emulation: &str| {
            Coordination::oldest_emulation_version(binary, emulation)
                .validate("a")
                .is_ok()
        };
        assert!(ok("1.0.0+build-1", "1.0.0"));
        assert!(ok("1.0.0", "1.0.0+build-1"));
        assert!(ok("1.10.0", "1.9.0"));
        assert!(ok("1.0.0-rc.10", "1.0.0-rc.2"));
        assert!(!ok("1.0.0-rc.2", "1.0.0-rc.10"));
        assert!(!ok("1.0.0-rc.1", "1.0.0"));
        assert!(!ok("1.0.0", "0.0.0"));
        assert!(!ok("01.2.3", "1.0.0"));
        assert!(!ok("1.2.3.4", "1.0.0"));
        assert!(!ok("", "1.0.0"));
        let own = |strategy: &str, binary: &str| {
            Coordination::with_strategy(strategy, binary, "")
                .validate("a")
                .is_ok()
        };
        assert!(own("example.com/by-zone", "2.0.0"));
        assert!(!own("example.com/by-zone", ""));
        for strategy in [
            "example.com/-x",
            "Example.com/x",
            "a/b/c",
            "/x",
            "example.com/",
        ] {
            assert!(!own(strategy, "2.0.0"), "{strategy}");
        }
    }
}
