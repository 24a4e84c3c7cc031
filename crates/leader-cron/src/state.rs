//! What the store keeps of a schedule: one extension of the lock's record, `cron/NAME`, as JSON.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// How many ended firings a schedule's state keeps unless the job says otherwise.
pub const HISTORY: usize = 10;

/// The most failed firings waiting in a schedule's state for their retry: one more gives up
/// the oldest of them ([`Outcome::GaveUp`]), so that a job that always fails cannot grow the
/// record past what a store keeps (a Kubernetes Lease holds it in one 256 KiB annotation).
pub const MAX_RETRYING: usize = 32;

/// The longest message an outcome keeps ([`Outcome::Failed`], [`Outcome::GaveUp`]), in bytes;
/// a longer one is cut, ending with `…`.
pub const MAX_MESSAGE: usize = 512;

/// The format of the state this release writes ([`CronState::format`]); a state written before
/// the format was kept reads as 1.
pub const FORMAT: u32 = 3;

/// The record extension that holds schedule `name`'s state.
pub fn extension_key(name: &str) -> String {
    format!("cron/{name}")
}

/// A schedule's state, as the store keeps it: written by the leader only, by compare-and-swap
/// under its fencing token, before each firing starts and after it ends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct CronState {
    /// The format of the release that wrote the state last ([`FORMAT`] for this one; 1 for a
    /// state from before the format was kept). Every release reads every format: a later one
    /// adds fields, which an earlier one keeps and writes back (S16).
    #[serde(default = "first_format")]
    pub format: u32,
    /// The schedule's [`spec`](crate::Schedule::spec): every replica must run the same one.
    pub schedule: String,
    /// The configuration revision the stored schedule came with
    /// ([`CronJobBuilder::schedule_revision`](crate::CronJobBuilder::schedule_revision)): a
    /// replica with a higher one changes the schedule, one with a lower one follows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<Revision>,
    /// When the state was first written: no firing before it is due.
    pub since: DateTime<Utc>,
    /// The latest scheduled instant handled (started, or missed by the policy); the next firing
    /// is the schedule's first instant after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<DateTime<Utc>>,
    /// Firings started and not yet ended, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub running: Vec<Started>,
    /// The firing that ended last, with its outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<Ended>,
    /// The firings that ended last, oldest first, as many as the job keeps
    /// ([`CronJobBuilder::history`](crate::CronJobBuilder::history), [`HISTORY`] by default).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Ended>,
    /// Failed firings to run again ([`CronJobBuilder::retries`](crate::CronJobBuilder::retries)),
    /// each at its time: kept in the record so that a new leader runs them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retrying: Vec<Retry>,
    /// The last change of the schedule by a replica that adopted its own
    /// ([`CronJobBuilder::adopt_schedule`](crate::CronJobBuilder::adopt_schedule)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed: Option<ScheduleChange>,
    /// The instant of the last firing asked for now ([`trigger`](crate::trigger)) that a
    /// leader started: a request no later than it is handled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_trigger: Option<DateTime<Utc>>,
    /// The instant of the last request to cancel firings ([`cancel`](crate::cancel)) that a
    /// leader handled: a request no later than it is handled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_cancel: Option<DateTime<Utc>>,
    /// Firings missed so far (no leader at their time, or skipped by the policy).
    #[serde(default)]
    pub missed: u64,
    /// Fields this release does not know (written by a later one), kept and written back
    /// (S16).
    #[serde(flatten)]
    pub unknown_fields: BTreeMap<String, serde_json::Value>,
}

/// A failed firing to run again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Retry {
    /// The firing's scheduled instant.
    pub scheduled: DateTime<Utc>,
    /// The attempt to run.
    pub attempt: u32,
    /// When it is due, after the back-off, by the leader's clock.
    pub at: DateTime<Utc>,
    /// Who asked for the firing, for one outside the schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub triggered_by: Option<String>,
    /// Fields this release does not know (written by a later one), kept and written back
    /// (S16).
    #[serde(flatten)]
    pub unknown_fields: BTreeMap<String, serde_json::Value>,
}

/// The revision of a schedule's configuration, as the state keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Revision {
    /// The revision's number, as the configuration gives it.
    pub number: u64,
    /// The schedule it is the revision of: when it is not the stored schedule (a release that
    /// keeps no revisions wrote its own over it), the stored schedule has no revision.
    pub schedule: String,
    /// Fields this release does not know (written by a later one), kept and written back
    /// (S16).
    #[serde(flatten)]
    pub unknown_fields: BTreeMap<String, serde_json::Value>,
}

/// A change of a schedule in place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct ScheduleChange {
    /// The schedule before.
    pub from: String,
    /// When it changed, by the clock of the leader that changed it.
    pub at: DateTime<Utc>,
    /// The identity of that leader.
    pub by: String,
    /// The revision of the new schedule's configuration (absent: none given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    /// Fields this release does not know (written by a later one), kept and written back
    /// (S16).
    #[serde(flatten)]
    pub unknown_fields: BTreeMap<String, serde_json::Value>,
}

/// A firing started.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Started {
    /// Its scheduled instant: with the schedule's name, the firing's identity.
    pub scheduled: DateTime<Utc>,
    /// 1 for the first run, more for a firing retried after its leader died.
    pub attempt: u32,
    /// The fencing token of the term that started it.
    pub fencing_token: u64,
    /// When it started, by the leader's clock.
    pub started_at: DateTime<Utc>,
    /// The identity of the leader that started it (absent in states written before it was
    /// kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// Who asked for it, for a firing outside the schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub triggered_by: Option<String>,
    /// Fields this release does not know (written by a later one), kept and written back
    /// (S16).
    #[serde(flatten)]
    pub unknown_fields: BTreeMap<String, serde_json::Value>,
}

/// A firing that ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Ended {
    /// Its scheduled instant.
    pub scheduled: DateTime<Utc>,
    /// The attempt that ended.
    pub attempt: u32,
    /// How it ended.
    pub outcome: Outcome,
    /// When it ended (or was given up), by the leader's clock.
    pub ended_at: DateTime<Utc>,
    /// When it started, by the clock of the leader that started it (absent for a retry
    /// superseded before it started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    /// The fencing token of the term that started it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<u64>,
    /// The identity of the leader that started it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// Who asked for it, for a firing outside the schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub triggered_by: Option<String>,
    /// Fields this release does not know (written by a later one), kept and written back
    /// (S16).
    #[serde(flatten)]
    pub unknown_fields: BTreeMap<String, serde_json::Value>,
}

/// How a firing ended.
///
/// Stored as a JSON object tagged by its `kind`. A kind this release does not know (a later
/// release's) is read as [`Other`](Self::Other) and written back as it was (S16); a later
/// release adds kinds, never fields to a kind this one knows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "StoredOutcome", into = "StoredOutcome")]
#[non_exhaustive]
pub enum Outcome {
    /// The job returned `Ok`.
    Succeeded,
    /// The job returned an error (its text; for the `leader cron` command, COMMAND's exit).
    Failed {
        /// What it said.
        message: String,
    },
    /// Its leader died (or lost its lease) while it ran, and the policy gives it up:
    /// [`Interrupted::GiveUp`](crate::Interrupted::GiveUp), or its attempts ran out.
    GaveUp {
        /// Why.
        reason: String,
    },
    /// A later firing replaced it while it ran ([`Overlap::Replace`](crate::Overlap::Replace)).
    Replaced,
    /// It ran past the job's timeout
    /// ([`CronJobBuilder::timeout`](crate::CronJobBuilder::timeout)) and was stopped.
    TimedOut,
    /// An operator cancelled it ([`cancel`](crate::cancel)): its work was stopped, or its
    /// retry dropped before it started. Not a failure: no retry follows.
    Cancelled {
        /// Who asked.
        by: String,
    },
    /// An outcome of a kind this release does not know, as a later release wrote it.
    Other(serde_json::Map<String, serde_json::Value>),
}

/// An outcome as stored: one of the kinds this release knows, or any other object.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum StoredOutcome {
    Known(KnownOutcome),
    Other(serde_json::Map<String, serde_json::Value>),
}

/// The kinds of outcome this release knows, as stored.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
enum KnownOutcome {
    Succeeded,
    Failed { message: String },
    GaveUp { reason: String },
    Replaced,
    TimedOut,
    Cancelled { by: String },
}

impl From<StoredOutcome> for Outcome {
    fn from(stored: StoredOutcome) -> Self {
        match stored {
            StoredOutcome::Known(KnownOutcome::Succeeded) => Self::Succeeded,
            StoredOutcome::Known(KnownOutcome::Failed { message }) => Self::Failed { message },
            StoredOutcome::Known(KnownOutcome::GaveUp { reason }) => Self::GaveUp { reason },
            StoredOutcome::Known(KnownOutcome::Replaced) => Self::Replaced,
            StoredOutcome::Known(KnownOutcome::TimedOut) => Self::TimedOut,
            StoredOutcome::Known(KnownOutcome::Cancelled { by }) => Self::Cancelled { by },
            StoredOutcome::Other(object) => Self::Other(object),
        }
    }
}

impl From<Outcome> for StoredOutcome {
    fn from(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Succeeded => Self::Known(KnownOutcome::Succeeded),
            Outcome::Failed { message } => Self::Known(KnownOutcome::Failed { message }),
            Outcome::GaveUp { reason } => Self::Known(KnownOutcome::GaveUp { reason }),
            Outcome::Replaced => Self::Known(KnownOutcome::Replaced),
            Outcome::TimedOut => Self::Known(KnownOutcome::TimedOut),
            Outcome::Cancelled { by } => Self::Known(KnownOutcome::Cancelled { by }),
            Outcome::Other(object) => Self::Other(object),
        }
    }
}

impl Outcome {
    /// A short name: `succeeded`, `failed`, `gave up`, `replaced`, `timed out`, `cancelled`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed { .. } => "failed",
            Self::GaveUp { .. } => "gave up",
            Self::Replaced => "replaced",
            Self::TimedOut => "timed out",
            Self::Cancelled { .. } => "cancelled",
            Self::Other(_) => "of a kind this release does not know",
        }
    }
}

/// The format of a state that carries none.
fn first_format() -> u32 {
    1
}

/// `message`, cut to [`MAX_MESSAGE`] bytes at a character's boundary.
pub(crate) fn bounded(message: String) -> String {
    if message.len() <= MAX_MESSAGE {
        return message;
    }
    let ellipsis = "…";
    let mut end = MAX_MESSAGE - ellipsis.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ellipsis}", &message[..end])
}

impl CronState {
    /// A new state for `schedule`, due from `since`.
    pub fn new(schedule: &str, since: DateTime<Utc>) -> Self {
        Self {
            format: FORMAT,
            schedule: schedule.to_owned(),
            revision: None,
            since,
            cursor: None,
            running: Vec::new(),
            last: None,
            history: Vec::new(),
            retrying: Vec::new(),
            changed: None,
            last_trigger: None,
            last_cancel: None,
            missed: 0,
            unknown_fields: BTreeMap::new(),
        }
    }

    /// Reads the state from a record extension's value.
    ///
    /// # Errors
    /// The value is not such a state.
    pub fn from_json(value: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(value)
    }

    /// The state as the extension's value.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The instant after which the next firing is due: the cursor, or `since` before any firing.
    pub fn handled_until(&self) -> DateTime<Utc> {
        self.cursor.map_or(self.since, |c| c.max(self.since))
    }

    /// The revision of the stored schedule: its [`revision`](Self::revision)'s number when it
    /// is the revision of the stored schedule, else 0 (none given).
    pub fn revision_number(&self) -> u64 {
        self.revision
            .as_ref()
            .filter(|r| r.schedule == self.schedule)
            .map_or(0, |r| r.number)
    }

    /// The latest instant the state records (by the clocks of the leaders that wrote it).
    pub(crate) fn latest_recorded(&self) -> DateTime<Utc> {
        let ended = self.history.iter().chain(&self.last).map(|e| e.ended_at);
        let started = self.running.iter().map(|s| s.started_at);
        let changed = self.changed.iter().map(|c| c.at);
        std::iter::once(self.handled_until())
            .chain(ended)
            .chain(started)
            .chain(changed)
            .max()
            .unwrap_or(self.since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_round_trips_as_json() {
        let at = DateTime::parse_from_rfc3339("2026-01-10T00:00:00Z")
            .expect("time")
            .with_timezone(&Utc);
        let mut state = CronState::new("every 1s", at);
        state.cursor = Some(at);
        state.running.push(Started {
            scheduled: at,
            attempt: 1,
            fencing_token: 7,
            started_at: at,
            identity: Some("a".into()),
            triggered_by: None,
            unknown_fields: Default::default(),
        });
        let ended = Ended {
            scheduled: at,
            attempt: 2,
            outcome: Outcome::Failed {
                message: "exit 3".into(),
            },
            ended_at: at,
            started_at: Some(at),
            fencing_token: Some(7),
            identity: Some("a".into()),
            triggered_by: Some("ops".into()),
            unknown_fields: Default::default(),
        };
        state.last = Some(ended.clone());
        state.history.push(ended);
        let json = state.to_json();
        assert!(json.contains(r#""kind":"failed""#), "{json}");
        assert_eq!(CronState::from_json(&json).expect("parses"), state);
        assert!(CronState::from_json("{\"garbage\":1}").is_err());
        // A state written before the history and the identities were kept still reads.
        let older = r#"{"schedule":"every 1s","since":"2026-01-10T00:00:00Z","running":[{"scheduled":"2026-01-10T00:00:00Z","attempt":1,"fencingToken":7,"startedAt":"2026-01-10T00:00:00Z"}],"last":{"scheduled":"2026-01-10T00:00:00Z","attempt":1,"outcome":{"kind":"succeeded"},"endedAt":"2026-01-10T00:00:00Z"},"missed":0}"#;
        let read = CronState::from_json(older).expect("an older state");
        assert!(read.history.is_empty() && read.running[0].identity.is_none());
    }

    /// S16: a state a later release wrote, with fields this release does not know at every
    /// level and an outcome of a kind it does not know, reads, and what this release writes
    /// of it keeps them all; a field this release knows, mistyped, is still refused.
    #[test]
    fn a_later_releases_state_is_read_and_written_back_whole() {
        let later = r#"{"schedule":"every 1s","since":"2026-01-10T00:00:00Z","version":2,"cursor":"2026-01-10T00:00:05Z","running":[{"scheduled":"2026-01-10T00:00:05Z","attempt":1,"fencingToken":7,"startedAt":"2026-01-10T00:00:05Z","host":"node-3"}],"last":{"scheduled":"2026-01-10T00:00:04Z","attempt":1,"outcome":{"kind":"skippedByWindow","window":"night"},"endedAt":"2026-01-10T00:00:04Z","durationMs":12},"retrying":[{"scheduled":"2026-01-10T00:00:03Z","attempt":2,"at":"2026-01-10T00:00:09Z","reason":"exit 1"}],"changed":{"from":"every 2s","at":"2026-01-10T00:00:00Z","by":"a","configVersion":5},"missed":0,"paused":{"until":"2026-01-11T00:00:00Z"}}"#;
        let mut state = CronState::from_json(later).expect("a later release's state");
        assert_eq!(state.unknown_fields.len(), 2, "{state:?}");
        assert_eq!(state.running[0].unknown_fields["host"], "node-3");
        let last = state.last.clone().expect("last");
        assert!(matches!(last.outcome, Outcome::Other(_)), "{last:?}");
        // What this release writes: a new firing started beside what was there.
        state.missed += 1;
        let written: serde_json::Value = serde_json::from_str(&state.to_json()).expect("JSON");
        let before: serde_json::Value = serde_json::from_str(later).expect("JSON");
        for pointer in [
            "/version",
            "/paused/until",
            "/running/0/host",
            "/last/durationMs",
            "/last/outcome/kind",
            "/last/outcome/window",
            "/retrying/0/reason",
            "/changed/configVersion",
        ] {
            assert_eq!(
                written.pointer(pointer),
                before.pointer(pointer),
                "{pointer} in {written}"
            );
        }
        assert_eq!(written["missed"], 1);
        let mistyped = later.replace(
            r#""attempt":1,"fencingToken":7"#,
            r#""attempt":"one","fencingToken":7"#,
        );
        assert!(CronState::from_json(&mistyped).is_err());
    }

    /// The state carries its format (1 when absent, this release's when written), and a
    /// revision counts only for the schedule it was given with: an earlier release that
    /// wrote its own schedule over a revised one leaves the stored schedule without one.
    #[test]
    fn the_format_and_the_revision_are_read_as_written() {
        let older = r#"{"schedule":"every 1s","since":"2026-01-10T00:00:00Z","missed":0}"#;
        let mut state = CronState::from_json(older).expect("an older state");
        assert_eq!((state.format, state.revision_number()), (1, 0));
        assert_eq!(CronState::new("every 1s", state.since).format, FORMAT);
        state.revision = Some(Revision {
            number: 3,
            schedule: "every 1s".into(),
            unknown_fields: Default::default(),
        });
        assert_eq!(state.revision_number(), 3);
        let json = state.to_json();
        assert!(
            json.contains(r#""revision":{"number":3,"schedule":"every 1s"}"#),
            "{json}"
        );
        state.schedule = "every 2s".into();
        assert_eq!(state.revision_number(), 0, "a revision of another schedule");
    }

    /// Messages are kept to [`MAX_MESSAGE`] bytes, cut at a character's boundary.
    #[test]
    fn long_messages_are_cut() {
        assert_eq!(bounded("exit 3".into()), "exit 3");
        let long = "é".repeat(MAX_MESSAGE);
        let cut = bounded(long);
        assert!(
            cut.len() <= MAX_MESSAGE && cut.ends_with('…'),
            "{}",
            cut.len()
        );
    }
}
