//! What a fault campaign saw, and the table BENCHMARKS.md quotes.

use std::fmt::Write as _;
use std::time::Duration;

use super::campaign::{Backend, Fault};

/// What a campaign saw.
#[derive(Clone, Debug)]
pub struct Report {
    /// The backend.
    pub backend: Backend,
    /// How many of the replicas were another project's client.
    pub peers: usize,
    /// Each fault injected, with the time from it (for a server restart or freeze: from the
    /// server being back; for an outage: from its end) to the next leader's COMMAND starting;
    /// `None` if no leader came.
    pub recoveries: Vec<(Fault, Option<Duration>)>,
    /// Leadership terms seen (COMMAND starts).
    pub terms: usize,
    /// Terms of the other project's replicas among them.
    pub peer_terms: usize,
    /// Changes of leader from one of our replicas to a peer, and back.
    pub handovers_to_peers: usize,
    /// Changes of leader from a peer to one of our replicas.
    pub handovers_from_peers: usize,
    /// Pairs of terms that overlapped.
    pub overlaps: usize,
    /// Writes to the fenced sink.
    pub writes: usize,
    /// Writes the sink refused (their token was below one already accepted).
    pub stale_refused: usize,
    /// Writes the sink accepted although a term with a higher token had started before them.
    pub stale_accepted: usize,
    /// For each frozen leader: from its `leader` being resumed to its COMMAND stopped.
    pub resumed_stops: Vec<Duration>,
    /// For each full outage: the most failed attempts a second of any one replica during it.
    pub outage_rates: Vec<f64>,
    /// Every broken rule, in words; empty when all held.
    pub violations: Vec<String>,
}

impl Report {
    /// The slowest recovery after `fault`, if it was injected (`None` inside: a leader never
    /// came).
    #[must_use]
    pub fn worst(&self, fault: Fault) -> Option<Option<Duration>> {
        self.recoveries
            .iter()
            .filter(|(f, _)| *f == fault)
            .map(|(_, d)| *d)
            .reduce(|a, b| match (a, b) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            })
    }

    /// A Markdown table of reports: faults, terms, overlaps, stale writes, the worst recovery
    /// per fault, and the worst rate of failed attempts during an outage.
    #[must_use]
    pub fn table(reports: &[Self]) -> String {
        let mut out = String::from(
            "| backend | faults | terms | overlaps | writes | stale refused | stale accepted |",
        );
        for fault in Fault::ALL {
            let _ = write!(out, " worst {} |", fault.name());
        }
        out.push_str(" failed attempts/s in an outage |\n|---|---|---|---|---|---|---|");
        out.push_str(&"---|".repeat(Fault::ALL.len() + 1));
        for r in reports {
            let backend = if r.peers > 0 {
                format!(
                    "{} + {} kubert ({} of its terms, {} handovers to it, {} from it)",
                    r.backend.name(),
                    r.peers,
                    r.peer_terms,
                    r.handovers_to_peers,
                    r.handovers_from_peers
                )
            } else {
                r.backend.name().to_owned()
            };
            let _ = write!(
                out,
                "\n| {backend} | {} | {} | {} | {} | {} | {} |",
                r.recoveries.len(),
                r.terms,
                r.overlaps,
                r.writes,
                r.stale_refused,
                r.stale_accepted
            );
            for fault in Fault::ALL {
                let lost = r
                    .recoveries
                    .iter()
                    .filter(|(f, d)| *f == fault && d.is_none())
                    .count();
                let cell = match r.worst(fault) {
                    Some(_) if fault.of_a_member() => format!("{lost} leaderships lost"),
                    None => "n/a".to_owned(),
                    Some(None) => "NO LEADER".to_owned(),
                    Some(Some(d)) => format!("{} ms", d.as_millis()),
                };
                let _ = write!(out, " {cell} |");
            }
            let rate = r
                .outage_rates
                .iter()
                .copied()
                .reduce(f64::max)
                .map_or("n/a".to_owned(), |rate| format!("{rate:.2}"));
            let _ = write!(out, " {rate} |");
        }
        out.push('\n');
        out
    }
}
