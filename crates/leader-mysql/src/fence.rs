//! The fencing-token floor of a lock: every term it starts gets a token above every token it
//! has seen (S5), also after the row was deleted or a backup restored (the row's own count would
//! start over). The table lock and the `GET_LOCK` lock both keep it through this one type.

use std::sync::Mutex;

/// How many recent versions a floor remembers the tokens of: enough for the versions an elector
/// may still write over, while a clone of the lock reads the row at the same time.
const RECENT: usize = 8;

/// The tokens one lock has read or written, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct TokenFloor {
    seen: Mutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    /// The highest token read or written.
    highest: u64,
    /// Recent versions and the token each held, oldest first.
    recent: Vec<(i64, u64)>,
}

impl TokenFloor {
    /// Notes a record read or written: `token`, stored at `version` (when it is one of the
    /// table's).
    pub(crate) fn seen(&self, version: Option<i64>, token: u64) {
        let mut seen = self.lock();
        seen.highest = seen.highest.max(token);
        if let Some(version) = version {
            seen.recent.retain(|(v, _)| *v != version);
            if seen.recent.len() == RECENT {
                seen.recent.remove(0);
            }
            seen.recent.push((version, token));
        }
    }

    /// The token of a new term that asks for `token`: above every token seen.
    pub(crate) fn new_term(&self, token: u64) -> u64 {
        let highest = self.lock().highest;
        // Equal is taken too: the highest token seen was issued already.
        if token <= highest {
            highest.saturating_add(1)
        } else {
            token
        }
    }

    /// The token of the holder's write of `token` over the record stored at version `expected`:
    /// a write of the token stored there carries its term on (a renewal, an extension); any
    /// other token starts a new term, which goes above every token seen. `None` when that
    /// cannot be told: a version this lock has not seen (read or renewed by a shard set's
    /// batch), under a token not above every token seen; the token stored there decides. A
    /// version remembered is trusted: every writer of the table moves the version with the row.
    pub(crate) fn holder_write(&self, expected: i64, token: u64) -> Option<u64> {
        let seen = self.lock();
        let stored = seen
            .recent
            .iter()
            .find(|(version, _)| *version == expected)
            .map(|&(_, stored)| stored);
        let highest = seen.highest;
        drop(seen);
        match stored {
            Some(stored) if stored == token => Some(token),
            Some(_) => Some(self.new_term(token)),
            None if token > highest => Some(token),
            None => None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_term_goes_above_every_token_seen() {
        let floor = TokenFloor::default();
        assert_eq!(floor.new_term(1), 1);
        floor.seen(Some(10), 5);
        assert_eq!(floor.new_term(3), 6, "below the highest");
        assert_eq!(floor.new_term(5), 6, "the highest itself was issued");
        assert_eq!(floor.new_term(9), 9, "above it, as asked");
        floor.seen(None, u64::MAX);
        assert_eq!(floor.new_term(1), u64::MAX, "saturates");
    }

    #[test]
    fn a_holders_write_carries_its_term_on_and_an_acquisition_goes_above() {
        let floor = TokenFloor::default();
        floor.seen(Some(10), 2);
        // The row's count restored to 1: read at version 11, taken again with 1 + 1.
        floor.seen(Some(11), 1);
        assert_eq!(
            floor.holder_write(11, 2),
            Some(3),
            "an acquisition by update"
        );
        assert_eq!(
            floor.holder_write(11, 1),
            Some(1),
            "the stored term carried on"
        );
        floor.seen(Some(12), 3);
        assert_eq!(
            floor.holder_write(12, 3),
            Some(3),
            "a renewal keeps its token"
        );
        assert_eq!(floor.holder_write(99, 3), None, "a version never seen");
        assert_eq!(floor.holder_write(99, 4), Some(4), "above every token seen");
        // Older versions are still known while a clone reads the row in between.
        floor.seen(Some(13), 3);
        assert_eq!(floor.holder_write(12, 3), Some(3));
        for version in 20..20 + RECENT as i64 {
            floor.seen(Some(version), 3);
        }
        assert_eq!(floor.holder_write(12, 3), None, "forgotten after {RECENT}");
    }
}
