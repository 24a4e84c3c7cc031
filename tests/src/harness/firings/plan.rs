//! What the schedule workload changes under the replicas while the faults go on: each
//! configuration revision (its schedule and overlap policy), rolled out one replica at a time;
//! the clocks of the replicas (one right, one ahead, one behind); and the checks that depend on
//! them.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

/// The instants a revision's schedule fires at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Instants {
    /// `--every 1s`.
    EverySecond,
    /// `--every 2s`: the even seconds.
    Even,
    /// `--schedule '1-59/2 * * * * *'`: the odd seconds, none of `--every 2s`'s.
    Odd,
}

impl Instants {
    /// Whether `at` is one of these instants.
    pub(crate) fn contains(self, at: DateTime<Utc>) -> bool {
        at.timestamp_subsec_nanos() == 0
            && match self {
                Self::EverySecond => true,
                Self::Even => at.timestamp() % 2 == 0,
                Self::Odd => at.timestamp() % 2 != 0,
            }
    }
}

/// Revision `revision`'s configuration (the first is 1): its schedule arguments, its instants
/// and its overlap policy. The policies go allow, forbid, replace in turn, and the schedules
/// every second, then odd and even seconds in turn, so that each policy meets both and each
/// change after the first moves every instant (a firing run for an instant of the new schedule
/// before the change would show).
pub(crate) fn configuration(revision: u64) -> (Vec<&'static str>, Instants, &'static str) {
    let overlap = ["allow", "forbid", "replace"][usize::try_from((revision - 1) % 3).unwrap_or(0)];
    let (args, instants) = match revision {
        1 => (vec!["--every", "1s"], Instants::EverySecond),
        r if r % 2 == 0 => (vec!["--schedule", "1-59/2 * * * * *"], Instants::Odd),
        _ => (vec!["--every", "2s"], Instants::Even),
    };
    (args, instants, overlap)
}

/// The wall clock offset of replica `slot` (libfaketime's syntax, seconds): the first right,
/// the second ahead, the third behind, each by 1.5 s (more than a firing's period, so that a
/// leader ahead runs firings before a leader behind would, and one behind finds the cursor
/// ahead of its clock).
pub(crate) fn clock_offset(slot: usize) -> &'static str {
    match slot % 3 {
        0 => "+0",
        1 => "+1.5",
        _ => "-1.5",
    }
}

/// How far a replica's clock may be from the harness's: the largest [`clock_offset`].
pub(crate) const SKEW: std::time::Duration = std::time::Duration::from_millis(1500);

/// A schedule change as the record says it: when (by the changing leader's clock) and to
/// which revision's instants.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Change {
    pub(crate) at: DateTime<Utc>,
    pub(crate) instants: Instants,
    pub(crate) policy: &'static str,
}

/// The instants and overlap policy in force at `at`: those of the latest change at or before
/// it, the first revision's before any.
pub(crate) fn in_force(changes: &[Change], at: DateTime<Utc>) -> (Instants, &'static str) {
    changes
        .iter()
        .rev()
        .find(|c| c.at <= at)
        .map_or((Instants::EverySecond, "allow"), |c| (c.instants, c.policy))
}

impl Change {
    /// Whether `at` lies from `before` ahead of this change to `after` past it (the changing
    /// leader's clock may be off by [`SKEW`], and the old schedule's instants not handled by
    /// the change are counted missed).
    pub(crate) fn near(
        &self,
        at: DateTime<Utc>,
        before: chrono::Duration,
        after: chrono::Duration,
    ) -> bool {
        self.at - before <= at && at <= self.at + after
    }
}

/// One firing's COMMAND, from its start line to its end line (monotonic nanoseconds; no end
/// when it was killed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) scheduled: String,
    pub(crate) attempt: u32,
    pub(crate) token: u64,
    pub(crate) identity: String,
    pub(crate) start: i128,
    pub(crate) end: Option<i128>,
}

/// The spans of `log`'s lines: `SCHEDULED ATTEMPT TOKEN IDENTITY NS WALL` at a start, `end
/// SCHEDULED ATTEMPT TOKEN NS` at an end.
pub(crate) fn spans(log: &str) -> Vec<Span> {
    let mut spans: Vec<Span> = Vec::new();
    let mut open: BTreeMap<(String, u32, u64), usize> = BTreeMap::new();
    for line in log.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        match fields.as_slice() {
            ["end", scheduled, attempt, token, ns] => {
                let (Ok(attempt), Ok(token), Ok(ns)) = (attempt.parse(), token.parse(), ns.parse())
                else {
                    continue;
                };
                if let Some(i) = open.remove(&((*scheduled).to_owned(), attempt, token)) {
                    spans[i].end = Some(ns);
                }
            }
            [scheduled, attempt, token, identity, ns, _wall] => {
                let (Ok(attempt), Ok(token), Ok(start)) =
                    (attempt.parse(), token.parse(), ns.parse())
                else {
                    continue;
                };
                open.insert(((*scheduled).to_owned(), attempt, token), spans.len());
                spans.push(Span {
                    scheduled: (*scheduled).to_owned(),
                    attempt,
                    token,
                    identity: (*identity).to_owned(),
                    start,
                    end: None,
                });
            }
            _ => {}
        }
    }
    spans
}

/// Firings that ran beside another of the same term on a leader whose policy forbids it
/// (`forbid`, `replace`: the next starts only once the one before has returned), in words.
/// `policy` gives each replica incarnation's overlap policy. Spans whose end is unknown (the
/// COMMAND was killed) are left out.
pub(crate) fn overlaps(spans: &[Span], policy: &BTreeMap<String, &'static str>) -> Vec<String> {
    let mut by_term: BTreeMap<(u64, &str), Vec<&Span>> = BTreeMap::new();
    for span in spans {
        if policy
            .get(&span.identity)
            .is_some_and(|p| *p == "forbid" || *p == "replace")
        {
            by_term
                .entry((span.token, &span.identity))
                .or_default()
                .push(span);
        }
    }
    let mut found = Vec::new();
    for ((token, identity), mut term) in by_term {
        term.sort_by_key(|s| s.start);
        let mut running: Option<&Span> = None;
        for span in term {
            if let Some(before) = running
                && before.end.is_some_and(|end| end > span.start)
            {
                found.push(format!(
                    "{identity} (token {token}, {}): {} attempt {} started while {} attempt {} ran",
                    policy[identity],
                    span.scheduled,
                    span.attempt,
                    before.scheduled,
                    before.attempt
                ));
            }
            if span.end.is_some() {
                running = Some(span);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_change_after_the_first_moves_every_instant_and_the_policies_take_turns() {
        let at = |s: i64| DateTime::from_timestamp(s, 0).expect("instant");
        let (_, first, allow) = configuration(1);
        assert!(first.contains(at(10)) && first.contains(at(11)));
        assert_eq!(allow, "allow");
        for revision in 2..8 {
            let (_, before, _) = configuration(revision);
            let (_, after, _) = configuration(revision + 1);
            assert!((0..10).all(|s| before.contains(at(s)) != after.contains(at(s))));
        }
        let policies: Vec<&str> = (1..=6).map(|r| configuration(r).2).collect();
        assert_eq!(
            policies,
            ["allow", "forbid", "replace", "allow", "forbid", "replace"]
        );
        let changes = [Change {
            at: at(100),
            instants: Instants::Odd,
            policy: "forbid",
        }];
        assert_eq!(in_force(&changes, at(99)), (Instants::EverySecond, "allow"));
        assert_eq!(in_force(&changes, at(100)), (Instants::Odd, "forbid"));
    }

    #[test]
    fn firings_side_by_side_are_found_only_in_one_term_of_a_policy_that_forbids_them() {
        let log = "\
2026-12-05T10:00:01+00:00 1 7 f0.1 1000 0
2026-12-05T10:00:02+00:00 1 7 f0.1 1500 0
end 2026-12-05T10:00:01+00:00 1 7 2000
end 2026-12-05T10:00:02+00:00 1 7 2600
2026-12-05T10:00:03+00:00 1 8 f1.1 2100 0
end 2026-12-05T10:00:03+00:00 1 8 2200
2026-12-05T10:00:04+00:00 1 9 f2.1 3000 0
2026-12-05T10:00:05+00:00 1 9 f2.1 3100 0
";
        let spans = spans(log);
        assert_eq!(spans.len(), 5);
        assert_eq!(spans[0].end, Some(2000));
        assert_eq!(spans[3].end, None);
        let policy: BTreeMap<String, &'static str> = [
            ("f0.1".to_owned(), "forbid"),
            ("f1.1".to_owned(), "replace"),
            ("f2.1".to_owned(), "replace"),
        ]
        .into();
        let found = overlaps(&spans, &policy);
        // Token 7's two firings ran side by side; token 8's one ran beside token 7's (another
        // term: a leader that lost its term may still be stopping its work); token 9's first
        // was killed (no end): nothing can be said of it.
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("f0.1 (token 7, forbid)"), "{found:?}");
        let allow: BTreeMap<String, &'static str> = [("f0.1".to_owned(), "allow")].into();
        assert!(overlaps(&spans, &allow).is_empty());
    }
}
