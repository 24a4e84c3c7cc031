//! The campaign's checker over the COMMANDs' log of terms, as pure functions so that it is
//! tested on hand-written logs.
//!
//! A term is one `start` line of a COMMAND (identity and fencing token). It stopped acting:
//! - at its own `stop` line, when it logged one;
//! - when it was frozen, if it was (keyed by identity and token): what a frozen COMMAND does after
//!   SIGCONT is the fence's business, and those writes must be refused;
//! - otherwise when the harness saw its COMMAND gone: after SIGKILLing that very term (identity
//!   and token, and only a kill after the term began), or without a `stop` line, as when its
//!   `leader` SIGKILLed it after the grace (the harness watches every term's COMMAND process; the
//!   time it saw it gone is never earlier than the death, so an overlap is never hidden),
//!   whichever came first;
//! - otherwise never: a term with no end is reported.
//!
//! A freeze or a kill marks every term its replica's log shows open, and a COMMAND that died
//! without a `stop` line (its term ended while the replica lived on) still looks open there: a
//! mark made after the COMMAND was seen gone ends nothing, and the term ended when it was seen
//! gone.
//!
//! No two terms may overlap, and fencing tokens must grow from one term to the next.

use std::collections::BTreeMap;

use crate::TermEvent as Event;

/// A term as the checker sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Term {
    /// The COMMAND's identity.
    pub identity: String,
    /// Its fencing token.
    pub token: u64,
    /// When it started (`CLOCK_MONOTONIC` ns).
    pub start: i128,
    /// When it stopped acting, if known.
    pub end: Option<i128>,
}

/// When a term was killed (or seen gone) or frozen: (identity, token) -> `CLOCK_MONOTONIC` ns.
pub type Marks = BTreeMap<(String, u64), i128>;

/// The highest token among `starts` (when each term started, and its token) that started
/// before `at`, or 0: a write at `at` with a lower token was made after a later term had begun.
#[must_use]
pub fn highest_started_before(starts: impl IntoIterator<Item = (i128, u64)>, at: i128) -> u64 {
    starts
        .into_iter()
        .filter(|(started, _)| *started < at)
        .map(|(_, token)| token)
        .max()
        .unwrap_or(0)
}

/// The terms in `events`, ordered by start, each with its end.
#[must_use]
pub fn terms(events: &[Event], killed: &Marks, frozen: &Marks) -> Vec<Term> {
    terms_seen(events, killed, frozen, &Marks::new())
}

/// [`terms`], with `gone`: when the harness saw each term's COMMAND gone (never earlier than it
/// died). A freeze after that froze nothing of the term, and a kill after it killed nothing.
#[must_use]
pub fn terms_seen(events: &[Event], killed: &Marks, frozen: &Marks, gone: &Marks) -> Vec<Term> {
    let mut terms: Vec<Term> = events
        .iter()
        .filter(|e| e.start)
        .map(|e| {
            let key = (e.identity.clone(), e.token);
            let after_start = |at: &i128| *at >= e.at;
            // A term may run its work more than once, one run after the other (a shard's
            // COMMAND restarted under a resized set's count): each start ends at the first stop
            // after it, and a freeze after that stop froze a later run, not this one.
            let stop = events
                .iter()
                .filter(|s| !s.start && s.identity == e.identity && s.token == e.token)
                .map(|s| s.at)
                .filter(after_start)
                .min();
            let running = |at: &i128| after_start(at) && stop.is_none_or(|s| *at <= s);
            let seen_gone = gone.get(&key).copied().filter(after_start);
            let before_gone = |at: &i128| seen_gone.is_none_or(|g| *at <= g);
            let killed_or_gone = match (killed.get(&key).copied().filter(after_start), seen_gone) {
                (Some(k), Some(g)) => Some(k.min(g)),
                (k, g) => k.or(g),
            };
            let end = frozen
                .get(&key)
                .copied()
                .filter(running)
                .filter(before_gone)
                .or(stop)
                .or(killed_or_gone);
            Term {
                identity: e.identity.clone(),
                token: e.token,
                start: e.at,
                end,
            }
        })
        .collect();
    terms.sort_by_key(|t| t.start);
    terms
}

/// What is wrong with `terms`: overlaps (counted), tokens that did not grow, terms with no end.
#[must_use]
pub fn check(terms: &[Term]) -> (usize, Vec<String>) {
    check_fenced(terms, |_| true)
}

/// [`check`], with the token order checked only among the terms `fenced` selects: the terms
/// of another project's client carry no fencing token of ours, yet may not overlap any term.
#[must_use]
pub fn check_fenced(terms: &[Term], fenced: impl Fn(&Term) -> bool) -> (usize, Vec<String>) {
    let mut overlaps = 0;
    let mut violations = Vec::new();
    for (j, later) in terms.iter().enumerate() {
        for earlier in &terms[..j] {
            match earlier.end {
                Some(end) if end <= later.start => {}
                // A term with no end is reported once, below, not as an overlap with each later one.
                None => {}
                Some(end) => {
                    overlaps += 1;
                    violations.push(format!(
                        "{} (token {}) started while {} (token {}) still acted: {:.1} ms of overlap",
                        later.identity,
                        later.token,
                        earlier.identity,
                        earlier.token,
                        (end - later.start) as f64 / 1e6
                    ));
                }
            }
        }
    }
    // Tokens grow with each acquisition, not with each start of its work: a holder may start
    // its work again within one term (the elector's `WorkExit::Restart`, a shard's COMMAND
    // restarted under a resized set's new count) after the earlier run ended, which the
    // overlap check above sees; the same holder's same token is that, not a token gone back.
    let mut previous: Option<&Term> = None;
    for term in terms.iter().filter(|t| fenced(t)) {
        if let Some(previous) = previous
            && (term.token < previous.token
                || (term.token == previous.token && term.identity != previous.identity))
        {
            violations.push(format!(
                "fencing token went from {} ({}) to {} ({})",
                previous.token, previous.identity, term.token, term.identity
            ));
        }
        previous = Some(term);
    }
    for term in terms.iter().filter(|t| t.end.is_none()) {
        violations.push(format!(
            "{} (token {}) never logged its end, and was neither killed nor frozen",
            term.identity, term.token
        ));
    }
    (overlaps, violations)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(start: bool, identity: &str, token: u64, at: i128) -> Event {
        Event {
            start,
            identity: identity.into(),
            token,
            at,
            pid: None,
        }
    }

    fn marks(entries: &[(&str, u64, i128)]) -> Marks {
        entries
            .iter()
            .map(|(identity, token, at)| (((*identity).to_owned(), *token), *at))
            .collect()
    }

    fn run(events: &[Event], killed: &Marks, frozen: &Marks) -> (usize, Vec<String>) {
        check(&terms(events, killed, frozen))
    }

    #[test]
    fn back_to_back_terms_of_one_identity_do_not_overlap() {
        let events = [
            event(true, "r0.1", 1, 100),
            event(false, "r0.1", 1, 200),
            event(true, "r1.1", 2, 300),
            event(false, "r1.1", 2, 400),
            event(true, "r0.1", 3, 500),
            event(false, "r0.1", 3, 600),
        ];
        assert_eq!(run(&events, &Marks::new(), &Marks::new()), (0, vec![]));
    }

    /// The case that made ten-round runs report overlaps: an identity that led cleanly, led
    /// again and was killed. Its first term ends at its own stop, not at the later kill.
    #[test]
    fn a_killed_term_after_an_earlier_clean_one_of_the_same_identity() {
        let events = [
            event(true, "r2.2", 3, 100),
            event(false, "r2.2", 3, 200),
            event(true, "r0.1", 4, 300),
            event(false, "r0.1", 4, 400),
            event(true, "r2.2", 5, 500),
            // r2.2's second term was SIGKILLed: no stop line.
            event(true, "r1.1", 6, 700),
            event(false, "r1.1", 6, 800),
        ];
        let killed = marks(&[("r2.2", 5, 650)]);
        assert_eq!(run(&events, &killed, &Marks::new()), (0, vec![]));
        // A kill mark of another term of that identity does not end this one.
        let wrong = marks(&[("r2.2", 3, 650)]);
        let (overlaps, violations) = run(&events, &wrong, &Marks::new());
        assert_eq!(overlaps, 0);
        assert!(
            violations[0].contains("r2.2 (token 5) never logged its end"),
            "{violations:?}"
        );
    }

    #[test]
    fn a_frozen_term_ends_when_it_was_frozen() {
        let events = [
            event(true, "r0.1", 1, 100),
            event(true, "r1.1", 2, 400),
            // Resumed long after the next term began, it logs its stop late.
            event(false, "r0.1", 1, 900),
            event(false, "r1.1", 2, 1000),
        ];
        let frozen = marks(&[("r0.1", 1, 150)]);
        assert_eq!(run(&events, &Marks::new(), &frozen), (0, vec![]));
        // Without the freeze it is an overlap of 0.0005 ms.
        let (overlaps, _) = run(&events, &Marks::new(), &Marks::new());
        assert_eq!(overlaps, 1);
    }

    /// A COMMAND that died without a `stop` line while its replica lived on still looks open
    /// in the replica's log: a later freeze or kill of the replica marks it too. It ended when
    /// it was seen gone, not at those marks.
    #[test]
    fn a_term_seen_gone_ends_then_whatever_is_marked_later() {
        let events = [
            event(true, "r1.1", 1, 100),
            // r1.1's COMMAND SIGKILLed by its leader after the grace, seen gone at 250.
            event(true, "r2.1", 2, 300),
            event(false, "r2.1", 2, 400),
        ];
        let gone = marks(&[("r1.1", 1, 250)]);
        let later = marks(&[("r1.1", 1, 350)]);
        for (killed, frozen) in [(&later, &Marks::new()), (&Marks::new(), &later)] {
            let terms = terms_seen(&events, killed, frozen, &gone);
            assert_eq!(check(&terms), (0, vec![]));
        }
        // Without the sight of it gone, the later mark is all there is: an overlap.
        let terms = terms_seen(&events, &later, &Marks::new(), &Marks::new());
        assert_eq!(check(&terms).0, 1);
        // Seen gone after the next term began: an overlap, whatever was marked.
        let late = marks(&[("r1.1", 1, 320)]);
        let terms = terms_seen(&events, &later, &Marks::new(), &late);
        assert_eq!(check(&terms).0, 1);
        let early_kill = marks(&[("r1.1", 1, 200)]);
        let terms = terms_seen(&events, &early_kill, &Marks::new(), &late);
        assert_eq!(
            check(&terms).0,
            0,
            "a kill before the next term, the end at the kill"
        );
    }

    /// A term that ran its work twice, one run after the other (a COMMAND restarted under a
    /// resized set's count), the second run frozen: the first run ended at its own stop, and
    /// the second's end is not the first's.
    #[test]
    fn a_term_run_twice_ends_each_run_at_its_own_end() {
        let events = [
            event(true, "r0.1", 2, 100),
            event(false, "r0.1", 2, 200),
            event(true, "r0.1", 2, 210),
            // The second run was frozen at 300, its replica killed: no stop line.
            event(true, "r1.1", 3, 400),
            event(false, "r1.1", 3, 500),
        ];
        let frozen = marks(&[("r0.1", 2, 300)]);
        assert_eq!(run(&events, &Marks::new(), &frozen), (0, vec![]));
        // Without the freeze, the second run never logged its end: not hidden by the first's.
        let (overlaps, violations) = run(&events, &Marks::new(), &Marks::new());
        assert_eq!(overlaps, 0);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].contains("r0.1 (token 2) never logged its end"));
    }

    #[test]
    fn a_real_overlap_is_caught() {
        let events = [
            event(true, "r0.1", 1, 100),
            event(true, "r1.1", 2, 150),
            event(false, "r0.1", 1, 200),
            event(false, "r1.1", 2, 300),
        ];
        let (overlaps, violations) = run(&events, &Marks::new(), &Marks::new());
        assert_eq!(overlaps, 1);
        assert!(violations[0].starts_with("r1.1 (token 2) started while r0.1 (token 1)"));
        // A kill of that term before the next began is no excuse for a stop logged after it.
        let killed = marks(&[("r0.1", 1, 120)]);
        assert_eq!(run(&events, &killed, &Marks::new()).0, 1);
    }

    #[test]
    fn a_missing_end_is_reported_and_a_kill_before_the_start_does_not_count() {
        let events = [event(true, "r0.1", 1, 100), event(true, "r1.1", 2, 300)];
        let killed = marks(&[("r0.1", 1, 50), ("r1.1", 2, 400)]);
        let (overlaps, violations) = run(&events, &killed, &Marks::new());
        assert_eq!(overlaps, 0);
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(violations[0].contains("r0.1 (token 1) never logged its end"));
    }

    #[test]
    fn tokens_must_grow() {
        let events = [
            event(true, "r0.1", 5, 100),
            event(false, "r0.1", 5, 200),
            event(true, "r1.1", 5, 300),
            event(false, "r1.1", 5, 400),
        ];
        let (_, violations) = run(&events, &Marks::new(), &Marks::new());
        assert!(
            violations[0].contains("fencing token went from 5"),
            "{violations:?}"
        );
    }

    /// A holder that starts its work again within its term (after the earlier run ended) keeps
    /// its token; another holder with that token, or a lower one, is a violation.
    #[test]
    fn work_started_again_in_its_term_keeps_the_token() {
        let again = [
            event(true, "r0.1", 5, 100),
            event(false, "r0.1", 5, 200),
            event(true, "r0.1", 5, 240),
            event(false, "r0.1", 5, 400),
        ];
        let (overlaps, violations) = run(&again, &Marks::new(), &Marks::new());
        assert_eq!((overlaps, violations.len()), (0, 0), "{violations:?}");
        let back = [
            event(true, "r0.1", 5, 100),
            event(false, "r0.1", 5, 200),
            event(true, "r0.1", 4, 240),
            event(false, "r0.1", 4, 400),
        ];
        let (_, violations) = run(&back, &Marks::new(), &Marks::new());
        assert!(
            violations[0].contains("fencing token went from 5"),
            "{violations:?}"
        );
    }

    #[test]
    fn peers_tokens_are_not_ordered_but_their_overlaps_count() {
        let events = [
            event(true, "r0.1", 5, 100),
            event(false, "r0.1", 5, 200),
            event(true, "k2.1", 3, 300),
            event(false, "k2.1", 3, 400),
            event(true, "r1.1", 6, 350),
            event(false, "r1.1", 6, 500),
        ];
        let terms = terms(&events, &Marks::new(), &Marks::new());
        let (overlaps, violations) = check_fenced(&terms, |t| !t.identity.starts_with('k'));
        assert_eq!(overlaps, 1, "{violations:?}");
        assert!(
            violations.iter().all(|v| !v.contains("fencing token")),
            "{violations:?}"
        );
        let (_, all) = check(&terms);
        assert!(all.iter().any(|v| v.contains("fencing token")), "{all:?}");
    }
}
