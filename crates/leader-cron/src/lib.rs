#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod job;
mod policy;
mod schedule;
mod state;

pub use job::{
    BoxError, Clock, CronError, CronEvent, CronJob, CronJobBuilder, Firing, ScheduleStatus,
    SystemClock, TokioClock,
};
pub use policy::{Interrupted, MAX_RUNNING, Missed, ON_TIME, Overlap};
pub use schedule::{Schedule, ScheduleError};
pub use state::{CronState, Ended, HISTORY, Outcome, Started, extension_key};

/// The core crate, so that one dependency is enough.
pub use leader_core;
