#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod builder;
mod control;
mod elected;
mod job;
mod policy;
mod run;
mod schedule;
mod state;
mod status;
mod term;

pub use builder::CronJobBuilder;
pub use control::{Control, ControlError, Request, cancel, control_key, resume, suspend, trigger};
pub use job::{BoxError, CronError, CronEvent, CronJob, Firing};
/// The wall clock a job reads scheduled instants against: the toolkit's one clock abstraction.
pub use leader_core::{Clock, SystemClock, TokioClock};
pub use policy::{Interrupted, MAX_RUNNING, Missed, ON_TIME, Overlap};
pub use schedule::{Schedule, ScheduleError};
pub use state::{
    CronState, Ended, FORMAT, HISTORY, MAX_MESSAGE, MAX_RETRYING, Outcome, Retry, Revision,
    ScheduleChange, Started, extension_key,
};
pub use status::ScheduleStatus;
pub use term::CLOCK_HORIZON;

/// The core crate, so that one dependency is enough.
pub use leader_core;
