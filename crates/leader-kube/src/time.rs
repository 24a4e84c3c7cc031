//! Times as the Kubernetes API writes them (`MicroTime`, RFC 3339 with microseconds), for the
//! Lease and the LeaseCandidate alike.

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

/// `time` as a `MicroTime`.
pub(crate) fn micro(time: DateTime<Utc>) -> MicroTime {
    let nanos =
        i128::from(time.timestamp()) * 1_000_000_000 + i128::from(time.timestamp_subsec_nanos());
    MicroTime(k8s_openapi::jiff::Timestamp::from_nanosecond(nanos).unwrap_or_default())
}

/// A `MicroTime` as a `chrono` time; `None` when it is out of range.
pub(crate) fn chrono_of(time: &MicroTime) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(
        time.0.as_second(),
        u32::try_from(time.0.subsec_nanosecond()).ok()?,
    )
}
