//! What a lock's version names, written into it so that an update needs no read first.

use leader_core::{LockError, Version};

use crate::error::BACKEND;

/// What a version names: the two znodes' versions, the record znode's ephemeral owner (0 when
/// persistent), the record's token and the count in the election znode. Written as
/// `ELECTION.RECORD.OWNER.TOKEN.COUNT`.
///
/// Znode versions start at 0 and only grow, so a version this lock gave out is never negative;
/// ZooKeeper reads an expected version of -1 as "any version", which would turn a
/// compare-and-set into a blind write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stored {
    pub(crate) election: i32,
    pub(crate) record: i32,
    pub(crate) owner: i64,
    pub(crate) token: u64,
    pub(crate) count: u64,
}

impl Stored {
    pub(crate) fn version(self) -> Version {
        Version::new(format!(
            "{}.{}.{:x}.{}.{}",
            self.election,
            self.record,
            self.owner.cast_unsigned(),
            self.token,
            self.count
        ))
    }

    /// The parts of a version a write expects, or a conflict for a version this lock never
    /// gave out: it names no znodes, so it cannot match.
    pub(crate) fn expected(version: &Version) -> Result<Self, LockError> {
        Self::parse(version).ok_or_else(|| LockError::conflict(BACKEND))
    }

    /// The version's parts, or `None` for a version this lock never gave out (malformed, or a
    /// negative znode version).
    pub(crate) fn parse(version: &Version) -> Option<Self> {
        let mut parts = version.as_str().split('.');
        let znode_version = |part: &str| part.parse::<i32>().ok().filter(|v| *v >= 0);
        let stored = Self {
            election: znode_version(parts.next()?)?,
            record: znode_version(parts.next()?)?,
            owner: u64::from_str_radix(parts.next()?, 16).ok()?.cast_signed(),
            token: parts.next()?.parse().ok()?,
            count: parts.next()?.parse().ok()?,
        };
        parts.next().is_none().then_some(stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_round_trip_and_refuse_others() {
        let stored = Stored {
            election: 7,
            record: 3,
            owner: -0x1234_abcd,
            token: 42,
            count: 42,
        };
        assert_eq!(Stored::parse(&stored.version()), Some(stored));
        for other in ["", "1", "1.2.3.4", "1.2.3.4.5.6", "a.b.c.d.e", "12"] {
            assert_eq!(Stored::parse(&Version::new(other)), None, "{other:?}");
        }
    }

    /// A negative znode version would reach ZooKeeper as "any version" (-1) or as a version
    /// no znode has: neither is one this lock gave out.
    #[test]
    fn negative_znode_versions_are_refused() {
        let stored = Stored {
            election: 7,
            record: 3,
            owner: 0x1234_abcd,
            token: 42,
            count: 42,
        };
        for (election, record) in [(-1, 3), (7, -1), (-2, -5), (i32::MIN, 0)] {
            let version = Stored {
                election,
                record,
                ..stored
            }
            .version();
            assert_eq!(Stored::parse(&version), None, "{version:?}");
        }
        assert_eq!(
            Stored::parse(&Version::new("0.0.0.0.0")).map(|s| (s.election, s.record)),
            Some((0, 0))
        );
    }
}
