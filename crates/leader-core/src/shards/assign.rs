//! The fair share: who should own how many shards, and which shards move. Every member
//! computes the same plan from the same view of the store, so that they agree without talking.

use std::collections::BTreeMap;
use std::ops::Bound;

/// A member's fair share of `count` shards among `members` (each with the number of shards it
/// owns now), in proportion to its `weight` (a drained member's is 0): with equal weights
/// `count / n` each, and one more for `count % n` of them. The shards left over by the
/// rounding go to the members whose exact share the rounding cut the most, then to those
/// that own the most now (then by identity), so that reaching the share moves as few shards
/// as possible. When every member weighs 0, they weigh alike: a set is never drained whole.
pub(crate) fn shares(
    count: u32,
    members: &BTreeMap<String, usize>,
    weight: impl Fn(&str) -> u32,
) -> BTreeMap<String, usize> {
    if members.is_empty() {
        return BTreeMap::new();
    }
    let mut weights: Vec<u64> = members.keys().map(|m| u64::from(weight(m))).collect();
    let mut total: u64 = weights.iter().sum();
    if total == 0 {
        weights.fill(1);
        total = weights.len() as u64;
    }
    let count = u64::from(count);
    // (member, owned, whole share, what the rounding cut off it, in 1/total of a shard)
    let mut order: Vec<(&String, usize, u64, u64)> = members
        .iter()
        .zip(&weights)
        .map(|((m, &owned), &w)| (m, owned, count * w / total, count * w % total))
        .collect();
    let given: u64 = order.iter().map(|&(_, _, base, _)| base).sum();
    let extra = count - given;
    order.sort_by(|a, b| {
        b.3.cmp(&a.3)
            .then_with(|| b.1.cmp(&a.1))
            .then_with(|| a.0.cmp(b.0))
    });
    order
        .into_iter()
        .enumerate()
        .map(|(i, (member, _, base, _))| {
            let share = base + u64::from((i as u64) < extra);
            (member.clone(), usize::try_from(share).unwrap_or(usize::MAX))
        })
        .collect()
}

/// The shards this member gives away, each with the member it goes to: every live member's
/// (those with a share) surplus over its share, in the order of `owners`, paired with every
/// other member's room under its share (the emptiest first), the same pairing on every member.
///
/// Only this member's own shards are ranked, and only when it owns more than its share: the
/// pairing needs no more than how many shards the others give, so a balanced set costs a pass
/// over the members, whatever the number of shards.
pub(crate) fn gifts(
    me: &str,
    owners: &BTreeMap<String, Vec<u32>>,
    shares: &BTreeMap<String, usize>,
) -> Vec<(u32, String)> {
    let surplus_of = |member: &str, owned: &[u32]| {
        shares
            .get(member)
            .map_or(0, |&share| owned.len().saturating_sub(share))
    };
    let Some(mine) = owners.get(me).filter(|owned| surplus_of(me, owned) > 0) else {
        return Vec::new();
    };
    // The receivers' places this member's surplus takes: after the surplus of the members
    // before it in `owners`.
    let before: usize = owners
        .range::<str, _>((Bound::Unbounded, Bound::Excluded(me)))
        .map(|(member, owned)| surplus_of(member, owned))
        .sum();
    let mut room: Vec<(usize, &str, usize)> = shares
        .iter()
        .map(|(member, &share)| {
            let owned = owners.get(member).map_or(0, Vec::len);
            (owned, member.as_str(), share.saturating_sub(owned))
        })
        .filter(|&(_, _, room)| room > 0)
        .collect();
    if room.is_empty() {
        return Vec::new();
    }
    room.sort_unstable();
    let receivers = room
        .iter()
        .flat_map(|&(_, member, room)| std::iter::repeat_n(member, room))
        .skip(before);
    // The shards that hash last for their owner go first.
    let share = shares.get(me).copied().unwrap_or(0);
    let mut mine = mine.clone();
    mine.sort_by_cached_key(|&shard| std::cmp::Reverse(affinity(me, shard)));
    mine.into_iter()
        .skip(share)
        .zip(receivers)
        .map(|(shard, to)| (shard, to.to_owned()))
        .collect()
}

/// How much `member` likes `shard` (rendezvous hashing): free shards are taken, and surplus
/// ones kept, in this order, so that members spread over the shards without coordinating and
/// a member that comes back prefers the shards it liked before.
pub(crate) fn affinity(member: &str, shard: u32) -> u64 {
    #[cfg(test)]
    tests::AFFINITIES.with(|n| n.set(n.get() + 1));
    // FNV alone orders the shards alike for identities that differ in a last character
    // (`replica-1`, `replica-2`), and every member would reach for the same free shards: a
    // finaliser (MurmurHash3's) mixes every bit into the order.
    mix(fnv1a(
        member.as_bytes(),
        fnv1a(&shard.to_be_bytes(), FNV_OFFSET),
    ))
}

fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// FNV-1a's starting value.
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a: stable across builds and platforms, so that replicas built apart agree.
pub(crate) fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    bytes.iter().fold(seed, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A stable, name-safe hash of `text`: 16 hex digits.
pub(crate) fn hash_hex(text: &str) -> String {
    format!("{:016x}", fnv1a(text.as_bytes(), FNV_OFFSET))
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// How many times this thread ranked a shard for a member.
        pub(super) static AFFINITIES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    fn affinities() -> usize {
        AFFINITIES.with(std::cell::Cell::get)
    }

    fn owners(list: &[(&str, &[u32])]) -> BTreeMap<String, Vec<u32>> {
        list.iter()
            .map(|(m, s)| ((*m).to_owned(), s.to_vec()))
            .collect()
    }

    fn counts(owners: &BTreeMap<String, Vec<u32>>) -> BTreeMap<String, usize> {
        owners.iter().map(|(m, s)| (m.clone(), s.len())).collect()
    }

    #[test]
    fn shares_add_up_and_differ_by_at_most_one() {
        for count in 0..40u32 {
            for n in 1..9usize {
                let members: BTreeMap<String, usize> =
                    (0..n).map(|i| (format!("m{i}"), i % 3)).collect();
                let shares = shares(count, &members, |_| 1);
                assert_eq!(shares.values().sum::<usize>(), count as usize);
                let (min, max) = (shares.values().min(), shares.values().max());
                assert!(
                    max.unwrap() - min.unwrap() <= 1,
                    "{count} over {n}: {shares:?}"
                );
            }
        }
        assert!(shares(5, &BTreeMap::new(), |_| 1).is_empty());
    }

    #[test]
    fn the_extra_shard_stays_with_those_who_have_it() {
        // 10 over 3: whoever owns 4 keeps 4, so nothing moves.
        let members = BTreeMap::from([("a".into(), 3), ("b".into(), 4), ("c".into(), 3)]);
        let shares = shares(10, &members, |_| 1);
        assert_eq!(shares["b"], 4);
        assert_eq!((shares["a"], shares["c"]), (3, 3));
    }

    #[test]
    fn a_join_moves_only_what_the_newcomer_gets() {
        let before = owners(&[("a", &[0, 1, 2, 3, 4]), ("b", &[5, 6, 7, 8, 9]), ("c", &[])]);
        let shares = shares(10, &counts(&before), |_| 1);
        let all: Vec<(u32, String)> = ["a", "b", "c"]
            .iter()
            .flat_map(|me| gifts(me, &before, &shares))
            .collect();
        // c's share is 3: three shards move, all to c, from both a and b.
        assert_eq!(all.len(), 3, "{all:?}");
        assert!(all.iter().all(|(_, to)| to == "c"));
        let from_a = all.iter().filter(|(s, _)| *s < 5).count();
        assert!((1..=2).contains(&from_a), "{all:?}");
    }

    #[test]
    fn gifts_fill_the_emptiest_first_and_never_overfill() {
        let now = owners(&[("a", &[0, 1, 2, 3, 4, 5, 6]), ("b", &[7]), ("c", &[])]);
        let shares = shares(8, &counts(&now), |_| 1);
        let gifts = gifts("a", &now, &shares);
        let to_b = gifts.iter().filter(|(_, to)| to == "b").count();
        let to_c = gifts.iter().filter(|(_, to)| to == "c").count();
        assert_eq!(shares.values().sum::<usize>(), 8);
        assert_eq!(1 + to_b, shares["b"]);
        assert_eq!(to_c, shares["c"]);
    }

    #[test]
    fn balanced_owners_give_nothing() {
        let now = owners(&[("a", &[0, 1, 2]), ("b", &[3, 4]), ("c", &[5, 6])]);
        let shares = shares(7, &counts(&now), |_| 1);
        for me in ["a", "b", "c"] {
            assert!(gifts(me, &now, &shares).is_empty());
        }
    }

    #[test]
    fn gifts_rank_only_the_givers_own_shards_and_only_when_over_its_share() {
        // 10,000 shards over 10 members, balanced: nobody ranks a shard.
        let balanced: BTreeMap<String, Vec<u32>> = (0..10u32)
            .map(|m| (format!("m{m}"), (m * 1000..(m + 1) * 1000).collect()))
            .collect();
        let shares = shares(10_000, &counts(&balanced), |_| 1);
        let before = affinities();
        for m in 0..10 {
            assert!(gifts(&format!("m{m}"), &balanced, &shares).is_empty());
        }
        assert_eq!(affinities(), before, "a balanced set ranked shards");

        // A newcomer: each giver ranks its own 1,000 shards once, not everyone's, and the
        // pairing is the same as when every giver's surplus is listed in order.
        let mut joined = balanced.clone();
        joined.insert("m10".into(), Vec::new());
        let shares = super::shares(10_000, &counts(&joined), |_| 1);
        let before = affinities();
        let given = gifts("m3", &joined, &shares);
        assert_eq!(affinities() - before, 1000);
        assert_eq!(given.len(), 1000 - shares["m3"]);
        assert!(
            given
                .iter()
                .all(|(s, to)| (3000..4000).contains(s) && to == "m10")
        );
        let all: usize = (0..11)
            .map(|m| gifts(&format!("m{m}"), &joined, &shares).len())
            .sum();
        assert_eq!(all, shares["m10"], "every gift has a receiver, none more");
    }

    #[test]
    fn hashes_are_stable() {
        // Replicas built with other compilers must agree on these.
        assert_eq!(hash_hex(""), "cbf29ce484222325");
        assert_eq!(hash_hex("a"), "af63dc4c8601ec8c");
    }

    #[test]
    fn shares_follow_the_weights() {
        let owned: BTreeMap<String, usize> = [("a", 0), ("b", 5), ("c", 3)]
            .map(|(m, o)| (m.to_owned(), o))
            .into();
        let weight = |w: [u32; 3]| move |m: &str| w[usize::from(m.as_bytes()[0] - b'a')];
        let of = |shares: BTreeMap<String, usize>| shares.into_values().collect::<Vec<_>>();
        assert_eq!(of(shares(8, &owned, weight([2, 1, 1]))), [4, 2, 2]);
        // The rounding's leftover goes to the share it cut the most: 10 * 2/4 = 5 exactly,
        // 2.5 each for the others, one of whom (b, owning the most) gets the leftover.
        assert_eq!(of(shares(10, &owned, weight([2, 1, 1]))), [5, 3, 2]);
        // A drained member's share is 0, and the leftover never goes to it.
        assert_eq!(of(shares(9, &owned, weight([0, 1, 1]))), [0, 5, 4]);
        assert_eq!(of(shares(9, &owned, weight([1, 0, 0]))), [9, 0, 0]);
        // Everyone drained: the set is shared as if nobody were.
        assert_eq!(of(shares(9, &owned, weight([0, 0, 0]))), [3, 3, 3]);
        for count in 0..50 {
            let total: usize = shares(count, &owned, weight([3, 0, 7])).values().sum();
            assert_eq!(total, count as usize);
        }
    }
}
