//! The label writes of one term. Each label carries its term: the annotation of the label's
//! key holds the term's fencing token. A write goes out only while the term's renew deadline
//! has not passed, each is a merge patch conditional on the Pod's `resourceVersion` as read
//! (409 once the Pod changed), and each is decided on the term found there: no write removes
//! the label of a term that has not ended.

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams, WatchEvent, WatchParams};
use leader_core::{Leadership, LockError, TermDeadline};
use serde_json::json;

use super::{PodLabel, WATCH_TIMEOUT, misconfigured};
use crate::error::BACKEND;

/// One term's writes of the label.
pub(super) struct Term<'a> {
    label: &'a PodLabel,
    token: u64,
    deadline: TermDeadline,
}

/// What [`Term::alone`] did.
#[derive(Debug)]
pub(super) enum Alone {
    /// This Pod alone carries the label; the watch goes on from this list's `resourceVersion`.
    Labelled(String),
    /// Nothing more: the term's renew deadline has passed.
    Over,
}

/// Why [`Term::keep_alone`] returned.
#[derive(Debug)]
pub(super) enum Watched {
    /// The watch ended, or this Pod's label needs writing again.
    Again,
    /// The term's renew deadline has passed: no more writes.
    Over,
}

/// Whose a labelled Pod's label is, by the term written beside it.
#[derive(Debug, PartialEq, Eq)]
enum Stamp {
    /// This term's, on this Pod.
    This,
    /// An earlier term's, or a label without a term that reads as one (an earlier release's,
    /// or one set by hand).
    Ended,
    /// A term not earlier than this one: a later term, or (on another Pod) this term's token.
    Later(u64),
}

impl<'a> Term<'a> {
    pub(super) fn new(label: &'a PodLabel, leadership: &Leadership) -> Self {
        Self {
            label,
            token: leadership.fencing_token(),
            deadline: leadership.deadline(),
        }
    }

    /// Removes the label from every other Pod that carries it, then labels this Pod with this
    /// term (once a label write went out, `sent` is true).
    pub(super) async fn alone(&self, sent: &mut bool) -> Result<Alone, (&'static str, LockError)> {
        let selected = self
            .label
            .api
            .list(&ListParams::default().labels(&self.label.selector()))
            .await
            .map_err(|err| ("clear", self.label.map("list", err)))?;
        if self.ended() {
            return Ok(Alone::Over);
        }
        // This Pod's resourceVersion when it carries a label to write over.
        let mut own: Option<String> = None;
        let mut labelled = false;
        let mut stale = Vec::new();
        for pod in &selected.items {
            let Some(name) = pod.metadata.name.as_deref() else {
                continue;
            };
            let is_own = name == self.label.pod;
            match self.stamp(pod, is_own) {
                Stamp::This => labelled = true,
                stamp => {
                    if let Stamp::Later(term) = stamp {
                        self.not_a_later_term(name, term);
                    }
                    if is_own {
                        own = Some(version(pod).map_err(|err| ("label", err))?.to_owned());
                    } else {
                        stale.push(pod);
                    }
                }
            }
        }
        for pod in stale {
            if self.ended() {
                return Ok(Alone::Over);
            }
            let name = pod.metadata.name.as_deref().unwrap_or_default();
            tracing::info!(pod = %name, label = %self.label.selector(), "removing the label of a term that has ended");
            let version = version(pod).map_err(|err| ("clear", err))?;
            self.write(name, version, false)
                .await
                .map_err(|err| ("clear", err))?;
        }
        if !labelled {
            let at = match own {
                Some(at) => at,
                None => self
                    .read_own()
                    .await
                    .and_then(|pod| pod.ok_or_else(|| self.own_missing()))
                    .and_then(|pod| version(&pod).map(str::to_owned))
                    .map_err(|err| ("label", err))?,
            };
            if self.ended() {
                return Ok(Alone::Over);
            }
            *sent = true;
            self.write(&self.label.pod, &at, true)
                .await
                .map_err(|err| ("label", err))?;
        }
        Ok(Alone::Labelled(
            selected.metadata.resource_version.unwrap_or_default(),
        ))
    }

    /// Watches the labelled Pods from the `resourceVersion` `from` until the watch ends:
    /// removes the label from any other Pod that gains it; returns when this Pod's label needs
    /// writing again, or once the term's renew deadline has passed.
    pub(super) async fn keep_alone(&self, from: &str) -> Result<Watched, LockError> {
        let seconds = u32::try_from(WATCH_TIMEOUT.as_secs()).unwrap_or(290);
        let params = WatchParams::default()
            .labels(&self.label.selector())
            .timeout(seconds);
        let mut events = self
            .label
            .watch_api
            .watch(&params, from)
            .await
            .map_err(|err| self.label.map("watch", err))?
            .boxed();
        while let Some(event) = events.next().await {
            let pod = match event.map_err(|err| self.label.map("watch", err))? {
                WatchEvent::Added(pod) | WatchEvent::Modified(pod) => pod,
                WatchEvent::Deleted(pod)
                    if pod.metadata.name.as_deref() == Some(&self.label.pod) =>
                {
                    return Ok(Watched::Again);
                }
                // 410 Gone and other errors: a list starts over.
                WatchEvent::Error(_) => return Ok(Watched::Again),
                WatchEvent::Deleted(_) | WatchEvent::Bookmark(_) => continue,
            };
            if self.ended() {
                return Ok(Watched::Over);
            }
            let name = pod.metadata.name.clone().unwrap_or_default();
            let is_own = name == self.label.pod;
            match self.stamp(&pod, is_own) {
                Stamp::This => continue,
                _ if is_own => return Ok(Watched::Again),
                Stamp::Later(term) => self.not_a_later_term(&name, term),
                Stamp::Ended => tracing::warn!(
                    pod = %name,
                    label = %self.label.selector(),
                    "another Pod gained the label of a term that has ended (an earlier leader's write that landed late?); removing it"
                ),
            }
            match self.write(&name, version(&pod)?, false).await {
                // The Pod changed since this event: the watch reports how, and that decides.
                Err(err) if err.is_conflict() => {}
                other => other?,
            }
        }
        Ok(Watched::Again)
    }

    /// Writes nothing more in this term, whose renew deadline has passed (the elector has not
    /// run since to cancel it: a process or an elector frozen and resumed). Completes only
    /// when the term's work is dropped.
    pub(super) async fn stand_aside(&self) {
        tracing::warn!(
            pod = %self.label.pod,
            label = %self.label.selector(),
            fencing_token = self.token,
            "this term's renew deadline has passed before the elector ended it: no more label writes in it; the next leader labels its own Pod"
        );
        std::future::pending::<()>().await;
    }

    /// Removes this Pod's label unless a later term wrote it; true when it removed one.
    pub(super) async fn clear_own(&self) -> Result<bool, LockError> {
        loop {
            let Some(pod) = self.read_own().await? else {
                return Ok(false);
            };
            if !self.carries_label(&pod) || matches!(self.stamp(&pod, true), Stamp::Later(_)) {
                return Ok(false);
            }
            match self.write(&self.label.pod, version(&pod)?, false).await {
                // Changed since the read: read it again.
                Err(err) if err.is_conflict() => {}
                other => return other.map(|()| true),
            }
        }
    }

    /// True once this term's renew deadline has passed: it has ended, or will as soon as the
    /// elector runs, and another may have begun (S2, S3). Checked after each read and before
    /// each write: so a label found there, read while this term was still renewed, cannot be
    /// a later term's, which begins only after that deadline.
    fn ended(&self) -> bool {
        std::time::Instant::now() >= self.deadline.get()
    }

    fn not_a_later_term(&self, pod: &str, term: u64) {
        tracing::warn!(
            pod = %pod,
            label = %self.label.selector(),
            term,
            fencing_token = self.token,
            "a Pod carries the label with a term not earlier than this one while this term is still renewed: not a later term of this election (fencing tokens that restarted, or another election with the same label); removing it"
        );
    }

    fn stamp(&self, pod: &Pod, is_own: bool) -> Stamp {
        stamp(pod, &self.label.key, self.token, is_own)
    }

    fn carries_label(&self, pod: &Pod) -> bool {
        pod.metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(&self.label.key))
            == Some(&self.label.value)
    }

    /// This Pod as stored (a list by name: the rights granted on Pods are list, watch and
    /// patch), or `None` when it is gone.
    async fn read_own(&self) -> Result<Option<Pod>, LockError> {
        let by_name = ListParams::default().fields(&format!("metadata.name={}", self.label.pod));
        let list = self
            .label
            .api
            .list(&by_name)
            .await
            .map_err(|err| self.label.map("list", err))?;
        Ok(list.items.into_iter().next())
    }

    fn own_missing(&self) -> LockError {
        misconfigured(format!(
            "pod {}/{} not found (is POD_NAME this Pod's name, and POD_NAMESPACE its namespace?)",
            self.label.namespace, self.label.pod
        ))
    }

    /// Sets (with this term) or removes the label of `pod`, if it is still at `version`.
    async fn write(&self, pod: &str, version: &str, set: bool) -> Result<(), LockError> {
        let key = &self.label.key;
        let (value, term) = if set {
            (Some(self.label.value.clone()), Some(self.token.to_string()))
        } else {
            (None, None)
        };
        // A merge patch: `null` removes a key, and `resourceVersion` is a precondition.
        let patch = json!({"metadata": {
            "resourceVersion": version,
            "labels": {key: value},
            "annotations": {key: term},
        }});
        match self
            .label
            .api
            .patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            // A Pod that is gone carries no label.
            Err(kube::Error::Api(status)) if status.is_not_found() && !set => Ok(()),
            Err(err) => Err(self.label.map("patch", err)),
        }
    }
}

/// Whose label `pod` (a Pod the label's selector selects, this Pod when `is_own`) carries, by
/// the term in its annotation `key`, for the term whose fencing token is `token`.
fn stamp(pod: &Pod, key: &str, token: u64, is_own: bool) -> Stamp {
    let term = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(key))
        .and_then(|term| term.parse::<u64>().ok());
    match term {
        Some(term) if is_own && term == token => Stamp::This,
        Some(term) if term > token || (term == token && !is_own) => Stamp::Later(term),
        _ => Stamp::Ended,
    }
}

/// The `resourceVersion` of `pod`, which every write is conditional on.
fn version(pod: &Pod) -> Result<&str, LockError> {
    pod.metadata
        .resource_version
        .as_deref()
        .filter(|version| !version.is_empty())
        .ok_or_else(|| {
            LockError::other(
                BACKEND,
                format!(
                    "pod {} came without a resourceVersion: no write can be made conditional on it",
                    pod.metadata.name.as_deref().unwrap_or_default()
                ),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(term: Option<&str>) -> Pod {
        let annotations = term.map(|term| [("leader-rs.io/leader".to_owned(), term.to_owned())]);
        let mut pod = Pod::default();
        pod.metadata.annotations = annotations.map(Into::into);
        pod
    }

    #[test]
    fn a_label_is_of_the_term_written_beside_it() {
        let key = "leader-rs.io/leader";
        for (term, is_own, expected) in [
            (Some("7"), true, Stamp::This),
            (Some("7"), false, Stamp::Later(7)),
            (Some("8"), true, Stamp::Later(8)),
            (Some("8"), false, Stamp::Later(8)),
            (Some("6"), true, Stamp::Ended),
            (Some("6"), false, Stamp::Ended),
            (Some("18446744073709551615"), false, Stamp::Later(u64::MAX)),
            // No term (an earlier release's label, or one set by hand) or one that does not
            // parse: ended, so that such a label never keeps the leader's Pod unlabelled.
            (None, false, Stamp::Ended),
            (None, true, Stamp::Ended),
            (Some("-8"), false, Stamp::Ended),
            (Some("8 "), false, Stamp::Ended),
            (Some(""), false, Stamp::Ended),
        ] {
            assert_eq!(
                stamp(&pod(term), key, 7, is_own),
                expected,
                "{term:?} own: {is_own}"
            );
        }
        let other_key = pod(Some("9"));
        assert_eq!(
            stamp(&other_key, "example.com/leader", 7, false),
            Stamp::Ended
        );
    }
}
