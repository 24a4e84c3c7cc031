//! What `leader status` shows of the schedules in a record.

use chrono::{DateTime, Utc};

use crate::control::{Control, Request, control_key};
use crate::schedule::Schedule;
use crate::state::CronState;

/// What `leader status` shows of a schedule: its state and next firing, from a record's
/// extension.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScheduleStatus {
    /// The schedule's name.
    pub name: String,
    /// Its state as stored.
    pub state: CronState,
    /// The next firing due, from the stored cursor (`None` when the schedule cannot be read or
    /// never fires again).
    pub next: Option<DateTime<Utc>>,
    /// The operators' requests: set while suspended.
    pub suspended: Option<Request>,
    /// A firing asked for now that no leader has started yet.
    pub pending_trigger: Option<Request>,
    /// A request to cancel firings that no leader has handled yet.
    pub pending_cancel: Option<Request>,
}

impl ScheduleStatus {
    /// The schedules in a record's extensions, by name.
    pub fn all_in(extensions: &std::collections::BTreeMap<String, String>) -> Vec<Self> {
        extensions
            .iter()
            .filter_map(|(key, value)| {
                let name = key.strip_prefix("cron/")?;
                let state = CronState::from_json(value).ok()?;
                let next = Schedule::from_spec(&state.schedule)
                    .ok()
                    .and_then(|s| s.next_after(state.handled_until()));
                let control = extensions
                    .get(&control_key(name))
                    .and_then(|c| Control::from_json(c).ok())
                    .unwrap_or_default();
                let pending_trigger = control
                    .trigger
                    .filter(|t| state.last_trigger.is_none_or(|last| t.at > last));
                let pending_cancel = control
                    .cancel
                    .filter(|c| state.last_cancel.is_none_or(|last| c.at > last));
                Some(Self {
                    name: name.to_owned(),
                    state,
                    next,
                    suspended: control.suspended,
                    pending_trigger,
                    pending_cancel,
                })
            })
            .collect()
    }
}
