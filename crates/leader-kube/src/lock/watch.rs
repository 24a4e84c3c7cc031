//! The watch of one Lease, as what each event means to a follower or to the leader.

use std::time::Duration;

use futures_util::StreamExt;
use kube::api::{WatchEvent, WatchParams};
use leader_core::LockError;

use super::codec::record_of;
use super::{LeaseLock, WATCH_TIMEOUT};

/// What one event of a Lease watch means to a follower.
pub(super) enum WatchOutcome {
    /// The Lease was deleted or released (no holder), or asks for a handover: worth an
    /// attempt (or, for the leader, a renewal) at once.
    Released,
    /// A renewal, a bookmark: nothing to act on.
    Quiet,
    /// The watch failed (410 Gone, say) and ends.
    Ended,
}

pub(super) type WatchEvents =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = WatchOutcome> + Send>>;

/// A watch that ends this soon after it opened counts against [`QUICK_WATCHES`].
pub(super) const QUICK_WATCH: Duration = Duration::from_millis(100);
/// How many watches in a row may end that soon before the stream gives up.
pub(super) const QUICK_WATCHES: u32 = 3;

impl LeaseLock {
    /// One watch of this Lease from the current state, as what each event means.
    pub(super) async fn open_watch(&self) -> Result<WatchEvents, LockError> {
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
