//! The exit codes of `leader`, besides COMMAND's own; the README's table lists them.

/// Success: shut down by SIGTERM, SIGINT or SIGHUP, COMMAND stopped and the lease released.
pub(crate) const OK: u8 = 0;
/// An unexpected failure.
pub(crate) const FAILURE: u8 = 1;
/// Invalid flags or values (clap's code).
pub(crate) const USAGE: u8 = 2;
/// `--lock` is not usable as given: unknown scheme, malformed URL, backend not in this build,
/// storage that does not exist (a missing database, table or directory), a lock directory
/// another user could write to, credentials the server does not take.
pub(crate) const BAD_LOCK: u8 = 3;
/// The backend could not be reached at start: connection refused, or no answer within the
/// request timeout.
pub(crate) const UNREACHABLE: u8 = 4;
/// The backend refused: wrong credentials, missing permissions, an unreadable record.
pub(crate) const REFUSED: u8 = 5;
/// `handover`, `cron suspend|resume|trigger|cancel`, `shards resize`: nobody has run for this
/// election (or this schedule, or this set) yet, or no firing is there to cancel, so there is
/// nothing to act on.
pub(crate) const NO_ELECTION: u8 = 6;
/// `handover --wait`: the named identity did not lead within `--timeout`; `shards drain|undrain
/// --wait`: the member did not reach its target within `--timeout`.
pub(crate) const NOT_HANDED_OVER: u8 = 7;
/// `--exit-on-identity-conflict`: another process leads with this replica's identity;
/// `--shards --static-membership`: a newer process started with this replica's identity
/// fenced it.
pub(crate) const IDENTITY_CONFLICT: u8 = 8;
/// `cron`: the schedule cannot be used (an invalid expression, an unknown time zone, a schedule
/// that never fires, an interval under a second).
#[cfg(feature = "cron")]
pub(crate) const BAD_SCHEDULE: u8 = 9;
/// `cron`: the store holds another schedule under this name (replicas started with different
/// schedules).
#[cfg(feature = "cron")]
pub(crate) const SCHEDULE_MISMATCH: u8 = 10;
/// `run --shards`: the store holds another shard count for this name (replicas started with
/// different counts), or a roster record that is not a shard set's (also `shards resize`).
pub(crate) const SHARD_COUNT_MISMATCH: u8 = 11;
/// The supervisor of a COMMAND found the `leader` that started it gone before COMMAND could
/// start, and did not start it; `leader` itself never exits with it.
pub(crate) const ORPHANED: u8 = 12;
/// `--once`: leadership was lost before COMMAND finished.
pub(crate) const LOST: u8 = 75;
/// COMMAND could not be executed.
pub(crate) const NOT_EXECUTABLE: u8 = 126;
/// COMMAND was not found.
pub(crate) const NOT_FOUND: u8 = 127;
