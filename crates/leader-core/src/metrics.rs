//! Metrics through the `metrics` facade, with client-go's names where client-go has them.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `leader_election_master_status` | gauge, 1 while leading | `name` |
//! | `leader_election_slowpath_total` | counter: renewals that had to read the record first | `name` |
//! | `leader_election_acquisitions_total` | counter: terms started | `name` |
//! | `leader_election_renew_duration_seconds` | histogram: successful renewals | `name` |
//! | `leader_election_errors_total` | counter: failed lock requests | `name`, `operation`, `kind` |
//! | `leader_election_handovers_total` | counter: leases handed over to a named candidate | `name` |
//! | `leader_election_work_ended_total` | counter: terms' work that returned or panicked while leading | `name`, `outcome` (`returned`, `panicked`) |
//! | `leader_election_identity_conflicts_total` | counter: terms of another process found alive under this identity | `name` |
//! | `leader_shards_owned` | gauge: shards this member owns | `name` |
//! | `leader_shards_members` | gauge: members of the shard set alive, as last read | `name` |
//! | `leader_shards_imbalance` | gauge: most shards owned by a live member less the fewest, as last read | `name` |
//! | `leader_shard_moves_total` | counter: shards this member took or let go | `name`, `move` (`acquired`, `handed_over`, `released`, `lost`, `expired`) |

use std::time::Duration;

/// 1 while leading, 0 otherwise (client-go's name).
pub const MASTER_STATUS: &str = "leader_election_master_status";
/// Renewals whose fast path lost the compare-and-swap and read the record (client-go's name).
pub const SLOWPATH_TOTAL: &str = "leader_election_slowpath_total";
/// Terms of leadership started.
pub const ACQUISITIONS_TOTAL: &str = "leader_election_acquisitions_total";
/// Duration of successful renewals.
pub const RENEW_DURATION_SECONDS: &str = "leader_election_renew_duration_seconds";
/// Failed lock requests, by operation and [`LockError::kind`](crate::LockError::kind).
pub const ERRORS_TOTAL: &str = "leader_election_errors_total";
/// Leases this candidate handed over to a named candidate (a planned handover).
pub const HANDOVERS_TOTAL: &str = "leader_election_handovers_total";

/// Work of a term that returned or panicked while the term went on.
pub const WORK_ENDED_TOTAL: &str = "leader_election_work_ended_total";
/// Terms of another process found alive under this candidate's identity (S13).
pub const IDENTITY_CONFLICTS_TOTAL: &str = "leader_election_identity_conflicts_total";

/// Shards this member owns.
pub const SHARDS_OWNED: &str = "leader_shards_owned";
/// Members of the shard set alive, as last read.
pub const SHARDS_MEMBERS: &str = "leader_shards_members";
/// Most shards owned by a live member less the fewest, as last read (0 or 1 once balanced).
pub const SHARDS_IMBALANCE: &str = "leader_shards_imbalance";
/// Shards this member took or let go, by move.
pub const SHARD_MOVES_TOTAL: &str = "leader_shard_moves_total";

/// Registers descriptions of the metrics with the installed recorder.
pub fn describe() {
    metrics::describe_gauge!(
        MASTER_STATUS,
        "1 while this candidate leads the election, else 0"
    );
    metrics::describe_counter!(
        SLOWPATH_TOTAL,
        "renewals that lost the compare-and-swap from the cached record and read it again"
    );
    metrics::describe_counter!(ACQUISITIONS_TOTAL, "terms of leadership started");
    metrics::describe_histogram!(
        RENEW_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "duration of successful renewals"
    );
    metrics::describe_counter!(ERRORS_TOTAL, "failed lock requests");
    metrics::describe_counter!(
        HANDOVERS_TOTAL,
        "leases handed over to a candidate a handover request named"
    );
    metrics::describe_counter!(
        WORK_ENDED_TOTAL,
        "work of a term that returned or panicked while the term went on"
    );
    metrics::describe_gauge!(SHARDS_OWNED, "shards this member owns");
    metrics::describe_gauge!(
        SHARDS_MEMBERS,
        "members of the shard set alive, as last read"
    );
    metrics::describe_gauge!(
        SHARDS_IMBALANCE,
        "most shards owned by a live member less the fewest, as last read"
    );
    metrics::describe_counter!(SHARD_MOVES_TOTAL, "shards this member took or let go");
    metrics::describe_counter!(
        IDENTITY_CONFLICTS_TOTAL,
        "terms of another process found alive under this candidate's identity"
    );
}

pub(crate) fn work_ended(name: &str, panicked: bool) {
    let outcome = if panicked { "panicked" } else { "returned" };
    metrics::counter!(WORK_ENDED_TOTAL, "name" => name.to_owned(), "outcome" => outcome)
        .increment(1);
}

pub(crate) fn identity_conflict(name: &str) {
    metrics::counter!(IDENTITY_CONFLICTS_TOTAL, "name" => name.to_owned()).increment(1);
}

pub(crate) fn set_leading(name: &str, leading: bool) {
    metrics::gauge!(MASTER_STATUS, "name" => name.to_owned()).set(if leading { 1.0 } else { 0.0 });
}

pub(crate) fn slow_path(name: &str) {
    metrics::counter!(SLOWPATH_TOTAL, "name" => name.to_owned()).increment(1);
}

pub(crate) fn acquired(name: &str) {
    metrics::counter!(ACQUISITIONS_TOTAL, "name" => name.to_owned()).increment(1);
}

pub(crate) fn handed_over(name: &str) {
    metrics::counter!(HANDOVERS_TOTAL, "name" => name.to_owned()).increment(1);
}

pub(crate) fn renewed(name: &str, took: Duration) {
    metrics::histogram!(RENEW_DURATION_SECONDS, "name" => name.to_owned())
        .record(took.as_secs_f64());
}

pub(crate) fn error(name: &str, operation: &'static str, kind: &'static str) {
    metrics::counter!(
        ERRORS_TOTAL,
        "name" => name.to_owned(),
        "operation" => operation,
        "kind" => kind,
    )
    .increment(1);
}

pub(crate) fn shard_moved(name: &str, how: &'static str) {
    metrics::counter!(SHARD_MOVES_TOTAL, "name" => name.to_owned(), "move" => how).increment(1);
}

pub(crate) fn set_shards(name: &str, owned: usize, members: usize, imbalance: usize) {
    metrics::gauge!(SHARDS_OWNED, "name" => name.to_owned()).set(owned as f64);
    metrics::gauge!(SHARDS_MEMBERS, "name" => name.to_owned()).set(members as f64);
    metrics::gauge!(SHARDS_IMBALANCE, "name" => name.to_owned()).set(imbalance as f64);
}
