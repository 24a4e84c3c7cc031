//! Schedules: cron expressions in an IANA time zone, and fixed intervals.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Offset, SubsecRound, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};

/// A schedule that cannot be used, refused when it is built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The cron expression does not parse.
    #[error("invalid cron expression {expression:?}: {reason}")]
    InvalidExpression {
        /// The expression as given.
        expression: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The time zone is not an IANA zone name.
    #[error("unknown time zone {zone:?} (an IANA name such as Europe/Berlin or UTC)")]
    UnknownZone {
        /// The zone as given.
        zone: String,
    },
    /// The expression parses but names no instant that exists (February 30th, say).
    #[error("the schedule {schedule} never fires")]
    NeverFires {
        /// The schedule.
        schedule: String,
    },
    /// An interval under one second, or one too long to count in milliseconds.
    #[error("an interval of {period:?} cannot be scheduled: it must be 1 s or more")]
    BadInterval {
        /// The interval as given.
        period: Duration,
    },
    /// A stored schedule that this version cannot read.
    #[error("unreadable stored schedule {spec:?}")]
    BadSpec {
        /// The stored text.
        spec: String,
    },
}

#[derive(Clone)]
enum Kind {
    Cron {
        cron: Box<Cron>,
        zone: Tz,
        /// The expression names wall times: no wildcard or step in its seconds, minutes or
        /// hours (single values, lists, ranges), whatever its other fields say.
        wall_times: bool,
    },
    Every(Duration),
}

/// When a job fires: a cron expression in a time zone, or a fixed interval.
///
/// Cron expressions have 5 fields (minute, hour, day of month, month, day of week) or 6 (seconds
/// first), in Vixie cron's syntax with its usual extensions (`L`, `W`, `#`, names of months and
/// days), as the `croner` crate parses them. They are read in an IANA time zone (UTC unless
/// given), with its daylight saving time rules:
/// - an expression that names wall times (no wildcard or step in its seconds, minutes or hours:
///   single values, lists and ranges alike, `30 2 * * *`, `30 2,14 * * *`, `0 1-3 * * 1-5`):
///   a wall time that a spring-forward gap skips (02:30 on the night clocks go from 02:00 to
///   03:00) fires at the first instant after the gap (03:00), once however many of the gap's
///   wall times it names; a wall time that a fall-back repeats (02:30 twice) fires once, at its
///   first occurrence;
/// - an expression with a wildcard or a step in its seconds, minutes or hours
///   (`*/15 * * * *`) fires at each real instant it names: in both passes of a fall-back, and
///   none in a gap.
///
/// A fixed interval fires at every multiple of it since the Unix epoch, in UTC: replicas agree on
/// the instants without talking to each other, whenever each of them started.
#[derive(Clone)]
pub struct Schedule {
    kind: Kind,
    spec: String,
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.spec)
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.spec)
    }
}

impl PartialEq for Schedule {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

impl Eq for Schedule {}

impl Schedule {
    /// A cron expression (5 or 6 fields) in time zone `zone` (an IANA name: `UTC`,
    /// `Europe/Berlin`).
    ///
    /// # Errors
    /// The expression does not parse, the zone is unknown, or the schedule never fires.
    pub fn cron(expression: &str, zone: &str) -> Result<Self, ScheduleError> {
        let expression = expression.split_whitespace().collect::<Vec<_>>().join(" ");
        let zone_parsed: Tz = zone.parse().map_err(|_| ScheduleError::UnknownZone {
            zone: zone.to_owned(),
        })?;
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(&expression)
            .map_err(|err| ScheduleError::InvalidExpression {
                expression: expression.clone(),
                reason: err.to_string(),
            })?;
        // A nickname names the expression it stands for (`@hourly` fires as `0 * * * *` does,
        // in both passes of a fall-back).
        let fields: Vec<&str> = nickname(&expression)
            .unwrap_or(&expression)
            .split(' ')
            .collect();
        let time_fields = &fields[..fields.len().saturating_sub(3).min(3)];
        let wall_times = time_fields.iter().all(|field| !field.contains(['*', '/']));
        let schedule = Self {
            spec: format!("cron {expression} in {}", zone_parsed.name()),
            kind: Kind::Cron {
                cron: Box::new(cron),
                zone: zone_parsed,
                wall_times,
            },
        };
        if schedule.next_after(Utc::now()).is_none() {
            return Err(ScheduleError::NeverFires {
                schedule: schedule.spec,
            });
        }
        Ok(schedule)
    }

    /// Every `period` (1 s or more), at the multiples of it since the Unix epoch.
    ///
    /// # Errors
    /// The period is under one second, or longer than milliseconds can count.
    pub fn every(period: Duration) -> Result<Self, ScheduleError> {
        if period < Duration::from_secs(1) || i64::try_from(period.as_millis()).is_err() {
            return Err(ScheduleError::BadInterval { period });
        }
        Ok(Self {
            spec: format!("every {}", humanize(period)),
            kind: Kind::Every(period),
        })
    }

    /// The schedule as the store keeps it (and [`from_spec`](Self::from_spec) reads it back):
    /// `cron EXPRESSION in ZONE` or `every PERIOD`. Two replicas with the same schedule have the
    /// same spec.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// The schedule a [`spec`](Self::spec) describes.
    ///
    /// # Errors
    /// The text is not a spec, or what it holds is refused as [`cron`](Self::cron) and
    /// [`every`](Self::every) refuse it.
    pub fn from_spec(spec: &str) -> Result<Self, ScheduleError> {
        let bad = || ScheduleError::BadSpec {
            spec: spec.to_owned(),
        };
        if let Some(rest) = spec.strip_prefix("cron ") {
            let (expression, zone) = rest.rsplit_once(" in ").ok_or_else(bad)?;
            return Self::cron(expression, zone);
        }
        if let Some(period) = spec.strip_prefix("every ") {
            let period = humantime::parse_duration(period).map_err(|_| bad())?;
            return Self::every(period);
        }
        Err(bad())
    }

    /// Whether this schedule fires at the same instants as `other`: the same spec, or the same
    /// expression in two names of one zone (`US/Eastern` and `America/New_York`, a link and
    /// its zone, or zones whose clocks agree from 1970 to 2100).
    pub fn same_instants(&self, other: &Self) -> bool {
        if self.spec == other.spec {
            return true;
        }
        let (Kind::Cron { zone: a, .. }, Kind::Cron { zone: b, .. }) = (&self.kind, &other.kind)
        else {
            return false;
        };
        let expression = |spec: &str| spec.rsplit_once(" in ").map(|(e, _)| e.to_owned());
        expression(&self.spec) == expression(&other.spec) && same_clocks(*a, *b)
    }

    /// How many instants of the schedule fall in (`after`, `until`], and the latest of them:
    /// counted by arithmetic for a fixed period, found one by one (at most `most`) for an
    /// expression.
    pub(crate) fn count_between(
        &self,
        after: DateTime<Utc>,
        until: DateTime<Utc>,
        most: usize,
    ) -> (u64, Option<DateTime<Utc>>) {
        if let Some((skipped_to, skipped)) = self.skip_to_last(after, until, 1) {
            let latest = self.next_after(skipped_to).filter(|n| *n <= until);
            return (skipped + u64::from(latest.is_some()), latest);
        }
        let (mut count, mut latest, mut at) = (0_u64, None, after);
        while let Some(next) = self.next_after(at).filter(|n| *n <= until) {
            count += 1;
            latest = Some(next);
            at = next;
            if count >= u64::try_from(most).unwrap_or(u64::MAX) {
                break;
            }
        }
        (count, latest)
    }

    /// Where a walk of the instants in (`after`, `until`] can start to see only the last
    /// `keep` of them, and how many it passes over: computed, not walked, for a fixed period
    /// (`every 1s` with a cursor a year old is 31 million instants); `None` when nothing is
    /// passed over or the schedule is an expression (walked instant by instant).
    pub(crate) fn skip_to_last(
        &self,
        after: DateTime<Utc>,
        until: DateTime<Utc>,
        keep: usize,
    ) -> Option<(DateTime<Utc>, u64)> {
        let Kind::Every(period) = &self.kind else {
            return None;
        };
        let period = i64::try_from(period.as_millis()).ok()?;
        let first = after.timestamp_millis().div_euclid(period);
        let last = until.timestamp_millis().div_euclid(period);
        let count = u64::try_from(last.checked_sub(first)?).ok()?;
        let skipped = count.checked_sub(u64::try_from(keep).ok()?)?;
        if skipped == 0 {
            return None;
        }
        let at = first
            .checked_add(i64::try_from(skipped).ok()?)?
            .checked_mul(period)?;
        Some((DateTime::from_timestamp_millis(at)?, skipped))
    }

    /// Whether a backlog of this schedule is passed over by arithmetic ([`skip_to_last`](Self::skip_to_last)):
    /// a fixed period. An expression's instants are found one by one.
    pub(crate) fn is_fixed_period(&self) -> bool {
        matches!(self.kind, Kind::Every(_))
    }

    /// The first instant of the schedule strictly after `after`; `None` when there is none (an
    /// expression whose instants ran out).
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.kind {
            Kind::Every(period) => {
                let period = i64::try_from(period.as_millis()).ok()?;
                let millis = after.timestamp_millis();
                let next = (millis.div_euclid(period) + 1).checked_mul(period)?;
                DateTime::from_timestamp_millis(next)
            }
            Kind::Cron {
                cron,
                zone,
                wall_times,
            } => {
                // An expression's instants are whole seconds; croner carries the fraction of
                // the instant it searches from into what it finds.
                let after = after.trunc_subsecs(0);
                let fixed = *wall_times;
                let next = next_in_wall_time(cron, *zone, after, fixed)?;
                // croner skips the wall times of a gap for an expression with a list or a
                // range (it keeps them only where every field is a single value): one that
                // names a wall time of the gap fires just after it.
                if fixed && let Some(gap) = after_a_gap(cron, *zone, after, next) {
                    return Some(gap);
                }
                // croner searches wall time: from the first pass of an hour a fall-back repeats,
                // it finds the wall time after that hour, and would skip the instants of its
                // second pass that an expression with a wildcard or a step names.
                if fixed {
                    return Some(next);
                }
                Some(second_pass(cron, *zone, after, next).unwrap_or(next))
            }
        }
    }
}

/// The first instant after `after` whose wall time in `zone` the expression names, as croner
/// finds it (a wall time repeated by a fall-back once, at its first occurrence).
fn next_in_wall_time(
    cron: &Cron,
    zone: Tz,
    after: DateTime<Utc>,
    fixed: bool,
) -> Option<DateTime<Utc>> {
    let mut from = after.with_timezone(&zone);
    // From inside the second pass of a repeated hour, croner finds the wall time's first
    // occurrence, which is before `after`. Its second occurrence is the answer for an
    // expression with a wildcard or a step; a fixed time fired at the first, so the search goes
    // on from the second.
    for _ in 0..3 {
        let next = cron.find_next_occurrence(&from, false).ok()?;
        let utc = next.with_timezone(&Utc);
        if utc > after {
            return Some(utc);
        }
        let second = zone.from_local_datetime(&next.naive_local()).latest()?;
        if !fixed && second.with_timezone(&Utc) > after {
            return Some(second.with_timezone(&Utc));
        }
        from = second.max(after.with_timezone(&zone));
    }
    None
}

/// The first instant in the second pass of a fall-back between `after` and `next` that the
/// expression names, if any: the repeated wall times are checked second by second (an hour at
/// most, and only on a night whose clocks go back). Each fall-back between them counts (a
/// yearly expression's instants are a spring and an autumn apart).
fn second_pass(
    cron: &Cron,
    zone: Tz,
    after: DateTime<Utc>,
    next: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    jumps(zone, after, next)
        .filter(|(_, seconds)| *seconds < 0)
        .find_map(|(high, seconds)| {
            let mut at = high.max(after + chrono::Duration::seconds(1));
            let end = (high + chrono::Duration::seconds(i64::from(-seconds))).min(next);
            while at < end {
                if cron
                    .is_time_matching(&at.with_timezone(&zone))
                    .unwrap_or(false)
                {
                    return Some(at);
                }
                at += chrono::Duration::seconds(1);
            }
            None
        })
}

/// The expression a nickname stands for, as Vixie cron defines them.
fn nickname(expression: &str) -> Option<&'static str> {
    Some(match expression.to_ascii_lowercase().as_str() {
        "@yearly" | "@annually" => "0 0 1 1 *",
        "@monthly" => "0 0 1 * *",
        "@weekly" => "0 0 * * 0",
        "@daily" | "@midnight" => "0 0 * * *",
        "@hourly" => "0 * * * *",
        _ => return None,
    })
}

/// Whether two zones' clocks agree from 1970 to 2100: a link and its zone (`US/Eastern`,
/// `America/New_York`) always do. Compared day by day, and to the second at each change.
fn same_clocks(a: Tz, b: Tz) -> bool {
    if a == b {
        return true;
    }
    let Some(mut at) = DateTime::from_timestamp(0, 0) else {
        return false;
    };
    let Some(end) = DateTime::from_timestamp(4_102_444_800, 0) else {
        return false;
    };
    let day = chrono::Duration::days(1);
    let mut before = offset_at(a, at);
    if offset_at(b, at) != before {
        return false;
    }
    while at < end {
        let next = at + day;
        let now = offset_at(a, next);
        if offset_at(b, next) != now {
            return false;
        }
        if now != before && transition(a, at, next) != transition(b, at, next) {
            return false;
        }
        (at, before) = (next, now);
    }
    true
}

/// The zone's offset from UTC at `t`.
fn offset_at(zone: Tz, t: DateTime<Utc>) -> chrono::FixedOffset {
    zone.offset_from_utc_datetime(&t.naive_utc()).fix()
}

/// How far apart the offsets are looked at when the zone's clock changes between two instants
/// are searched: less than any two changes of a zone ever were.
const JUMP_STEP: chrono::Duration = chrono::Duration::hours(6);

/// Each moment the zone's clocks jump between `after` and `next`, in order, with how many
/// seconds they jump (negative: back). Every change counts, not only the net one: between two
/// instants of a yearly expression, clocks go forward in spring and back in autumn.
fn jumps(
    zone: Tz,
    after: DateTime<Utc>,
    next: DateTime<Utc>,
) -> impl Iterator<Item = (DateTime<Utc>, i32)> {
    let mut low = after;
    std::iter::from_fn(move || {
        while low < next {
            let high = (low + JUMP_STEP).min(next);
            let (before, later) = (offset_at(zone, low), offset_at(zone, high));
            let from = low;
            low = high;
            if before != later {
                let at = transition(zone, from, high)?;
                return Some((at, later.local_minus_utc() - before.local_minus_utc()));
            }
        }
        None
    })
}

/// The first instant with the later offset between `after` and `next` (whole seconds), when
/// the zone's offset changes between them: the moment clocks jump.
fn transition(zone: Tz, after: DateTime<Utc>, next: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let offset = |t| offset_at(zone, t);
    let before = offset(after);
    if offset(next) == before {
        return None;
    }
    let (mut low, mut high) = (after, next);
    while (high - low).num_seconds() > 1 {
        let middle = low + chrono::Duration::seconds((high - low).num_seconds() / 2);
        if offset(middle) == before {
            low = middle;
        } else {
            high = middle;
        }
    }
    Some(high)
}

/// The first instant after a spring-forward gap between `after` and `next`, when the
/// expression names a wall time of the gap (one that never happened): the documented rule
/// fires it just after the gap, once. Each gap between them counts, the earliest first, and
/// whatever the clocks did between `after` and the gap (a fall-back in autumn).
fn after_a_gap(
    cron: &Cron,
    zone: Tz,
    after: DateTime<Utc>,
    next: DateTime<Utc>,
) -> Option<DateTime<Utc>> {
    jumps(zone, after, next)
        .filter(|(jump, skipped)| *skipped > 0 && *jump > after)
        .find_map(|(jump, skipped)| {
            // The gap's wall times, read at the offset before the jump, second by second (an
            // hour at most, on the nights clocks go forward).
            let before = offset_at(zone, jump - chrono::Duration::seconds(1));
            let first_skipped = jump.with_timezone(&before);
            (0..i64::from(skipped))
                .map(|s| first_skipped + chrono::Duration::seconds(s))
                .any(|wall| cron.is_time_matching(&wall).unwrap_or(false))
                .then_some(jump)
        })
}

/// `period` as the shortest humantime text (`30s`, `1h 30m`).
fn humanize(period: Duration) -> String {
    humantime::format_duration(Duration::from_millis(
        u64::try_from(period.as_millis()).unwrap_or(u64::MAX),
    ))
    .to_string()
}

#[cfg(test)]
mod tests;
