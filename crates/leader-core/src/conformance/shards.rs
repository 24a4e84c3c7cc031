//! The shard protocol on a backend (S12): members split a set evenly, a leave and a crash move
//! the shards, no shard ever has two owners, and a member with another count takes none.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{LockFactory, unique};
use crate::backend::{Known, Renewal, Reread, member_key, roster_key, shard_key};
use crate::background::{LEASE, RENEW, RETRY};
use crate::record::Version;
use crate::{
    CancellationToken, LeaderElectionRecord, LockError, LockSet, ResourceLock, Shards, ShardsError,
    ShardsState,
};

/// One interval of a shard's work on one member, as the work saw it.
#[derive(Clone, Debug)]
pub struct Interval {
    /// The member's identity.
    pub member: String,
    /// The term's fencing token.
    pub token: u64,
    /// When the work started.
    pub start: Instant,
    /// When its future was dropped, if it was.
    pub end: Option<Instant>,
}

/// The work intervals of every shard of a set, to check that no shard ever had two owners.
#[derive(Clone, Debug, Default)]
pub struct ShardLog(Arc<Mutex<BTreeMap<u32, Vec<Interval>>>>);

impl ShardLog {
    fn intervals(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Vec<Interval>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Work for [`Shards::run_per_shard`] that logs its interval and runs until dropped.
    pub fn work(
        &self,
        member: &str,
    ) -> impl Fn(u32, crate::Leadership) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
    + Send
    + Sync
    + 'static {
        let (log, member) = (self.clone(), member.to_owned());
        move |shard, term| {
            let index = {
                let mut intervals = log.intervals();
                let list = intervals.entry(shard).or_default();
                list.push(Interval {
                    member: member.clone(),
                    token: term.fencing_token(),
                    start: Instant::now(),
                    end: None,
                });
                list.len() - 1
            };
            let running = Running {
                log: log.clone(),
                shard,
                index,
            };
            Box::pin(async move {
                let _running = running;
                std::future::pending::<()>().await;
            })
        }
    }

    /// Panics unless every shard's intervals follow one another (each ended before the next
    /// began) with growing fencing tokens.
    pub fn check(&self, context: &str) {
        for (shard, list) in self.intervals().iter() {
            let mut list = list.clone();
            list.sort_by_key(|i| i.start);
            for pair in list.windows(2) {
                let (a, b) = (&pair[0], &pair[1]);
                let end = a.end.unwrap_or_else(|| {
                    panic!(
                        "{context}: shard {shard} had two owners: {a:?} still ran when {b:?} began"
                    )
                });
                assert!(
                    end <= b.start,
                    "{context}: shard {shard} had two owners: {a:?} and {b:?}"
                );
                assert!(
                    b.token > a.token,
                    "{context}: shard {shard}: the fencing token of {b:?} is not above {a:?}"
                );
            }
        }
    }

    /// When the work of `shard` started, every time.
    pub fn starts(&self, shard: u32) -> Vec<Instant> {
        self.intervals()
            .get(&shard)
            .map(|list| list.iter().map(|i| i.start).collect())
            .unwrap_or_default()
    }

    /// How many times a shard changed owner, over every shard.
    pub fn moves(&self) -> usize {
        self.moves_by_shard().values().sum()
    }

    /// How many times each shard changed owner (a term of it starting on another member than
    /// its last).
    pub fn moves_by_shard(&self) -> BTreeMap<u32, usize> {
        self.intervals()
            .iter()
            .map(|(&shard, list)| {
                let moves = list
                    .windows(2)
                    .filter(|w| w[0].member != w[1].member)
                    .count();
                (shard, moves)
            })
            .collect()
    }

    /// Whether the work running agrees with what `members` (identity, state) publish: each
    /// shard a member owns has that member's work running, and no other. A member publishes
    /// a shard before its work (a task of its own) has started.
    pub fn agrees(&self, members: &[(&str, &watch::Receiver<ShardsState>)]) -> bool {
        let intervals = self.intervals();
        let running: BTreeMap<u32, &str> = intervals
            .iter()
            .filter_map(|(&shard, list)| {
                let last = list.last()?;
                last.end.is_none().then_some((shard, last.member.as_str()))
            })
            .collect();
        let mut published = BTreeMap::new();
        for (member, state) in members {
            for (&shard, term) in &state.borrow().owned {
                if !term.is_lost() {
                    published.insert(shard, *member);
                }
            }
        }
        running == published
    }

    /// The intervals of the shards whose work started after `since`, for a message.
    pub fn since(&self, since: Instant) -> BTreeMap<u32, Vec<Interval>> {
        self.intervals()
            .iter()
            .filter(|(_, list)| {
                list.iter()
                    .any(|i| i.start > since || i.end.is_some_and(|e| e > since))
            })
            .map(|(&shard, list)| (shard, list.clone()))
            .collect()
    }

    /// The latest end of `member`'s work intervals that began before `before`.
    pub fn last_end(&self, member: &str, before: Instant) -> Option<Instant> {
        self.intervals()
            .values()
            .flatten()
            .filter(|i| i.member == member && i.start < before)
            .filter_map(|i| i.end)
            .max()
    }
}

/// Ends an interval when the work's future is dropped (its term ended).
struct Running {
    log: ShardLog,
    shard: u32,
    index: usize,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(interval) = self
            .log
            .intervals()
            .get_mut(&self.shard)
            .and_then(|l| l.get_mut(self.index))
        {
            interval.end = Some(Instant::now());
        }
    }
}

/// Every shard of `count` owned once, and owners within one shard of each other.
pub fn balanced(states: &[&watch::Receiver<ShardsState>], count: u32) -> bool {
    // A pass over the shards owned, with no copy of them: callers poll this often.
    let mut owned = vec![false; count as usize];
    let mut sizes = Vec::with_capacity(states.len());
    for state in states {
        let state = state.borrow();
        let mut size = 0usize;
        for (&shard, term) in &state.owned {
            if term.is_lost() {
                continue;
            }
            match owned.get_mut(shard as usize) {
                Some(slot) if !*slot => *slot = true,
                // Two owners, or a shard out of the set.
                _ => return false,
            }
            size += 1;
        }
        sizes.push(size);
    }
    owned.iter().all(|&o| o)
        && sizes.iter().max().unwrap_or(&0) - sizes.iter().min().unwrap_or(&0) <= 1
}

/// The locks of one member, made by the factory ahead of time for every key the check uses.
#[derive(Debug)]
struct Prepared {
    identity: String,
    locks: HashMap<String, Arc<dyn ResourceLock>>,
}

#[async_trait]
impl LockSet for Prepared {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.locks
            .get(key)
            .unwrap_or_else(|| panic!("the suite made no lock for key {key:?}"))
            .clone()
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        "conformance".into()
    }
}

async fn prepare(
    factory: &dyn LockFactory,
    name: &str,
    count: u32,
    identity: &str,
    members: &[&str],
) -> Prepared {
    let mut keys: Vec<String> = vec![roster_key(name)];
    keys.extend(members.iter().map(|m| member_key(name, m)));
    keys.extend((0..count.max(8)).map(|s| shard_key(name, s)));
    let mut locks = HashMap::new();
    for key in keys {
        let lock = factory.lock(&key, identity).await;
        locks.insert(key, lock);
    }
    Prepared {
        identity: identity.to_owned(),
        locks,
    }
}

struct Member {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), ShardsError>>,
    state: watch::Receiver<ShardsState>,
}

async fn start(
    factory: &dyn LockFactory,
    name: &str,
    count: u32,
    identity: &str,
    log: &ShardLog,
) -> Member {
    let locks = prepare(factory, name, count, identity, &["a", "b", "c", "d"]).await;
    let shards = Shards::builder(name, count, locks)
        .lease_duration(LEASE)
        .renew_deadline(RENEW)
        .retry_period(RETRY)
        .build()
        .expect("valid shard set");
    let state = shards.subscribe();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(shards.run_per_shard(shutdown.clone(), log.work(identity)));
    Member {
        shutdown,
        task,
        state,
    }
}

async fn wait_until(context: &str, within: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "{context}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

/// Three members split six shards two each; when one leaves the other two take its shards at
/// once (three each), when one crashes the last takes them all once their leases run out; the
/// shards never have two owners, their tokens grow, and a member started with another count
/// takes none and stops.
pub async fn shard_protocol(factory: &dyn LockFactory) {
    let name = unique("shards");
    let count = 6;
    let log = ShardLog::default();
    let a = start(factory, &name, count, "a", &log).await;
    let b = start(factory, &name, count, "b", &log).await;
    let c = start(factory, &name, count, "c", &log).await;
    let slack = factory.extra_expiry();
    let members = [("a", &a.state), ("b", &b.state), ("c", &c.state)];
    wait_until(
        "three members split six shards",
        Duration::from_secs(20) + slack,
        || balanced(&[&a.state, &b.state, &c.state], count) && log.agrees(&members),
    )
    .await;
    let (moves, settled) = (log.moves(), Instant::now());
    tokio::time::sleep(RETRY * 4).await;
    assert!(
        balanced(&[&a.state, &b.state, &c.state], count),
        "a balanced set stays balanced"
    );
    assert_eq!(
        log.moves(),
        moves,
        "shards moved while nothing changed: {:#?}",
        log.since(settled)
    );

    let left: Vec<u32> = c.state.borrow().owned.keys().copied().collect();
    assert!(!left.is_empty(), "c owned no shard");
    c.shutdown.cancel();
    c.task.await.expect("member task").expect("c left");
    // It released its shards on the way out: no record of them names it any more, where one
    // left to expire would for a lease. (Read, not timed: the other members' rounds on a slow
    // store, or a loaded machine, can take as long as a lease to take them.)
    for &shard in &left {
        let lock = factory.lock(&shard_key(&name, shard), "probe").await;
        let observed = lock.get().await.expect("read the shard's record");
        assert!(
            observed.is_none_or(|o| !o.record.is_held_by("c")),
            "shard {shard} of the member that left was not released"
        );
    }
    wait_until(
        "two members take the shards of one that left",
        Duration::from_secs(10),
        || balanced(&[&a.state, &b.state], count),
    )
    .await;

    let other = start(factory, &name, count + 1, "d", &log).await;
    match tokio::time::timeout(Duration::from_secs(10), other.task).await {
        Ok(Ok(Err(ShardsError::CountMismatch { stored, ours, .. }))) => {
            assert_eq!((stored, ours), (count, count + 1));
        }
        other => panic!("a member with another count: expected a count mismatch, got {other:?}"),
    }
    assert!(
        other.state.borrow().owned.is_empty(),
        "a member with another count took shards"
    );

    // A crash: the process is gone, and its records stay as they were.
    b.task.abort();
    let _ = b.task.await;
    wait_until(
        "one member takes the shards of one that crashed",
        LEASE * 3 + Duration::from_secs(5) + slack,
        || balanced(&[&a.state], count),
    )
    .await;
    a.shutdown.cancel();
    a.task.await.expect("member task").expect("a left");
    log.check(&format!("shard protocol on {name}"));
}

/// A backend's own [`LockSet`] ([`LockFactory::lock_set`]): a batch read answers for each key
/// as its lock's `get` (absent keys included, in order), and so does a read with the versions
/// the reader holds, except that a record still at its version may be answered unchanged; a
/// batch renewal as each lock's
/// `renew` (a stale version, or a record another holder took, a conflict that leaves the
/// others renewed), and what it wrote is what the locks then read; a round of both
/// ([`LockSet::renew_and_read`]) as the renewal then the read.
pub async fn batches_answer_as_their_locks(factory: &dyn LockFactory) {
    let Some(set) = factory.lock_set("a").await else {
        return;
    };
    let name = unique("batch");
    let keys: Vec<String> = (0..4).map(|i| format!("{name}-{i}")).collect();
    let mut stored = Vec::new();
    for key in &keys[..3] {
        let created = set
            .lock(key)
            .create(&super::record("a", 1))
            .await
            .expect("create");
        stored.push(created);
    }
    // Key 2 taken by another holder behind this member's back.
    let other = factory.lock(&keys[2], "b").await;
    other
        .update(&stored[2].version, &super::record("b", 2))
        .await
        .expect("taken by b");

    let read = set.get_many(&keys).await;
    assert_eq!(read.len(), keys.len(), "one answer per key");
    for (key, answer) in keys.iter().zip(&read) {
        let single = set.lock(key).get().await.expect("get");
        let batch = answer.as_ref().expect("get_many");
        assert_eq!(
            batch, &single,
            "get_many of {key} differs from its lock's get"
        );
    }
    assert!(
        read[3].as_ref().expect("absent").is_none(),
        "an absent key reads as None"
    );

    // Read again as a reader that holds: key 0 as created (unchanged), key 1 absent (it is
    // not), key 2 as created (b took it since), key 3 absent (still).
    let known = vec![
        Known::Version(&stored[0].version),
        Known::Absent,
        Known::Version(&stored[2].version),
        Known::Absent,
    ];
    let reread = set.get_changed(&keys, &known).await;
    assert_eq!(reread.len(), keys.len(), "one answer per key");
    for (i, (answer, single)) in reread.iter().zip(&read).enumerate() {
        let single = single.as_ref().expect("get_many");
        match answer.as_ref().expect("get_changed") {
            Reread::Same => assert!(
                i == 0 || i == 3,
                "get_changed of {} said unchanged, but it changed",
                keys[i]
            ),
            Reread::Now(now) => assert_eq!(
                now, single,
                "get_changed of {} differs from its lock's get",
                keys[i]
            ),
        }
    }
    // A reader that holds nothing is sent everything.
    let fresh = set
        .get_changed(&keys, &vec![Known::Nothing; keys.len()])
        .await;
    for (i, (answer, single)) in fresh.iter().zip(&read).enumerate() {
        assert_eq!(
            answer.as_ref().expect("get_changed"),
            &Reread::Now(single.as_ref().expect("get_many").clone()),
            "get_changed of {}, never read, differs from its lock's get",
            keys[i]
        );
    }

    let renewal = |i: usize, version: Version| {
        let mut record = stored[i].record.clone();
        record.renew_time = record.renewal_time(super::now());
        Renewal {
            key: keys[i].clone(),
            version,
            record,
        }
    };
    let renewals = vec![
        renewal(0, stored[0].version.clone()),
        // A version key 1 never had.
        renewal(1, Version::new("0")),
        // Key 2 is b's now.
        renewal(2, stored[2].version.clone()),
    ];
    let renewed = set.renew_many(&renewals).await;
    assert_eq!(renewed.len(), renewals.len(), "one answer per renewal");
    let first = renewed[0].as_ref().expect("the holder's renewal");
    assert!(
        matches!(renewed[1], Err(LockError::Conflict { .. })),
        "a stale version: expected a conflict, got {:?}",
        renewed[1]
    );
    assert!(
        matches!(renewed[2], Err(LockError::Conflict { .. })),
        "a record another holder took: expected a conflict, got {:?}",
        renewed[2]
    );
    let now = set
        .lock(&keys[0])
        .get()
        .await
        .expect("get")
        .expect("present");
    assert_eq!(
        now.version, first.version,
        "the version a batch renewal returned is the one stored"
    );
    assert_eq!(
        other
            .get()
            .await
            .expect("get")
            .expect("present")
            .record
            .holder_identity,
        "b",
        "a renewal that lost its compare-and-swap wrote nothing"
    );
    // The renewed record goes on: renewed again through its lock.
    let mut again = first.record.clone();
    again.renew_time = again.renewal_time(super::now());
    let held = set
        .lock(&keys[0])
        .renew(&first.version, &again)
        .await
        .expect("renewed by its lock");

    // A round: renewals, then a read that sees them.
    let renewals = vec![
        Renewal {
            key: keys[0].clone(),
            version: held.version.clone(),
            record: LeaderElectionRecord {
                renew_time: held.record.renewal_time(super::now()),
                ..held.record.clone()
            },
        },
        renewal(2, stored[2].version.clone()),
    ];
    let known = vec![
        Known::Version(&held.version),
        Known::Nothing,
        Known::Version(&stored[2].version),
        Known::Absent,
    ];
    let round = set.renew_and_read(&renewals, &keys, &known).await;
    assert_eq!(
        round.renewed.len(),
        renewals.len(),
        "one answer per renewal"
    );
    assert_eq!(round.read.len(), keys.len(), "one answer per key");
    let renewed = round.renewed[0]
        .as_ref()
        .expect("the holder's renewal in a round");
    assert!(
        matches!(round.renewed[1], Err(LockError::Conflict { .. })),
        "a record another holder took, renewed in a round: expected a conflict, got {:?}",
        round.renewed[1]
    );
    for (i, answer) in round.read.iter().enumerate() {
        let single = set.lock(&keys[i]).get().await.expect("get");
        match answer.as_ref().expect("the read of a round") {
            Reread::Same => assert!(
                (i == 0 && renewed.version == held.version) || i == 3,
                "the read of a round said {} unchanged, but it changed",
                keys[i]
            ),
            Reread::Now(now) => assert_eq!(
                now, &single,
                "the read of a round differs from the lock's get of {} after it",
                keys[i]
            ),
        }
    }
    if let Ok(Reread::Now(Some(now))) = &round.read[0] {
        assert_eq!(
            now.version, renewed.version,
            "the read of a round does not see its renewal"
        );
    }
}
