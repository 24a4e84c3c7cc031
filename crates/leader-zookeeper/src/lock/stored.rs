//! What a lock's version names, written into it so that an update needs no read first.

use leader_core::Version;

/// What a version names: the two znodes' versions, the record znode's ephemeral owner (0 when
/// persistent), the record's token and the count in the election znode. Written as
/// `ELECTION.RECORD.OWNER.TOKEN.COUNT`.
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

    pub(crate) fn parse(version: &Version) -> Option<Self> {
        let mut parts = version.as_str().split('.');
        let stored = Self {
            election: parts.next()?.parse().ok()?,
            record: parts.next()?.parse().ok()?,
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
            record: -3,
            owner: -0x1234_abcd,
            token: 42,
            count: 42,
        };
        assert_eq!(Stored::parse(&stored.version()), Some(stored));
        for other in ["", "1", "1.2.3.4", "1.2.3.4.5.6", "a.b.c.d.e", "12"] {
            assert_eq!(Stored::parse(&Version::new(other)), None, "{other:?}");
        }
    }
}
