//! What operators ask of a schedule, through the record: suspend it, resume it, run it now,
//! cancel a firing.
//!
//! The requests live in an extension of their own, `cron-control/NAME`, which operators write
//! with a compare-and-swap of the record ([`suspend`], [`resume`], [`trigger`], [`cancel`];
//! `leader cron suspend|resume|trigger|cancel`) and the leader only reads: its own state
//! (`cron/NAME`) is never written by anyone else. The leader's next renewal finds the change
//! (a renewal from before it loses its compare-and-swap and reads the record again; at once
//! where the backend notifies), and its schedule loop looks at the requests every second.

use chrono::{DateTime, Utc};
use leader_core::{LockError, ResourceLock};
use serde::{Deserialize, Serialize};

/// How often an operator's request is read and written again when the leader's renewals keep
/// changing the record under it.
const TRIES: usize = 10;

/// The record extension that holds the operators' requests for schedule `name`.
pub fn control_key(name: &str) -> String {
    format!("cron-control/{name}")
}

/// The operators' requests for one schedule, as the record keeps them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Control {
    /// Set while the schedule is suspended: by whom and since when. Firings due meanwhile are
    /// not started and count as missed, and so do those still waiting when the leader sees it
    /// (a backlog after a failover, or behind a running firing under
    /// [`Overlap::Forbid`](crate::Overlap::Forbid)); a firing running goes on, a retry of an
    /// interrupted one and a firing asked for with [`trigger`] still run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended: Option<Request>,
    /// A firing asked for outside the schedule, run once by the leader (whichever replica it
    /// is) as soon as the overlap policy lets it, in its turn with the firings and retries
    /// due (it is due when it was asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<Request>,
    /// Firings to cancel ([`cancel`]), named in the request's
    /// [`firings`](Request::firings): whichever replica leads stops the ones running and drops
    /// the ones waiting for a retry, once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<Request>,
    /// Fields this release does not know (written by a later one), kept and written back
    /// (S16).
    #[serde(flatten)]
    pub unknown_fields: std::collections::BTreeMap<String, serde_json::Value>,
}

/// One operator's request: who asked, and when.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Request {
    /// Who asked (an operator's name, `leader cron trigger`'s `--by`, or the host).
    pub by: String,
    /// When, by the asker's clock; a trigger's identity, with its instant as the firing's
    /// `scheduled`, and a cancel's.
    pub at: DateTime<Utc>,
    /// For a cancel, the firings it cancels, by their scheduled instants (empty for the other
    /// requests).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub firings: Vec<DateTime<Utc>>,
    /// Fields this release does not know (written by a later one), kept and written back
    /// (S16).
    #[serde(flatten)]
    pub unknown_fields: std::collections::BTreeMap<String, serde_json::Value>,
}

impl Control {
    /// Reads the requests from a record extension's value.
    ///
    /// # Errors
    /// The value is not such a set of requests.
    pub fn from_json(value: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(value)
    }

    /// The requests as the extension's value.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Why an operator's request could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Nobody has run for the election yet, so there is no schedule to act on.
    #[error("{lock}: no election yet (nobody has run this schedule)")]
    NoElection {
        /// The lock's description.
        lock: String,
    },
    /// The record holds no schedule under this name.
    #[error("{lock}: no schedule {name:?} in the record (schedules there: {found})")]
    NoSchedule {
        /// The lock's description.
        lock: String,
        /// The schedule asked for.
        name: String,
        /// The schedules the record holds, or "none".
        found: String,
    },
    /// The requests stored for this schedule cannot be read; they are left as they are.
    #[error("{lock}: the requests stored for schedule {name:?} cannot be read: {reason}")]
    BadControl {
        /// The lock's description.
        lock: String,
        /// The schedule.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A cancel found nothing to cancel: no firing running or waiting for a retry in the
    /// record (or not the one named).
    #[error("{lock}: schedule {name:?}: {}", nothing_to_cancel(.firing.as_ref()))]
    NothingToCancel {
        /// The lock's description.
        lock: String,
        /// The schedule.
        name: String,
        /// The firing asked for, when one was named.
        firing: Option<DateTime<Utc>>,
    },
    /// The record changed under every attempt.
    #[error("{lock}: the record changed under each of {tries} attempts to write the request")]
    Contended {
        /// The lock's description.
        lock: String,
        /// Attempts made.
        tries: usize,
    },
    /// The lock failed.
    #[error(transparent)]
    Lock(#[from] LockError),
}

/// What [`ControlError::NothingToCancel`] says.
fn nothing_to_cancel(firing: Option<&DateTime<Utc>>) -> String {
    match firing {
        Some(at) => format!(
            "no firing scheduled at {} is running or waiting for a retry: nothing to cancel",
            at.to_rfc3339()
        ),
        None => "no firing is running or waiting for a retry: nothing to cancel".to_owned(),
    }
}

/// Suspends schedule `name` in the election behind `lock` (Kubernetes CronJob's `suspend`):
/// whichever replica leads starts none of its firings until [`resume`]; they count as missed,
/// as do those not started yet when it sees the suspension.
/// Suspending a suspended schedule changes nothing. Returns the requests as stored.
///
/// # Errors
/// [`ControlError`]: no election, no such schedule, unreadable requests, or the lock's error.
pub async fn suspend(
    lock: &dyn ResourceLock,
    name: &str,
    by: &str,
) -> Result<Control, ControlError> {
    let by = by.to_owned();
    change(lock, name, move |control, _| {
        if control.suspended.is_some() {
            return Ok(false);
        }
        control.suspended = Some(Request {
            by: by.clone(),
            at: Utc::now(),
            firings: Vec::new(),
            unknown_fields: Default::default(),
        });
        Ok(true)
    })
    .await
}

/// Resumes schedule `name`: the next firing after now runs as the schedule says (the ones due
/// while it was suspended stay missed). Resuming a schedule that is not suspended changes
/// nothing. Returns the requests as stored.
///
/// # Errors
/// As [`suspend`].
pub async fn resume(lock: &dyn ResourceLock, name: &str) -> Result<Control, ControlError> {
    change(lock, name, |control, _| {
        Ok(control.suspended.take().is_some())
    })
    .await
}

/// Asks for one firing of schedule `name` now, outside the schedule (`kubectl create job
/// --from=cronjob/NAME`): the leader starts it once, fenced and recorded as any firing, with
/// the request's instant as its `scheduled` and [`Firing::triggered_by`](crate::Firing) set.
/// A trigger not yet started is replaced by a newer one (one run now, not two). Returns the
/// requests as stored; `trigger.at` identifies this one.
///
/// A request is dated by the asker's clock, and a leader starts a request later than the last
/// one it handled: when this machine's clock reads no later than that (it is behind the
/// clock of an earlier asker), the request is dated just after it, so that it still runs
/// (`trigger.at` is then later than this machine's clock).
///
/// # Errors
/// As [`suspend`].
pub async fn trigger(
    lock: &dyn ResourceLock,
    name: &str,
    by: &str,
) -> Result<Control, ControlError> {
    let by = by.to_owned();
    change(lock, name, move |control, state| {
        let mut at = dated(state.and_then(|s| s.last_trigger));
        // Never a whole second, so that it never shares an identity with a scheduled firing.
        if at.timestamp_subsec_nanos() == 0 {
            at += chrono::Duration::nanoseconds(1);
        }
        control.trigger = Some(Request {
            by: by.clone(),
            at,
            firings: Vec::new(),
            unknown_fields: Default::default(),
        });
        Ok(true)
    })
    .await
}

/// Cancels firings of schedule `name`: the one scheduled at `firing`, or, when `None`, every
/// firing the record shows running or waiting for a retry. Whichever replica leads stops a
/// running one's work as [`timeout`](crate::CronJobBuilder::timeout) does (its cancellation
/// token, then dropped after [`timeout_grace`](crate::CronJobBuilder::timeout_grace); a
/// `leader cron` COMMAND gets SIGTERM, then SIGKILL after its grace), and drops a retry waiting for its turn; each is
/// recorded as [`Outcome::Cancelled`](crate::Outcome::Cancelled), not as failed, and no retry
/// follows. A firing that ended before the leader got to the request stays as it ended. A
/// cancel not handled yet is joined by a newer one (both sets of firings are cancelled).
/// Returns the requests as stored; `cancel.firings` names the firings.
///
/// A request is dated as [`trigger`] dates one: later than the last cancel handled.
///
/// # Errors
/// [`ControlError::NothingToCancel`] when the record shows no such firing running or
/// waiting; else as [`suspend`].
pub async fn cancel(
    lock: &dyn ResourceLock,
    name: &str,
    by: &str,
    firing: Option<DateTime<Utc>>,
) -> Result<Control, ControlError> {
    let by = by.to_owned();
    change(lock, name, move |control, state| {
        let waiting = state.into_iter().flat_map(|s| {
            let running = s.running.iter().map(|r| r.scheduled);
            running.chain(s.retrying.iter().map(|r| r.scheduled))
        });
        let mut firings: Vec<DateTime<Utc>> = waiting
            .filter(|at| firing.is_none_or(|named| named == *at))
            .collect();
        if firings.is_empty() {
            return Err(ControlError::NothingToCancel {
                lock: lock.describe(),
                name: name.to_owned(),
                firing,
            });
        }
        let last_handled = state.and_then(|s| s.last_cancel);
        // A cancel the leader has not handled yet keeps its firings beside the new ones.
        if let Some(pending) = control
            .cancel
            .take()
            .filter(|c| last_handled.is_none_or(|last| c.at > last))
        {
            firings.extend(pending.firings);
        }
        firings.sort();
        firings.dedup();
        control.cancel = Some(Request {
            by: by.clone(),
            at: dated(last_handled),
            firings,
            unknown_fields: Default::default(),
        });
        Ok(true)
    })
    .await
}

/// Now by this machine's clock, or just after `last_handled` when this clock reads no later
/// than it: later than the last request of its kind a leader handled, or the leader would
/// take it for that one.
fn dated(last_handled: Option<DateTime<Utc>>) -> DateTime<Utc> {
    let now = Utc::now();
    match last_handled.filter(|last| *last >= now) {
        Some(last) => last + chrono::Duration::milliseconds(1),
        None => now,
    }
}

/// Applies `edit` to schedule `name`'s requests with a compare-and-swap of the record, read
/// again and retried when the leader's renewals got there first; `edit` gets the schedule's
/// state as stored (none when it cannot be read), and returns whether it changed anything.
async fn change(
    lock: &dyn ResourceLock,
    name: &str,
    mut edit: impl FnMut(&mut Control, Option<&crate::CronState>) -> Result<bool, ControlError>,
) -> Result<Control, ControlError> {
    let key = control_key(name);
    let mut control = Control::default();
    let written = leader_core::edit_record::<ControlError>(lock, TRIES, |current| {
        let Some(current) = current else {
            return Err(ControlError::NoElection {
                lock: lock.describe(),
            });
        };
        let extensions = &current.record.extensions;
        let Some(state) = extensions.get(&crate::extension_key(name)) else {
            let found: Vec<&str> = extensions
                .keys()
                .filter_map(|k| k.strip_prefix("cron/"))
                .collect();
            return Err(ControlError::NoSchedule {
                lock: lock.describe(),
                name: name.to_owned(),
                found: if found.is_empty() {
                    "none".to_owned()
                } else {
                    found.join(", ")
                },
            });
        };
        let state = crate::CronState::from_json(state).ok();
        control = match extensions.get(&key) {
            Some(value) => Control::from_json(value).map_err(|err| ControlError::BadControl {
                lock: lock.describe(),
                name: name.to_owned(),
                reason: err.to_string(),
            })?,
            None => Control::default(),
        };
        if !edit(&mut control, state.as_ref())? {
            return Ok(None);
        }
        let mut record = current.record.clone();
        record.extensions.insert(key.clone(), control.to_json());
        Ok(Some(record))
    })
    .await?;
    match written {
        Some(_) => Ok(control),
        None => Err(ControlError::Contended {
            lock: lock.describe(),
            tries: TRIES,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// S16: requests a later release wrote, with fields this release does not know, read and
    /// write back whole.
    #[test]
    fn a_later_releases_requests_are_read_and_written_back_whole() {
        let later = r#"{"suspended":{"by":"ops","at":"2026-01-10T00:00:00Z","reason":"maintenance"},"pausedUntil":"2026-01-11T00:00:00Z"}"#;
        let control = Control::from_json(later).expect("a later release's requests");
        assert!(control.suspended.is_some());
        let written: serde_json::Value = serde_json::from_str(&control.to_json()).expect("JSON");
        let before: serde_json::Value = serde_json::from_str(later).expect("JSON");
        assert_eq!(written, before);
    }
}
