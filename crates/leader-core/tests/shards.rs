//! Shard sets on tokio's paused clock: members split the shards evenly, a join or a leave moves
//! few of them, a crashed or frozen member's shards are taken once their lease runs out, and
//! no shard ever has two owners (each shard's work intervals, as the work itself saw them,
//! never overlap, and their fencing tokens grow), on a store with and without its own clock.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::backend::KeyedLocks;
use leader_core::conformance::{ShardLog, balanced};
use leader_core::faults::{Faults, FaultyLock};
use leader_core::{
    CancellationToken, ConfigError, Leadership, LockSet, MemoryStore, ResourceLock, RosterError,
    Shards, ShardsError, ShardsState, StepDown, StepDownReason, Timings, WallClock, drain_member,
    resize_shard_set,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

use common::{CLAIMS, Request, Switch, TestLock, after_last_acquisition, stored_record, until};

const TIMINGS: Timings = Timings {
    lease_duration: Duration::from_secs(3),
    renew_deadline: Duration::from_secs(2),
    retry_period: Duration::from_millis(500),
};

/// How the store keeps time: the follower's clock, the store's, or leases the store renews.
#[derive(Clone, Copy, Debug)]
enum Clock {
    Follower,
    Store,
    InStore,
}

/// Tests that each run `scenario` on one clock: `test_name: Clock` pairs.
macro_rules! on_clocks {
    ($scenario:ident { $($test:ident: $clock:ident),+ $(,)? }) => {
        $(
            #[tokio::test]
            async fn $test() {
                $scenario(Clock::$clock).await;
            }
        )+
    };
}

struct Member {
    faults: Faults,
    /// Faults of the requests on this member's shard records alone (not the roster's, nor the
    /// member records').
    shard_faults: Faults,
    /// Faults of the requests on the member records alone.
    member_faults: Faults,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), ShardsError>>,
    state: watch::Receiver<ShardsState>,
}

impl Member {
    /// Runs `shards` with the work `run` starts (`Shards::run` or `Shards::run_per_shard`),
    /// with fault handles that set nothing.
    fn start<F>(shards: Shards, run: impl FnOnce(Shards, CancellationToken) -> F) -> Self
    where
        F: Future<Output = Result<(), ShardsError>> + Send + 'static,
    {
        let state = shards.subscribe();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(shards, shutdown.clone()));
        Member {
            faults: Faults::new(),
            shard_faults: Faults::new(),
            member_faults: Faults::new(),
            shutdown,
            task,
            state,
        }
    }

    fn owned(&self) -> BTreeSet<u32> {
        self.state.borrow().tokens().into_keys().collect()
    }

    /// Shuts the member down; it must stop without an error.
    async fn leave(self) {
        self.shutdown.cancel();
        self.task.await.expect("member task").expect("left");
    }

    /// A crash: the process is gone, its records stay as they were.
    fn crash(&self) {
        self.faults.hang(true);
        self.task.abort();
    }
}

struct Set {
    store: MemoryStore,
    clock: Clock,
    count: u32,
    log: ShardLog,
    /// Terms that ended by their renew deadline.
    expired: Arc<AtomicUsize>,
    /// Whether members join with static membership.
    static_membership: bool,
    /// The weights of members that do not weigh 1.
    weights: Vec<(&'static str, u32)>,
    /// Switches that make the shards' acquisitions, or their reads, slow.
    slow: Option<Slow>,
}

/// Whether the shards' acquisitions (`claims`) or reads (`reads`) are slow now: a store that
/// answers renewals in time but claims or reads slowly, as a loaded one does for the requests
/// it makes one at a time.
#[derive(Clone, Debug, Default)]
struct Slow {
    claims: Switch,
    reads: Switch,
}

impl Set {
    fn new(clock: Clock, count: u32) -> Self {
        Self {
            store: MemoryStore::new(),
            clock,
            count,
            log: ShardLog::default(),
            expired: Arc::default(),
            static_membership: false,
            weights: Vec::new(),
            slow: None,
        }
    }

    /// Waits up to 30 s for `members` to balance the set's shards; returns how long it took,
    /// and fails the test (saying `what` was expected) when they do not.
    async fn until_balanced(&self, members: &[&Member], what: &str) -> Duration {
        until(Duration::from_secs(30), || {
            balanced_members(members, self.count)
        })
        .await
        .unwrap_or_else(|| {
            let owned: Vec<_> = members.iter().map(|m| m.owned()).collect();
            panic!("not {what}: {owned:?}")
        })
    }

    /// Starts members of `identities`.
    fn join_all<const N: usize>(&self, identities: [&str; N]) -> [Member; N] {
        identities.map(|identity| self.join(identity))
    }

    /// A set of `count` shards on the follower's clock, and its member `a` once it owns every
    /// shard (within 10 s).
    async fn owned_by_a(count: u32) -> (Self, Member) {
        let set = Self::new(Clock::Follower, count);
        let a = set.join("a");
        until(Duration::from_secs(10), || {
            a.owned().len() == count as usize
        })
        .await
        .expect("a owns the set");
        (set, a)
    }

    /// How many terms ended by their renew deadline so far.
    fn expired(&self) -> usize {
        self.expired.load(Ordering::SeqCst)
    }

    /// Shuts `members` down and checks the work log: no shard ever had two owners.
    async fn finish(&self, members: impl IntoIterator<Item = Member>, context: &str) {
        for member in members {
            member.leave().await;
        }
        self.log.check(context);
    }

    fn join(&self, identity: &str) -> Member {
        self.join_with(identity, self.count)
    }

    fn join_with(&self, identity: &str, count: u32) -> Member {
        self.join_clocked(identity, count, WallClock::system())
    }

    fn join_clocked(&self, identity: &str, count: u32, wall_clock: WallClock) -> Member {
        let (faults, shard_faults, member_faults) = (Faults::new(), Faults::new(), Faults::new());
        let (store, clock, slow) = (self.store.clone(), self.clock, self.slow.clone());
        let (handle, shard_handle) = (faults.clone(), shard_faults.clone());
        let member_handle = member_faults.clone();
        let locks = KeyedLocks::new(identity, "memory", move |key, identity| {
            let lock = store.lock(key, identity);
            let lock: Arc<dyn ResourceLock> = match clock {
                Clock::Follower => Arc::new(lock),
                Clock::Store => Arc::new(lock.with_store_clock(true)),
                Clock::InStore => Arc::new(lock.with_renewal_in_store(true)),
            };
            let shard = key.starts_with("jobs-shard-");
            let lock: Arc<dyn ResourceLock> = match &slow {
                Some(slow) if shard => {
                    let delay = TIMINGS.renew_deadline * 4;
                    Arc::new(
                        TestLock::wrap(lock)
                            .slow(&CLAIMS, delay, &slow.claims)
                            .slow(&[Request::Get], delay, &slow.reads),
                    )
                }
                _ => lock,
            };
            let inner = if shard {
                shard_handle.clone()
            } else if key.starts_with("jobs-member-") {
                member_handle.clone()
            } else {
                Faults::new()
            };
            let lock = FaultyLock::with_faults(lock, inner);
            Arc::new(FaultyLock::with_faults(lock, handle.clone()))
        });
        // Requests may hang up to the renew deadline: each term's own timer must end it.
        let shards = Shards::builder("jobs", count, locks)
            .timings(TIMINGS)
            .request_timeout(TIMINGS.renew_deadline)
            .wall_clock(wall_clock)
            .static_membership(self.static_membership)
            .weight(
                self.weights
                    .iter()
                    .find(|(id, _)| *id == identity)
                    .map_or(1, |&(_, w)| w),
            )
            .on_shard_stopped(count_expired(&self.expired))
            .build()
            .expect("valid configuration");
        let work = self.log.work(identity);
        Member {
            faults,
            shard_faults,
            member_faults,
            ..Member::start(shards, |shards, shutdown| {
                shards.run_per_shard(shutdown, work)
            })
        }
    }
}

/// An `on_shard_stopped` callback that counts in `expired` the terms that ended by their renew
/// deadline.
fn count_expired(expired: &Arc<AtomicUsize>) -> impl Fn(u32, StepDown) + Send + Sync + 'static {
    let expired = expired.clone();
    move |_, stop| {
        if stop.reason == StepDownReason::RenewDeadlineExceeded {
            expired.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Member `identity`'s locks on `store`, with nothing in between.
fn plain_locks(store: &MemoryStore, identity: &str) -> KeyedLocks {
    let store = store.clone();
    KeyedLocks::new(identity, "memory", move |key, identity| {
        Arc::new(store.lock(key, identity)) as Arc<dyn ResourceLock>
    })
}

/// The shards' step-downs: the shard, why.
type Ends = Arc<Mutex<Vec<(u32, StepDownReason)>>>;

/// An `on_shard_stopped` callback that records each step-down in `ends`.
fn record_ends(ends: &Ends) -> impl Fn(u32, StepDown) + Send + Sync + 'static {
    let ends = ends.clone();
    move |shard, stop| ends.lock().unwrap().push((shard, stop.reason))
}

/// Member `a` of a set of two shards on a store of its own, running `work` on each shard it
/// owns, with its step-downs recorded in the [`Ends`] returned.
fn two_shards_with_work<F, Fut>(work: F) -> (Member, Ends)
where
    F: Fn(u32, Leadership) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let ends = Ends::default();
    let shards = Shards::builder("jobs", 2, plain_locks(&MemoryStore::new(), "a"))
        .timings(TIMINGS)
        .on_shard_stopped(record_ends(&ends))
        .build()
        .expect("valid configuration");
    let member = Member::start(shards, |shards, shutdown| {
        shards.run_per_shard(shutdown, work)
    });
    (member, ends)
}

/// Waits up to ten seconds for `shard` to step down, as `ends` records it.
async fn until_given_up(ends: &Ends, shard: u32) {
    until(Duration::from_secs(10), || {
        ends.lock().unwrap().iter().any(|(s, _)| *s == shard)
    })
    .await
    .unwrap_or_else(|| panic!("shard {shard} given up"));
}

/// Times of the shards' events: the shard, when.
type Times = Arc<Mutex<Vec<(u32, Instant)>>>;

/// An `on_shard_started` callback whose work takes `delay` to stop once its term ends; when
/// each shard's work stopped goes to `stops`.
fn slow_to_stop(
    delay: Duration,
    stops: &Times,
) -> impl Fn(u32, Leadership) + Send + Sync + 'static {
    let stops = stops.clone();
    move |shard, term| {
        let stops = stops.clone();
        tokio::spawn(async move {
            term.lost().await;
            sleep(delay).await;
            stops.lock().unwrap().push((shard, Instant::now()));
            drop(term);
        });
    }
}

fn balanced_members(members: &[&Member], count: u32) -> bool {
    let states: Vec<_> = members.iter().map(|m| &m.state).collect();
    balanced(&states, count)
}

async fn three_members_split_the_shards(clock: Clock) {
    tokio::time::pause();
    let set = Set::new(clock, 10);
    let [a, b, c] = set.join_all(["a", "b", "c"]);
    let took = until(Duration::from_secs(30), || {
        balanced_members(&[&a, &b, &c], 10)
    })
    .await;
    assert!(
        took.is_some(),
        "never balanced: {:?} {:?} {:?}",
        a.owned(),
        b.owned(),
        c.owned()
    );
    // Balanced stays balanced: nothing moves while nothing changes.
    let moves = set.log.moves();
    sleep(Duration::from_secs(20)).await;
    assert!(balanced_members(&[&a, &b, &c], 10));
    assert_eq!(set.log.moves(), moves, "shards moved without a change");
    set.finish([a, b, c], "paused clock").await;
}

/// S14 for shard sets, on a store that skips identical writes (as kube-apiserver and Consul
/// do): a member's wall clock steps back an hour, then forward to an hour ahead; its
/// renewals still move every record's version, so no shard changes hands and none has two
/// owners.
#[tokio::test]
async fn a_members_wall_clock_that_steps_moves_no_shard() {
    tokio::time::pause();
    let set = Set {
        store: MemoryStore::skipping_identical_writes(),
        ..Set::new(Clock::Follower, 6)
    };
    let (clock, step) = WallClock::stepped();
    let a = set.join_clocked("a", 6, clock);
    let b = set.join("b");
    let took = until(Duration::from_secs(30), || balanced_members(&[&a, &b], 6)).await;
    assert!(
        took.is_some(),
        "never balanced: {:?} {:?}",
        a.owned(),
        b.owned()
    );
    let moves = set.log.moves();
    for by in [chrono::TimeDelta::hours(-1), chrono::TimeDelta::hours(2)] {
        step.step(by);
        sleep(Duration::from_secs(20)).await;
        assert!(balanced_members(&[&a, &b], 6), "stepped by {by}");
        assert_eq!(set.log.moves(), moves, "stepped by {by}: shards moved");
    }
    assert_eq!(set.expired(), 0, "terms ran out");
    set.finish([a, b], "wall clock steps").await;
}

on_clocks!(three_members_split_the_shards {
    three_members_split_the_shards_on_the_followers_clock: Follower,
    three_members_split_the_shards_on_the_stores_clock: Store,
    three_members_split_the_shards_with_leases_renewed_in_the_store: InStore,
});

/// Three members of a set of 9 balanced, then `c` leaves (shut down; with static membership
/// or not): how long until the two others own every shard, on the paused clock.
async fn rebalanced_after_a_leave(static_membership: bool) -> Duration {
    tokio::time::pause();
    let mut set = Set::new(Clock::Follower, 9);
    set.static_membership = static_membership;
    let [a, b, c] = set.join_all(["a", "b", "c"]);
    set.until_balanced(&[&a, &b, &c], "balanced").await;
    c.leave().await;
    let took = set
        .until_balanced(&[&a, &b], "balanced after the leave")
        .await;
    set.finish([a, b], "paused clock").await;
    took
}

#[tokio::test]
async fn a_member_that_leaves_hands_its_shards_over_at_once() {
    let took = rebalanced_after_a_leave(false).await;
    // Released: taken on the next rounds, well before a lease.
    assert!(took < TIMINGS.lease_duration, "rebalanced after {took:?}");
}

async fn a_join_moves_only_the_newcomers_share(clock: Clock) {
    tokio::time::pause();
    let set = Set::new(clock, 12);
    let [a, b, c] = set.join_all(["a", "b", "c"]);
    set.until_balanced(&[&a, &b, &c], "balanced before the join")
        .await;
    let before = set.log.moves();
    let d = set.join("d");
    let took = set
        .until_balanced(&[&a, &b, &c, &d], "balanced after the join")
        .await;
    // Handed over, not waited out: within a lease and a retry period.
    assert!(
        took <= TIMINGS.lease_duration + TIMINGS.retry_period,
        "rebalanced after {took:?}"
    );
    assert_eq!(set.log.moves() - before, 3, "d's share moves, nothing else");
    set.finish([a, b, c, d], "paused clock").await;
}

on_clocks!(a_join_moves_only_the_newcomers_share {
    a_join_moves_only_the_newcomers_share_on_the_followers_clock: Follower,
    a_join_moves_only_the_newcomers_share_with_leases_renewed_in_the_store: InStore,
});

/// Restarts each of three members (13 shards: one owns five) in turn, the new process with the same identity starting
/// as soon as the old one has left, and waits for the set to balance after each: the shard
/// moves (a shard's work starting on another member than the last) of the whole rolling
/// restart. On the paused clock.
async fn rolling_restart(clock: Clock, static_membership: bool) -> usize {
    let mut set = Set::new(clock, 13);
    set.static_membership = static_membership;
    let mut members: Vec<(&str, Member)> = ["a", "b", "c"]
        .into_iter()
        .map(|id| (id, set.join(id)))
        .collect();
    let balanced_now = |members: &[(&str, Member)]| {
        let all: Vec<&Member> = members.iter().map(|(_, m)| m).collect();
        balanced_members(&all, 13)
    };
    until(Duration::from_secs(30), || balanced_now(&members))
        .await
        .expect("balanced");
    let before = set.log.moves();
    for i in 0..members.len() {
        let (id, member) = members.remove(i);
        let held = member.owned();
        member.leave().await;
        members.insert(i, (id, set.join(id)));
        until(Duration::from_secs(30), || balanced_now(&members))
            .await
            .expect("balanced after a restart");
        if static_membership {
            assert_eq!(members[i].1.owned(), held, "{id} came back to other shards");
        }
    }
    for (_, member) in members {
        member.leave().await;
    }
    set.log.check("paused clock");
    set.log.moves() - before
}

#[tokio::test]
async fn a_rolling_restart_with_static_membership_moves_no_shard() {
    tokio::time::pause();
    for clock in [Clock::Follower, Clock::Store, Clock::InStore] {
        let moves = rolling_restart(clock, true).await;
        assert_eq!(moves, 0, "{clock:?}: shards moved in a rolling restart");
    }
}

#[tokio::test]
async fn a_rolling_restart_without_static_membership_moves_each_members_shards_twice() {
    // What static membership saves: each restarted member's four or five shards go to the
    // others and as many come back.
    tokio::time::pause();
    let moves = rolling_restart(Clock::Follower, false).await;
    assert!(moves >= 3 * 2 * 4, "{moves} moves");
}

#[tokio::test]
async fn a_static_member_that_restarts_keeps_its_place_in_the_shares() {
    // z owns three of five shards, a two: back from a restart with none yet, z still gets
    // the one extra shard at once (its reserved shards count as its own), although a would
    // win the tie between equals by its identity.
    tokio::time::pause();
    let mut set = Set::new(Clock::Follower, 5);
    set.static_membership = true;
    let z = set.join("z");
    until(Duration::from_secs(30), || z.owned().len() == 5)
        .await
        .expect("z took every shard");
    let a = set.join("a");
    until(Duration::from_secs(30), || {
        a.owned().len() == 2 && z.owned().len() == 3
    })
    .await
    .expect("balanced");
    let held = z.owned();
    let moves = set.log.moves();
    z.leave().await;
    let z = set.join("z");
    // All three at once: the third is not left idle until the reservation runs out.
    until(TIMINGS.lease_duration / 2, || z.owned() == held)
        .await
        .expect("z took its shards back");
    sleep(TIMINGS.lease_duration * 2).await;
    assert_eq!(z.owned(), held, "z's shards moved after the restart");
    assert_eq!(set.log.moves(), moves, "shards moved in the restart");
    set.finish([a, z], "paused clock").await;
}

#[tokio::test]
async fn a_static_member_that_does_not_come_back_leaves_its_shards_for_a_lease() {
    let took = rebalanced_after_a_leave(true).await;
    // Reserved for c: the others stand back for a lease from when they saw the release.
    assert!(
        took >= TIMINGS.lease_duration - TIMINGS.retry_period,
        "c's shards taken after {took:?}, within the lease they were reserved for"
    );
    assert!(
        took <= TIMINGS.lease_duration + TIMINGS.retry_period * 4,
        "c's shards taken after {took:?}"
    );
}

async fn a_frozen_member_stops_in_time_and_comes_back_to_a_stale_view(clock: Clock) {
    tokio::time::pause();
    let set = Set::new(clock, 6);
    let [a, b] = set.join_all(["a", "b"]);
    set.until_balanced(&[&a, &b], "balanced").await;
    // b's requests hang (a process paused, a network cut): its terms end by their timers.
    b.faults.hang(true);
    let frozen = Instant::now();
    until(Duration::from_secs(30), || a.owned().len() == 6)
        .await
        .expect("a took every shard");
    assert!(b.owned().is_empty(), "b still claims {:?}", b.owned());
    // S3: its last renewal started before the freeze, so its work ended within the renew
    // deadline of it, by the terms' timers, while its requests still hung.
    let ended = set.log.last_end("b", frozen).expect("b had work");
    assert!(
        ended <= frozen + TIMINGS.renew_deadline,
        "b's work ended {:?} after the freeze",
        ended - frozen
    );
    // b comes back with requests sent before the freeze and a view of the set from then.
    b.faults.hang(false);
    set.until_balanced(&[&a, &b], "balanced again").await;
    set.finish([a, b], "paused clock").await;
}

on_clocks!(
    a_frozen_member_stops_in_time_and_comes_back_to_a_stale_view {
        a_frozen_member_stops_in_time_on_the_followers_clock: Follower,
        a_frozen_member_stops_in_time_with_leases_renewed_in_the_store: InStore,
    }
);

/// A member whose shard terms ended (its shard requests failed while its member
/// record stayed alive) still counts those shards as its own; when a newcomer is there as the
/// requests come back, it retakes them and hands the newcomer its share, never giving a shard
/// it holds no term of.
async fn lapsed_shards_are_retaken_then_shared(clock: Clock) {
    tokio::time::pause();
    let set = Set::new(clock, 6);
    let a = set.join("a");
    until(Duration::from_secs(30), || a.owned().len() == 6)
        .await
        .expect("a took every shard");
    a.shard_faults
        .fail_all(Some(leader_core::faults::Fault::Unavailable));
    let b = set.join("b");
    until(Duration::from_secs(30), || a.owned().is_empty())
        .await
        .expect("a's terms ended");
    assert!(
        b.owned().is_empty(),
        "b took {:?} from a live member",
        b.owned()
    );
    a.shard_faults.fail_all(None);
    set.until_balanced(&[&a, &b], "balanced").await;
    set.finish([a, b], "lapsed shards").await;
}

on_clocks!(lapsed_shards_are_retaken_then_shared {
    lapsed_shards_are_retaken_then_shared_on_the_followers_clock: Follower,
    lapsed_shards_are_retaken_then_shared_with_leases_renewed_in_the_store: InStore,
});

async fn a_crashed_members_shards_are_taken_after_their_lease(clock: Clock) {
    tokio::time::pause();
    let set = Set::new(clock, 8);
    let [a, b] = set.join_all(["a", "b"]);
    set.until_balanced(&[&a, &b], "balanced").await;
    let held: BTreeSet<u32> = b.owned();
    b.crash();
    let crashed = Instant::now();
    let took = until(Duration::from_secs(30), || a.owned().len() == 8)
        .await
        .expect("a took every shard");
    assert!(
        took >= TIMINGS.lease_duration - TIMINGS.retry_period,
        "a crashed member's shards taken after {took:?}, before their lease could run out"
    );
    assert!(
        took <= TIMINGS.lease_duration * 2 + TIMINGS.retry_period * 2,
        "{took:?}"
    );
    // The store's clock judges a claim where it has one: once this member counts the crashed
    // one gone (a lease after it read its member record's last renewal, a round at most after
    // that was written), the shards are taken at that round, although this member's own
    // count of their leases started at a read of every shard up to half a lease after their
    // last renewal. On this paused clock and these timings, counting on its own clock takes
    // them 35 ms past this bound.
    if matches!(clock, Clock::Store) {
        assert!(
            took <= TIMINGS.lease_duration + TIMINGS.retry_period,
            "taken {took:?} after the crash, later than the store's clock allows"
        );
    }
    let _ = (crashed, held);
    set.finish([a], "paused clock").await;
}

on_clocks!(a_crashed_members_shards_are_taken_after_their_lease {
    a_crashed_members_shards_are_taken_after_their_lease_on_the_followers_clock: Follower,
    a_crashed_members_shards_are_taken_after_their_lease_on_the_stores_clock: Store,
    a_crashed_members_shards_are_taken_after_their_lease_renewed_in_the_store: InStore,
});

/// S2: a shard's record deleted under its live holder (by hand, a bucket's lifecycle rule) is
/// not taken by a member that saw the holder's lease running before that lease ends on its
/// clock: the holder works on until a renewal meets the deletion (here its renew deadline, its
/// requests hanging), and no shard has two owners. The holder's member record is deleted first
/// (the other member reads the holder as gone and claims its shards as soon as their leases
/// let it), and the shard's record with it or a moment later, between the other member's reads
/// of the set (`deleted_after`), also after the holder renewed unseen, and while the other
/// member's reads of the shards fail (`unread`): a read that failed does not forget the lease
/// seen before it. Where the store keeps the leases alive itself, it deletes a record when its
/// lease ends, and a deletion is read as that.
async fn a_shard_record_deleted_under_its_holder_is_waited_out(clock: Clock) {
    tokio::time::pause();
    // `late`: the deletion comes just before the other member's next read of every shard (a
    // settled member reads them every half lease), so that its last sighting of the shard is
    // half a lease old and the holder renewed since, unseen.
    let cases = [
        (false, Duration::ZERO, false),
        (false, TIMINGS.retry_period * 2, false),
        (true, Duration::ZERO, false),
        (false, Duration::ZERO, true),
    ];
    for (late, deleted_after, unread) in cases {
        let set = Set::new(clock, 4);
        let [a, b] = set.join_all(["a", "b"]);
        set.until_balanced(&[&a, &b], "balanced").await;
        if unread {
            let failing = Instant::now();
            b.shard_faults
                .fail_all(Some(leader_core::faults::Fault::Unavailable));
            until(TIMINGS.lease_duration, || {
                b.shard_faults
                    .calls()
                    .iter()
                    .any(|c| c.operation == "get" && c.sent >= failing && c.ok == Some(false))
            })
            .await
            .expect("b's read of the shards fails");
        }
        if late {
            sleep(TIMINGS.lease_duration).await;
            let last_read = b
                .shard_faults
                .calls()
                .iter()
                .filter(|c| c.operation == "get")
                .map(|c| c.sent)
                .max()
                .expect("b reads the shards");
            let next_read = last_read + TIMINGS.lease_duration / 2;
            tokio::time::sleep_until(next_read - Duration::from_millis(20)).await;
        }
        let shard = *a.owned().first().expect("a owns a shard");
        a.faults.hang(true);
        set.store
            .delete(&leader_core::backend::member_key("jobs", "a"));
        sleep(deleted_after).await;
        set.store
            .delete(&leader_core::backend::shard_key("jobs", shard));
        b.shard_faults.fail_all(None);
        until(Duration::from_secs(30), || b.owned().len() == 4)
            .await
            .expect("b took a's shards");
        a.faults.hang(false);
        let context = format!(
            "a record deleted under its holder (late: {late}, {deleted_after:?}, unread: {unread})"
        );
        set.finish([a, b], &context).await;
    }
}

on_clocks!(a_shard_record_deleted_under_its_holder_is_waited_out {
    a_shard_record_deleted_under_its_holder_is_waited_out_on_the_followers_clock: Follower,
    a_shard_record_deleted_under_its_holder_is_waited_out_on_the_stores_clock: Store,
});

/// Waits for `member` to stop, refused for its count: the count stored and its own.
async fn count_refused(member: Member) -> (u32, u32) {
    let result = tokio::time::timeout(Duration::from_secs(10), member.task)
        .await
        .expect("the member stops")
        .expect("the member's task");
    match result {
        Err(ShardsError::CountMismatch { stored, ours, .. }) => (stored, ours),
        other => panic!("expected a count mismatch, got {other:?}"),
    }
}

#[tokio::test]
async fn members_started_with_another_count_take_no_shard() {
    tokio::time::pause();
    let (set, a) = Set::owned_by_a(8).await;
    let b = set.join_with("b", 9);
    let mut state = b.state.clone();
    assert_eq!(count_refused(b).await, (8, 9));
    assert!(state.borrow_and_update().owned.is_empty());
    assert_eq!(a.owned().len(), 8, "a keeps the set");
    let message = ShardsError::CountMismatch {
        name: "jobs".into(),
        stored: 8,
        ours: 9,
        roster: "jobs-members".into(),
    }
    .to_string();
    assert!(!message.contains('\n') && message.contains("8") && message.contains("9"));
    set.finish([a], "paused clock").await;
}

/// The set's records as an operator's tool reaches them.
fn operator(set: &Set) -> KeyedLocks {
    plain_locks(&set.store, "operator")
}

/// Grown, shrunk and grown back while three members run (on each clock): every shard of the
/// new count is owned and the set balanced within a few rounds, no member keeps a shard past
/// the count, no shard ever has two owners, and the fencing tokens of shards removed and added
/// again go on from where they were.
async fn a_set_resized_while_it_runs(clock: Clock) {
    tokio::time::pause();
    let set = Set::new(clock, 9);
    let members = [set.join("a"), set.join("b"), set.join("c")];
    let states = || members.iter().collect::<Vec<_>>();
    set.until_balanced(&states(), "balanced").await;
    let tool = operator(&set);
    let mut tokens = std::collections::BTreeMap::new();
    for count in [15, 6, 12] {
        let before = resize_shard_set(&tool, "jobs", count)
            .await
            .expect("resized");
        assert!(before != count, "{clock:?}: the count was already {count}");
        let took = until(Duration::from_secs(30), || {
            balanced_members(&states(), count)
                && members.iter().all(|m| m.owned().iter().all(|&s| s < count))
        })
        .await
        .unwrap_or_else(|| {
            panic!(
                "{clock:?}: not balanced at {count}: {:?}",
                members.iter().map(Member::owned).collect::<Vec<_>>()
            )
        });
        assert!(
            took <= TIMINGS.lease_duration,
            "{clock:?}: rebalanced at {count} after {took:?}"
        );
        for member in &members {
            let owned = member.state.borrow().tokens();
            for (shard, token) in owned {
                let last = tokens.insert(shard, token).unwrap_or(0);
                assert!(token >= last, "{clock:?}: shard {shard}'s token went back");
            }
        }
    }
    set.finish(members, &format!("{clock:?}")).await;
}

on_clocks!(a_set_resized_while_it_runs {
    a_set_resized_while_it_runs_on_the_followers_clock: Follower,
    a_set_resized_while_it_runs_on_the_stores_clock: Store,
    a_set_resized_while_it_runs_with_leases_renewed_in_the_store: InStore,
});

/// After a resize, a replica started with the old count is refused, one started with the
/// new count joins; a resize to no shard, or of a set that never ran, is refused.
#[tokio::test]
async fn after_a_resize_the_new_count_is_the_sets() {
    tokio::time::pause();
    let (set, a) = Set::owned_by_a(4).await;
    let tool = operator(&set);
    assert_eq!(
        resize_shard_set(&tool, "jobs", 6).await.expect("resized"),
        4
    );
    let old = set.join_with("b", 4);
    assert_eq!(count_refused(old).await, (6, 4));
    let c = set.join_with("c", 6);
    until(Duration::from_secs(10), || balanced_members(&[&a, &c], 6))
        .await
        .expect("c joined at the new count");
    assert!(matches!(
        resize_shard_set(&tool, "jobs", 0).await,
        Err(RosterError::InvalidCount { count: 0, .. })
    ));
    let missing = resize_shard_set(&tool, "nobody", 3)
        .await
        .expect_err("no set");
    assert!(
        matches!(missing, RosterError::NoSuchSet { .. }),
        "{missing:?}"
    );
    assert!(missing.to_string().contains("nobody-members"), "{missing}");
    set.finish([a, c], "paused clock").await;
}

/// How many shards each member owns, once every shard of `count` is owned once.
fn sizes(members: &[&Member], count: u32) -> Option<Vec<usize>> {
    let owned: Vec<BTreeSet<u32>> = members.iter().map(|m| m.owned()).collect();
    let all: BTreeSet<u32> = owned.iter().flatten().copied().collect();
    let total: usize = owned.iter().map(BTreeSet::len).sum();
    (total == count as usize && all.len() == total)
        .then(|| owned.iter().map(BTreeSet::len).collect())
}

/// Waits up to 30 s for `members` to own `want` shards each, every shard of `count` owned
/// once; fails the test, saying `what` was wrong, when they do not.
async fn until_sizes(members: &[&Member], count: u32, want: &[usize], what: &str) {
    until(Duration::from_secs(30), || {
        sizes(members, count).as_deref() == Some(want)
    })
    .await
    .unwrap_or_else(|| {
        let owned: Vec<_> = members.iter().map(|m| m.owned()).collect();
        panic!("{what}: {owned:?}")
    });
}

#[tokio::test]
async fn members_own_shards_in_proportion_to_their_weights() {
    tokio::time::pause();
    for clock in [Clock::Follower, Clock::Store, Clock::InStore] {
        let mut set = Set::new(clock, 12);
        set.weights = vec![("a", 2), ("c", 3)];
        let [a, b, c] = set.join_all(["a", "b", "c"]);
        until_sizes(&[&a, &b, &c], 12, &[4, 2, 6], "not by weight").await;
        // And it stays so: the set settles at the weighted shares.
        sleep(TIMINGS.lease_duration * 2).await;
        assert_eq!(sizes(&[&a, &b, &c], 12), Some(vec![4, 2, 6]));
        c.leave().await;
        until_sizes(&[&a, &b], 12, &[8, 4], "not by weight").await;
        set.finish([a, b], "paused clock").await;
    }
}

/// Drained through the roster (as `leader shards drain` does), a member hands its shards to
/// the others within a few rounds and takes none, not even after a lease; undrained, it takes
/// its share again. A drain of every member is ignored. A member of weight 0 takes none.
#[tokio::test]
async fn a_drained_member_gives_its_shards_away_and_takes_none() {
    tokio::time::pause();
    let mut set = Set::new(Clock::Follower, 9);
    set.weights = vec![("d", 0)];
    let [a, b, c, d] = set.join_all(["a", "b", "c", "d"]);
    until_sizes(&[&a, &b, &c, &d], 9, &[3, 3, 3, 0], "not shared").await;
    let tool = operator(&set);
    assert!(
        !drain_member(&tool, "jobs", "c", true)
            .await
            .expect("drained")
    );
    assert!(
        drain_member(&tool, "jobs", "c", true)
            .await
            .expect("drained again")
    );
    let took = until(Duration::from_secs(30), || {
        sizes(&[&a, &b, &c, &d], 9).is_some_and(|s| s[2] == 0 && s[3] == 0)
    })
    .await
    .unwrap_or_else(|| panic!("c kept shards: {:?}", [&a, &b, &c, &d].map(Member::owned)));
    assert!(took < TIMINGS.lease_duration, "drained after {took:?}");
    sleep(TIMINGS.lease_duration * 3).await;
    assert_eq!(c.owned().len(), 0, "a drained member took shards");
    assert!(
        drain_member(&tool, "jobs", "c", false)
            .await
            .expect("undrained")
    );
    until_sizes(&[&a, &b, &c, &d], 9, &[3, 3, 3, 0], "c not back").await;
    for id in ["a", "b", "c", "d"] {
        drain_member(&tool, "jobs", id, true)
            .await
            .expect("drained");
    }
    sleep(TIMINGS.lease_duration * 2).await;
    let shared = sizes(&[&a, &b, &c, &d], 9).expect("every shard owned");
    assert!(
        shared.iter().all(|&n| (2..=3).contains(&n)),
        "every member drained: {shared:?}"
    );
    set.finish([a, b, c, d], "paused clock").await;
}

#[tokio::test]
async fn one_identity_in_two_processes_owns_each_shard_once() {
    tokio::time::pause();
    let (set, a) = Set::owned_by_a(6).await;
    let twin = set.join("a");
    let conflict = until(Duration::from_secs(30), || {
        matches!(
            twin.state.borrow().problem,
            Some(ShardsError::IdentityConflict(_))
        )
    })
    .await;
    assert!(
        conflict.is_some(),
        "the twin never said its identity is taken"
    );
    assert!(twin.owned().is_empty(), "the twin owns {:?}", twin.owned());
    assert_eq!(a.owned().len(), 6);
    set.finish([a, twin], "paused clock").await;
}

/// Under static membership a process started with an identity whose member record another
/// process holds fences that older process, as Kafka does for a `group.instance.id`: the older
/// one hands its shards to the identity and stops, saying why; the newer one takes them at
/// once (no lease waited out), and no shard ever has two owners.
#[tokio::test]
async fn under_static_membership_a_newer_process_of_an_identity_fences_the_older() {
    tokio::time::pause();
    for clock in [Clock::Follower, Clock::InStore] {
        fenced_on(clock).await;
    }
}

/// [`under_static_membership_a_newer_process_of_an_identity_fences_the_older`] on a store of
/// `clock`'s kind (renewals that write, or kept in the store).
async fn fenced_on(clock: Clock) {
    let mut set = Set::new(clock, 6);
    set.static_membership = true;
    let older = set.join("a");
    until(Duration::from_secs(10), || older.owned().len() == 6)
        .await
        .expect("the older process owns the set");
    // Its member record names its incarnation before the newer one starts.
    sleep(TIMINGS.retry_period * 2).await;
    let started = tokio::time::Instant::now();
    let newer = set.join("a");
    until(Duration::from_secs(30), || newer.owned().len() == 6)
        .await
        .expect("the newer process takes every shard");
    let took = started.elapsed();
    let stopped = older.state.borrow().clone();
    assert!(
        matches!(&stopped.problem, Some(ShardsError::Fenced { identity, .. }) if identity == "a"),
        "the older process says it was fenced: {:?}",
        stopped.problem
    );
    assert!(stopped.stopped && stopped.owned.is_empty(), "{stopped:?}");
    // Handed over, not waited out: well within two leases (the stand-back for a conflict
    // seen alive, then the releases).
    assert!(
        took < TIMINGS.lease_duration * 3,
        "took {took:?}, lease {:?}",
        TIMINGS.lease_duration
    );
    let ended = older.task.await.expect("the older process's task");
    assert!(
        matches!(ended, Err(ShardsError::Fenced { .. })),
        "{ended:?}"
    );
    set.finish([newer], "paused clock").await;
}

#[tokio::test]
async fn work_that_ends_gives_its_shard_up() {
    tokio::time::pause();
    let (a, ends) = two_shards_with_work(|shard, _term| async move {
        if shard == 0 {
            // Shard 0's work returns at once; shard 1's runs on.
            return;
        }
        std::future::pending::<()>().await;
    });
    let mut state = a.state.clone();
    until_given_up(&ends, 0).await;
    assert!(
        ends.lock()
            .unwrap()
            .iter()
            .all(|(shard, reason)| *shard == 0 && *reason == StepDownReason::SteppedDown)
    );
    assert!(state.borrow_and_update().owned.contains_key(&1));
    a.leave().await;
}

#[test]
fn a_shard_count_of_zero_is_refused() {
    let locks = KeyedLocks::new("a", "memory", |key, identity| {
        Arc::new(MemoryStore::new().lock(key, identity))
    });
    let err = Shards::builder("jobs", 0, locks).build().unwrap_err();
    assert!(
        matches!(err, ConfigError::InvalidShardCount { count: 0, .. }),
        "{err}"
    );
}

/// A member alone takes a thousand shards over several rounds, renewing those it holds on
/// time: no term ends by its deadline without a fault, and ten members balance.
#[tokio::test]
async fn a_thousand_shards_over_ten_members() {
    tokio::time::pause();
    let set = Set::new(Clock::Store, 1000);
    let members: Vec<Member> = (0..10).map(|i| set.join(&format!("m{i}"))).collect();
    let refs: Vec<&Member> = members.iter().collect();
    let took = until(Duration::from_secs(120), || balanced_members(&refs, 1000)).await;
    let sizes: Vec<usize> = members.iter().map(|m| m.owned().len()).collect();
    assert!(took.is_some(), "not balanced: {sizes:?}");
    assert_eq!(set.expired(), 0, "terms ended by their deadline");
    set.finish(members, "a thousand shards").await;
}

/// A member taking a large set from a store that answers each request in 100 ms claims a few
/// batches a round, over many rounds; it reads every shard far less often than once a round
/// (the claims one read calls for go on in the rounds after it, and such reads are paced by
/// what they take), and no term ends by its deadline.
#[tokio::test]
async fn a_member_taking_many_shards_reads_them_all_rarely() {
    tokio::time::pause();
    let count = 2000;
    let set = Set::new(Clock::Store, count);
    let member = set.join("a");
    member
        .shard_faults
        .delay_requests(Duration::from_millis(100));
    let took = until(Duration::from_secs(120), || {
        member.owned().len() == count as usize
    })
    .await
    .unwrap_or_else(|| panic!("took {} shards", member.owned().len()));
    let rounds = took.as_millis() / TIMINGS.retry_period.as_millis();
    let reads = member
        .shard_faults
        .calls()
        .iter()
        .filter(|c| c.operation == "get")
        .count()
        / count as usize;
    assert!(rounds >= 10, "took every shard in {rounds} rounds");
    assert!(
        reads as u128 * 2 <= rounds,
        "read every shard {reads} times in {rounds} rounds"
    );
    assert_eq!(set.expired(), 0, "terms ended by their deadline");
    set.finish([member], "a large set").await;
}

/// A claim that landed with its answer lost (of a shard, and of the member's own record) is
/// known again by the member that sent it, which takes the record over (with the next token)
/// at once, instead of waiting out its lease as a term another process started (S13).
async fn a_claim_whose_answer_was_lost_is_known_as_this_members(clock: Clock) {
    tokio::time::pause();
    let set = Set::new(clock, 3);
    let a = set.join("a");
    let operation = match clock {
        Clock::Follower => "create",
        Clock::Store | Clock::InStore => "try_acquire",
    };
    // The member's own record's claim too: a member without its record takes no shard.
    for faults in [&a.shard_faults, &a.member_faults] {
        faults.lose_next_answer(operation, leader_core::faults::Fault::Unavailable);
    }
    let took = until(TIMINGS.lease_duration * 2, || a.owned().len() == 3)
        .await
        .unwrap_or_else(|| panic!("a took {:?}", a.owned()));
    assert!(
        took < TIMINGS.lease_duration,
        "took every shard {took:?} after the lost answer; the lease is {:?}",
        TIMINGS.lease_duration
    );
    for faults in [&a.shard_faults, &a.member_faults] {
        assert_eq!(faults.failures(operation), 1, "{:?}", faults.calls());
    }
    set.finish([a], "a lost claim").await;
}

on_clocks!(a_claim_whose_answer_was_lost_is_known_as_this_members {
    a_claim_whose_answer_was_lost_is_known_on_the_followers_clock: Follower,
    a_claim_whose_answer_was_lost_is_known_on_the_stores_clock: Store,
    a_claim_whose_answer_was_lost_is_known_where_the_store_keeps_leases: InStore,
});

/// S6 for a shard: a release at shutdown just after a renewal whose answer was lost (the
/// store took it; the member still knows the version before) loses its compare-and-swap, and
/// is sent again over the version a read finds, as the elector's is: every shard, and the
/// member record, is left free for the others rather than held for a lease.
#[tokio::test]
async fn a_release_after_a_renewal_whose_answer_was_lost_is_sent_over_the_record_read() {
    tokio::time::pause();
    let (set, a) = one_member_with_every_shard().await;
    let lost = |faults: &Faults, answers: usize| {
        for _ in 0..answers {
            faults.lose_next_answer("renew", leader_core::faults::Fault::Unavailable);
        }
    };
    lost(&a.shard_faults, 3);
    lost(&a.member_faults, 1);
    until(TIMINGS.lease_duration, || {
        a.shard_faults.failures("renew") == 3 && a.member_faults.failures("renew") == 1
    })
    .await
    .expect("the renewals' answers were lost");
    let (shard_faults, member_faults) = (a.shard_faults.clone(), a.member_faults.clone());
    a.leave().await;
    left_free(&set, 3, "a").await;
    // Each release lost its compare-and-swap once, and landed over the record read.
    for (faults, what, records) in [(&shard_faults, "shards", 3), (&member_faults, "member", 1)] {
        assert_eq!(
            faults.failures("update"),
            records,
            "{what}: {:?}",
            faults.calls()
        );
    }
}

/// A set of three shards on the follower's clock, and its one member `a`, which took them.
async fn one_member_with_every_shard() -> (Set, Member) {
    let set = Set::new(Clock::Follower, 3);
    let a = set.join("a");
    until(Duration::from_secs(30), || a.owned().len() == 3)
        .await
        .expect("a took every shard");
    (set, a)
}

/// Asserts that the `count` shards of set `jobs`, and `member`'s record, are free.
async fn left_free(set: &Set, count: u32, member: &str) {
    for shard in 0..count {
        let record =
            stored_record(&set.store, &leader_core::backend::shard_key("jobs", shard)).await;
        assert!(record.is_free(), "shard {shard} left held: {record:?}");
    }
    let key = leader_core::backend::member_key("jobs", member);
    let record = stored_record(&set.store, &key).await;
    assert!(record.is_free(), "the member record left held: {record:?}");
}

/// S6 for a shard: a release at shutdown that meets a transient failure is sent again, so
/// every shard, and the member record, is left free for the others rather than one of them
/// waiting out its lease.
#[tokio::test]
async fn a_shards_release_that_fails_for_a_moment_is_sent_again() {
    tokio::time::pause();
    let (set, a) = one_member_with_every_shard().await;
    let shard_faults = a.shard_faults.clone();
    shard_faults.fail_next(leader_core::faults::Fault::Unavailable);
    // The member record's release too: a member record left held keeps the member counted.
    let member_faults = a.member_faults.clone();
    member_faults.fail_next(leader_core::faults::Fault::Unavailable);
    a.leave().await;
    left_free(&set, 3, "a").await;
    // The faults met the releases: a failed write, then one that landed, of each.
    for (faults, what) in [(&shard_faults, "shards"), (&member_faults, "member record")] {
        let writes: Vec<_> = faults
            .calls()
            .into_iter()
            .filter(|c| c.operation == "update")
            .map(|c| c.ok)
            .collect();
        assert_eq!(faults.failures("update"), 1, "{what}: {writes:?}");
        assert_eq!(writes.last(), Some(&Some(true)), "{what}: {writes:?}");
    }
}

/// S6 for a shard: work that takes a while to stop (it holds its term for a second after the
/// term ends) delays the shard's release, and the next owner starts only after it stopped.
#[tokio::test]
async fn a_shard_moves_only_once_its_work_has_stopped() {
    tokio::time::pause();
    let set = Set::new(Clock::Follower, 4);
    let stopped = Times::default();
    let shards = Shards::builder("jobs", 4, plain_locks(&set.store, "slow"))
        .timings(TIMINGS)
        .on_shard_started(slow_to_stop(Duration::from_secs(1), &stopped))
        .build()
        .unwrap();
    let slow = Member::start(shards, Shards::run);
    slow.state
        .clone()
        .wait_for(|s| s.owned.len() == 4)
        .await
        .unwrap();
    let b = set.join("b");
    until(Duration::from_secs(30), || b.owned().len() == 2)
        .await
        .expect("b took its share");
    let stopped = stopped.lock().unwrap().clone();
    assert_eq!(stopped.len(), 2, "two shards handed over: {stopped:?}");
    for (shard, at) in stopped {
        let starts = set.log.starts(shard);
        assert!(
            starts.iter().all(|start| *start >= at),
            "shard {shard}: b started at {starts:?}, before the slow work stopped at {at:?}"
        );
    }
    b.leave().await;
    slow.leave().await;
}

/// S6 for a shard whose term ended by its deadline: its record may still name this member
/// (on some stores for as long as the member lives), but the member takes it again only once
/// the work of the term that ended has stopped, never beside it.
#[tokio::test]
async fn a_lapsed_shard_is_taken_again_only_once_its_work_has_stopped() {
    tokio::time::pause();
    let store = MemoryStore::new();
    let faults = Faults::new();
    let locks = KeyedLocks::new("a", "memory", {
        let faults = faults.clone();
        move |key, identity| {
            let lock = Arc::new(store.lock(key, identity));
            if key.starts_with("jobs-shard-") {
                Arc::new(FaultyLock::with_faults(lock, faults.clone()))
            } else {
                lock
            }
        }
    });
    let (starts, stops): (Times, Times) = Default::default();
    let shards = {
        let starts = starts.clone();
        // Work that takes five seconds to stop once its term ends.
        let slow = slow_to_stop(Duration::from_secs(5), &stops);
        Shards::builder("jobs", 4, locks)
            .timings(TIMINGS)
            .request_timeout(TIMINGS.renew_deadline)
            .on_shard_started(move |shard, term| {
                starts.lock().unwrap().push((shard, Instant::now()));
                slow(shard, term);
            })
            .build()
            .unwrap()
    };
    let a = Member::start(shards, Shards::run);
    let mut state = a.state.clone();
    state.wait_for(|s| s.owned.len() == 4).await.unwrap();
    // The shards' renewals fail until every term has ended by its deadline.
    faults.fail_all(Some(leader_core::faults::Fault::Unavailable));
    state.wait_for(|s| s.owned.is_empty()).await.unwrap();
    faults.fail_all(None);
    state.wait_for(|s| s.owned.len() == 4).await.unwrap();
    let (starts, stops) = (
        starts.lock().unwrap().clone(),
        stops.lock().unwrap().clone(),
    );
    for shard in 0..4 {
        let stopped = stops
            .iter()
            .find(|(s, _)| *s == shard)
            .map(|(_, at)| *at)
            .unwrap_or_else(|| panic!("shard {shard} taken again while its work still ran"));
        let again: Vec<Instant> = starts
            .iter()
            .filter(|(s, _)| *s == shard)
            .map(|(_, at)| *at)
            .skip(1)
            .collect();
        assert!(!again.is_empty(), "shard {shard} not taken again");
        assert!(
            again.iter().all(|at| *at >= stopped),
            "shard {shard} taken again at {again:?}, before its work stopped at {stopped:?}"
        );
    }
    a.leave().await;
}

/// A member's records on a store that renews leases itself, read with or without expired
/// records showing.
#[derive(Debug)]
struct Expiring {
    inner: KeyedLocks,
    shows_expiry: bool,
}

#[leader_core::async_trait]
impl LockSet for Expiring {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.inner.lock(key)
    }
    fn identity(&self) -> &str {
        self.inner.identity()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn reads_show_expiry(&self) -> bool {
        self.shows_expiry
    }
}

/// The acquisition attempts of other members' records (the probes) three settled members
/// send over ten leases, on a store that renews leases itself.
async fn probes_of_settled_members(shows_expiry: bool) -> usize {
    let store = MemoryStore::new();
    let probes = Faults::new();
    let shutdown = CancellationToken::new();
    let mut members = Vec::new();
    for identity in ["a", "b", "c"] {
        let (store, probes) = (store.clone(), probes.clone());
        let locks = KeyedLocks::new(identity, "memory", move |key, identity| {
            let lock = Arc::new(store.lock(key, identity).with_renewal_in_store(true));
            if key.starts_with("jobs-member-") {
                Arc::new(FaultyLock::with_faults(lock, probes.clone()))
            } else {
                lock
            }
        });
        let set = Expiring {
            inner: locks,
            shows_expiry,
        };
        let shards = Shards::builder("jobs", 6, set)
            .timings(TIMINGS)
            .build()
            .unwrap();
        let state = shards.subscribe();
        let task = tokio::spawn(
            shards.run_per_shard(shutdown.clone(), |_, _| std::future::pending::<()>()),
        );
        members.push((state, task));
    }
    let states: Vec<_> = members.iter().map(|(state, _)| state).collect();
    until(Duration::from_secs(30), || balanced(&states, 6))
        .await
        .expect("balanced");
    let settled = Instant::now();
    sleep(TIMINGS.lease_duration * 10).await;
    let probes = probes
        .calls()
        .iter()
        .filter(|c| c.sent >= settled && c.operation == "try_acquire")
        .count();
    shutdown.cancel();
    for (_, task) in members {
        task.await.unwrap().unwrap();
    }
    probes
}

/// Where a lease that runs out takes its record with it (etcd), the next read shows a dead
/// member: its peers never probe each other's records. Elsewhere they do, once per lease.
#[tokio::test]
async fn members_probe_each_other_only_where_reads_do_not_show_expiry() {
    tokio::time::pause();
    let without = probes_of_settled_members(false).await;
    assert!(
        without >= 3 * 2 * 5,
        "{without} probes over ten leases where reads do not show expiry"
    );
    let with = probes_of_settled_members(true).await;
    assert_eq!(with, 0, "probes where reads show expiry");
}

/// S9 for a shard set: a store down for ten leases. Every member's work stops within the renew
/// deadline of the outage's start; while it lasts, each member's rounds back off to about one a
/// lease (not one a retry period); once the store answers again, the members are balanced
/// within a few leases, and no shard had two owners.
#[tokio::test]
async fn an_outage_stops_the_work_and_the_members_back_off() {
    tokio::time::pause();
    let set = Set::new(Clock::Store, 6);
    let members: Vec<Member> = ["a", "b", "c"].iter().map(|m| set.join(m)).collect();
    let refs: Vec<&Member> = members.iter().collect();
    set.until_balanced(&refs, "balanced").await;

    let down = Instant::now();
    for m in &members {
        m.faults
            .fail_all(Some(leader_core::faults::Fault::Unavailable));
    }
    let outage = TIMINGS.lease_duration * 10;
    sleep(outage).await;
    let up = Instant::now();
    for m in &members {
        m.faults.fail_all(None);
    }
    for (name, m) in ["a", "b", "c"].iter().zip(&members) {
        let ended = set
            .log
            .last_end(name, down)
            .expect("work before the outage");
        assert!(
            ended <= down + TIMINGS.renew_deadline,
            "{name}'s work ended {:?} after the outage began",
            ended - down
        );
        assert!(m.owned().is_empty(), "{name} still claims {:?}", m.owned());
    }
    // After its first lease, each member's requests: a round reads the roster, the member
    // records and the six shards (a request each on this store), about once a lease once its
    // retries have backed off, not once a retry period.
    let settled = down + TIMINGS.lease_duration;
    let records = 1 + 3 + 6;
    let leases = (up - settled).as_secs_f64() / TIMINGS.lease_duration.as_secs_f64();
    let per_retry_period = (up - settled).as_secs_f64() / TIMINGS.retry_period.as_secs_f64();
    for (name, m) in ["a", "b", "c"].iter().zip(&members) {
        let sent = m
            .faults
            .calls()
            .iter()
            .filter(|c| c.sent >= settled && c.sent < up)
            .count();
        // Backed-off waits are jittered down to 0.8 of a lease.
        let bound = (leases * 1.25 + 2.0) * f64::from(records);
        assert!(
            (sent as f64) <= bound,
            "{name} sent {sent} requests over {leases:.0} leases of outage (bound {bound:.0}; \
             a round each retry period would be {:.0})",
            per_retry_period * f64::from(records)
        );
    }
    let back = until(Duration::from_secs(60), || balanced_members(&refs, 6)).await;
    let back = back.expect("balanced again after the outage");
    assert!(
        back <= TIMINGS.lease_duration * 4,
        "balanced again {back:?} after the store came back"
    );
    set.finish(members, "an outage").await;
}

/// Ten members of a thousand shards: one joining and one leaving each move exactly the share
/// that changes hands (the newcomer's, the leaver's) and rebalance within a lease and a retry
/// period (a leave within a lease: its shards are released), with no term ending by its
/// deadline (free shards are spread by rendezvous hashing, and a member that loses a race for
/// one takes the next).
async fn ten_members_rebalance_within_a_lease(clock: Clock) {
    tokio::time::pause();
    let count = 1000;
    let set = Set::new(clock, count);
    let mut members: Vec<Member> = (0..10).map(|i| set.join(&format!("m{i}"))).collect();
    let balanced_now = |members: &[Member]| {
        let refs: Vec<&Member> = members.iter().collect();
        balanced_members(&refs, count)
    };
    let sizes = |members: &[Member]| members.iter().map(|m| m.owned().len()).collect::<Vec<_>>();
    until(Duration::from_secs(120), || balanced_now(&members))
        .await
        .expect("balanced at the start");

    let before = set.log.moves();
    members.push(set.join("m10"));
    let took = until(Duration::from_secs(60), || balanced_now(&members))
        .await
        .unwrap_or_else(|| panic!("not balanced after the join: {:?}", sizes(&members)));
    assert!(
        took <= TIMINGS.lease_duration + TIMINGS.retry_period,
        "rebalanced {took:?} after the join"
    );
    let newcomers = members[10].owned().len();
    assert_eq!(
        set.log.moves() - before,
        newcomers,
        "only the newcomer's share moved"
    );

    let before = set.log.moves();
    let leaver = members.remove(3);
    let given = leaver.owned().len();
    leaver.leave().await;
    let took = until(Duration::from_secs(60), || balanced_now(&members))
        .await
        .unwrap_or_else(|| panic!("not balanced after the leave: {:?}", sizes(&members)));
    assert!(
        took < TIMINGS.lease_duration,
        "rebalanced {took:?} after the leave"
    );
    assert_eq!(
        set.log.moves() - before,
        given,
        "only the leaver's share moved"
    );
    let expired = set.expired();
    assert_eq!(expired, 0, "terms ended by their deadline");
    set.finish(members, "ten members").await;
}

on_clocks!(ten_members_rebalance_within_a_lease {
    ten_members_rebalance_within_a_lease_on_the_followers_clock: Follower,
    ten_members_rebalance_within_a_lease_renewed_in_the_store: InStore,
});

/// A member of weight 3 beside one of weight 1, drained and undrained: it takes its three
/// shards back, on every clock (where acquisitions keep the stored extensions too).
#[tokio::test]
async fn a_heavy_member_drained_and_undrained_takes_its_weight_back() {
    tokio::time::pause();
    for clock in [Clock::Follower, Clock::Store, Clock::InStore] {
        let mut set = Set::new(clock, 4);
        set.weights = vec![("big", 3)];
        let big = set.join("big");
        let small = set.join("small");
        until_sizes(&[&big, &small], 4, &[3, 1], "not by weight").await;
        let tool = operator(&set);
        drain_member(&tool, "jobs", "big", true)
            .await
            .expect("drained");
        until_sizes(&[&big, &small], 4, &[0, 4], "not drained").await;
        drain_member(&tool, "jobs", "big", false)
            .await
            .expect("undrained");
        until_sizes(&[&big, &small], 4, &[3, 1], "not back").await;
        sleep(TIMINGS.lease_duration * 2).await;
        assert_eq!(
            sizes(&[&big, &small], 4),
            Some(vec![3, 1]),
            "{clock:?}: not settled"
        );
        set.finish([big, small], "paused clock").await;
    }
}

/// Claims or reads of every shard that take longer than the renew deadline (the shards of a
/// member that left, taken from a slow store) never hold up the renewals of the shards a member
/// owns: no term ends by its deadline, and the set balances once the store answers in time.
async fn slow_requests_never_delay_the_renewals(reads: bool) {
    let mut set = Set::new(Clock::Store, 8);
    let slow = Slow::default();
    set.slow = Some(slow.clone());
    let [a, b] = set.join_all(["a", "b"]);
    set.until_balanced(&[&a, &b], "balanced").await;
    let kept = a.owned();
    let switch = if reads { &slow.reads } else { &slow.claims };
    switch.set(true);
    b.leave().await;
    // a claims b's released shards, each claim (or read) answered after four renew deadlines.
    sleep(TIMINGS.renew_deadline * 6).await;
    assert_eq!(set.expired(), 0, "terms ended by their deadline");
    assert!(a.owned().is_superset(&kept), "a lost shards it owned");
    switch.set(false);
    until(Duration::from_secs(60), || a.owned().len() == 8)
        .await
        .unwrap_or_else(|| panic!("a took {:?}", a.owned()));
    assert_eq!(set.expired(), 0, "terms ended by their deadline");
    set.finish([a], "paused clock").await;
}

#[tokio::test]
async fn slow_claims_never_delay_the_renewals() {
    tokio::time::pause();
    slow_requests_never_delay_the_renewals(false).await;
}

#[tokio::test]
async fn slow_reads_never_delay_the_renewals() {
    tokio::time::pause();
    slow_requests_never_delay_the_renewals(true).await;
}

/// S16: the roster, a member record and a shard record written by a later release, with
/// fields and extension keys this release does not know, keep them through this release's
/// members joining, taking shards, renewing and leaving.
#[tokio::test]
async fn a_later_releases_fields_survive_this_releases_members() {
    tokio::time::pause();
    let set = Set::new(Clock::Follower, 4);
    let later = |key: &str| {
        let mut record = leader_core::LeaderElectionRecord::new(
            "",
            Duration::from_secs(30 * 24 * 3600),
            chrono::Utc::now(),
            0,
        );
        record
            .unknown_fields
            .insert("setVersion".into(), serde_json::json!(3));
        record
            .extensions
            .insert("placement/zone".into(), key.to_owned());
        record
    };
    let roster = leader_core::backend::roster_key("jobs");
    let mut first = later(&roster);
    first
        .extensions
        .insert(leader_core::COUNT_EXTENSION.into(), "4".into());
    let lock = |key: &str| set.store.lock(key, "later-release");
    lock(&roster).create(&first).await.expect("the roster");
    let shard = leader_core::backend::shard_key("jobs", 2);
    lock(&shard).create(&later(&shard)).await.expect("a shard");
    let [a, b] = set.join_all(["a", "b"]);
    until(Duration::from_secs(60), || balanced_members(&[&a, &b], 4))
        .await
        .expect("balanced");
    sleep(TIMINGS.lease_duration * 2).await;
    a.leave().await;
    sleep(TIMINGS.lease_duration).await;
    for key in [&roster, &shard] {
        let stored = lock(key).get().await.expect("get").expect("the record");
        assert_eq!(
            stored
                .record
                .extensions
                .get("placement/zone")
                .map(String::as_str),
            Some(key.as_str()),
            "{key}: {:?}",
            stored.record
        );
        if key == &roster {
            assert_eq!(
                stored.record.unknown_fields.get("setVersion"),
                Some(&serde_json::json!(3)),
                "{key}: {:?}",
                stored.record
            );
        }
    }
    set.finish([b], "a later release's records").await;
}

/// A shard set checks its lease against the store before joining, as the elector does: a lease
/// the store would not keep is `ShardsError::LeaseNotKept`, and nothing is written.
#[tokio::test]
async fn a_lease_the_store_would_not_keep_is_refused_before_joining() {
    let store = MemoryStore::new();
    let made = store.clone();
    let locks = KeyedLocks::new("a", "memory", move |key, identity| {
        // The store keeps no lease at all.
        Arc::new(TestLock::new(made.lock(key, identity)).longest_lease(Duration::ZERO))
    });
    let shards = Shards::builder("jobs", 4, locks)
        .timings(TIMINGS)
        .build()
        .expect("valid");
    let result = shards
        .run_per_shard(CancellationToken::new(), |_, _| {
            std::future::pending::<()>()
        })
        .await;
    assert!(
        matches!(result, Err(ShardsError::LeaseNotKept { .. })),
        "{result:?}"
    );
    let roster = store.lock(leader_core::backend::roster_key("jobs"), "r");
    assert!(roster.get().await.expect("get").is_none(), "a member wrote");
}

/// Whether `members` own every shard of `count` but those of `left`, each once, at their
/// shares of the shards they can read (within one of each other).
fn balanced_around(members: &[&Member], count: u32, left: &[u32]) -> bool {
    let owned: Vec<BTreeSet<u32>> = members.iter().map(|m| m.owned()).collect();
    let all: BTreeSet<u32> = owned.iter().flatten().copied().collect();
    let total: usize = owned.iter().map(BTreeSet::len).sum();
    let wanted: BTreeSet<u32> = (0..count).filter(|s| !left.contains(s)).collect();
    let sizes = owned.iter().map(BTreeSet::len);
    all == wanted
        && total == wanted.len()
        && sizes.clone().max().unwrap_or(0) - sizes.min().unwrap_or(0) <= 1
}

/// The record of `key` still holds what `corrupt` wrote: nobody overwrote it (S8).
async fn still_unreadable(set: &Set, key: &str) {
    let read = set.store.lock(key, "operator").get().await;
    assert!(
        matches!(read, Err(leader_core::LockError::InvalidRecord { .. })),
        "{key} was overwritten: {read:?}"
    );
}

/// S8 for a shard set: one shard record that cannot be read freezes nothing. A member that
/// owned it crashes: its other shards are taken once their lease runs out; a newcomer joins
/// and gets its share; the set grows; a member is drained. The bad record is left as it is,
/// owned and taken by nobody, and no term ends by its deadline.
#[tokio::test]
async fn one_unreadable_shard_record_freezes_nothing() {
    tokio::time::pause();
    let set = Set::new(Clock::Follower, 9);
    let (a, b, c) = (set.join("a"), set.join("b"), set.join("c"));
    set.until_balanced(&[&a, &b, &c], "balanced").await;
    let bad = *c.owned().first().expect("c owns a shard");
    let bad_key = leader_core::backend::shard_key("jobs", bad);
    set.store.corrupt(&bad_key, "not a record");
    c.crash();
    until(Duration::from_secs(30), || {
        balanced_around(&[&a, &b], 9, &[bad])
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "c's other shards not taken: {:?} {:?}",
            a.owned(),
            b.owned()
        )
    });
    let d = set.join("d");
    until(Duration::from_secs(30), || {
        balanced_around(&[&a, &b, &d], 9, &[bad])
    })
    .await
    .unwrap_or_else(|| panic!("d got no share: {:?}", d.owned()));
    resize_shard_set(&operator(&set), "jobs", 12)
        .await
        .expect("resized");
    until(Duration::from_secs(30), || {
        balanced_around(&[&a, &b, &d], 12, &[bad])
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "the set did not grow: {:?}",
            [a.owned(), b.owned(), d.owned()]
        )
    });
    drain_member(&operator(&set), "jobs", "d", true)
        .await
        .expect("drained");
    until(Duration::from_secs(30), || {
        d.owned().is_empty() && balanced_around(&[&a, &b], 12, &[bad])
    })
    .await
    .unwrap_or_else(|| panic!("d not drained: {:?}", d.owned()));
    still_unreadable(&set, &bad_key).await;
    assert_eq!(set.expired(), 0, "terms ended by their deadline");
    set.finish([a, b, d], "paused clock").await;
}

/// S8 for a shard set: a crashed member's record that cannot be read, then a roster that
/// cannot be read, freeze nothing: the member's shards are taken once their lease runs out,
/// and with the roster unreadable the members go on as last read (a second crash is failed
/// over too). Neither record is overwritten.
#[tokio::test]
async fn an_unreadable_member_record_or_roster_freezes_nothing() {
    tokio::time::pause();
    let set = Set::new(Clock::Follower, 12);
    let (a, b, c, d) = (set.join("a"), set.join("b"), set.join("c"), set.join("d"));
    set.until_balanced(&[&a, &b, &c, &d], "balanced").await;
    let c_key = leader_core::backend::member_key("jobs", "c");
    set.store.corrupt(&c_key, "not a record");
    c.crash();
    until(Duration::from_secs(30), || {
        balanced_members(&[&a, &b, &d], 12)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "c's shards not taken: {:?}",
            [a.owned(), b.owned(), d.owned()]
        )
    });
    let roster = leader_core::backend::roster_key("jobs");
    set.store.corrupt(&roster, "not a record");
    d.crash();
    until(Duration::from_secs(30), || balanced_members(&[&a, &b], 12))
        .await
        .unwrap_or_else(|| panic!("d's shards not taken: {:?}", [a.owned(), b.owned()]));
    still_unreadable(&set, &c_key).await;
    still_unreadable(&set, &roster).await;
    assert_eq!(set.expired(), 0, "terms ended by their deadline");
    set.finish([a, b], "paused clock").await;
}

/// S17 for a shard set: the count reaches the work. A member's count watch starts at the count
/// it was built with and follows each resize; when it moves to a smaller count, the terms of
/// the shards past it have ended already, so work that restarts on the new count never runs
/// beside the removed shards' work of this member.
#[tokio::test]
async fn the_count_reaches_the_work() {
    tokio::time::pause();
    let locks = plain_locks(&MemoryStore::new(), "a");
    let tool = locks.clone();
    let shards = Shards::builder("jobs", 6, locks)
        .timings(TIMINGS)
        .build()
        .expect("valid configuration");
    let mut count = shards.subscribe_count();
    assert_eq!(*count.borrow_and_update(), 6);
    let a = Member::start(shards, Shards::run);
    until(Duration::from_secs(10), || a.owned().len() == 6)
        .await
        .expect("a owns the set");
    let terms = a.state.borrow().owned.clone();
    for (to, resized) in [(9, "grown"), (4, "shrunk")] {
        resize_shard_set(&tool, "jobs", to).await.expect(resized);
        tokio::time::timeout(TIMINGS.retry_period * 4, count.changed())
            .await
            .expect("the count reached the work within a few rounds")
            .expect("the set runs");
        assert_eq!(*count.borrow_and_update(), to);
    }
    for (shard, term) in &terms {
        assert_eq!(
            term.is_lost(),
            *shard >= 4,
            "shard {shard}'s term when the count moved to 4"
        );
    }
    a.leave().await;
    assert!(
        count.changed().await.is_err(),
        "the count's sender outlived the set"
    );
}

/// The only member, `a`, of a set of `count` shards on a store of its own, whose shard records
/// answer their compare-and-swap writes (`update`: extensions, releases) `updates` late and
/// their claims `claims` late, the store applying them at once (renewals and reads answer at
/// once); the terms that ended by their deadline are counted in the number returned.
fn late_member(
    count: u32,
    updates: Duration,
    claims: Duration,
) -> (leader_core::ShardsBuilder, Arc<AtomicUsize>) {
    let store = MemoryStore::new();
    let expired = Arc::new(AtomicUsize::new(0));
    let locks = KeyedLocks::new("a", "memory", move |key, identity| {
        let lock: Arc<dyn ResourceLock> = Arc::new(store.lock(key, identity));
        if key.starts_with("jobs-shard-") {
            Arc::new(
                TestLock::wrap(lock)
                    .late(&[Request::Update], updates)
                    .late(&CLAIMS, claims),
            )
        } else {
            lock
        }
    });
    let builder = Shards::builder("jobs", count, locks)
        .timings(TIMINGS)
        .request_timeout(TIMINGS.renew_deadline)
        .on_shard_stopped(count_expired(&expired));
    (builder, expired)
}

/// The shards' work writes an extension every round, each write answered in more than a
/// retry period: the writes go out together after the round's renewals, so no term ends by
/// its deadline (one by one before the renewals, eight of them outlast the renew deadline),
/// and every shard's writes succeed.
#[tokio::test]
async fn extension_writes_never_delay_the_renewals() {
    tokio::time::pause();
    const COUNT: u32 = 8;
    let updates = TIMINGS.retry_period + Duration::from_millis(100);
    let (shards, expired) = late_member(COUNT, updates, Duration::ZERO);
    let shards = shards.build().expect("valid configuration");
    let written = Arc::new(Mutex::new(std::collections::BTreeMap::<u32, usize>::new()));
    let work = {
        let written = written.clone();
        move |shard, term: Leadership| {
            let written = written.clone();
            async move {
                for n in 0.. {
                    if term
                        .set_extension("progress", Some(n.to_string()))
                        .await
                        .is_ok()
                    {
                        *written.lock().unwrap().entry(shard).or_default() += 1;
                    }
                }
            }
        }
    };
    let a = Member::start(shards, |shards, shutdown| {
        shards.run_per_shard(shutdown, work)
    });
    sleep(TIMINGS.lease_duration * 6).await;
    assert_eq!(
        expired.load(Ordering::SeqCst),
        0,
        "terms ended by their deadline while extensions were written"
    );
    let written = written.lock().unwrap().clone();
    assert_eq!(written.len(), COUNT as usize, "{written:?}");
    assert!(written.values().all(|&n| n >= 5), "{written:?}");
    a.leave().await;
}

/// A shard's extensions written in the round whose renewal's answer was lost (the store took
/// the renewal; the member still knows the version before) lose their compare-and-swap: the
/// member reads the record, finds the term its own, and writes them again over the version
/// read, as the elector does. The term goes on; it is not lost to its own renewal.
#[tokio::test]
async fn an_extension_write_after_a_renewal_whose_answer_was_lost_is_sent_again() {
    tokio::time::pause();
    let store = MemoryStore::new();
    let faults = Faults::new();
    let locks = {
        let (store, faults) = (store.clone(), faults.clone());
        KeyedLocks::new("a", "memory", move |key, identity| {
            let lock = store.lock(key, identity);
            if key.starts_with("jobs-shard-") {
                Arc::new(FaultyLock::with_faults(lock, faults.clone())) as Arc<dyn ResourceLock>
            } else {
                Arc::new(lock)
            }
        })
    };
    let ends = Ends::default();
    let shards = Shards::builder("jobs", 1, locks)
        .timings(TIMINGS)
        .on_shard_stopped(record_ends(&ends))
        .build()
        .expect("valid configuration");
    let write = Arc::new(tokio::sync::Notify::new());
    let written = Arc::new(Mutex::new(None));
    let work = {
        let (write, written) = (write.clone(), written.clone());
        move |_, term: Leadership| {
            let (write, written) = (write.clone(), written.clone());
            async move {
                write.notified().await;
                let answer = term.set_extension("progress", Some("7".into())).await;
                *written.lock().unwrap() = Some(answer.map_err(|err| err.to_string()));
                std::future::pending::<()>().await;
            }
        }
    };
    let a = Member::start(shards, |shards, shutdown| {
        shards.run_per_shard(shutdown, work)
    });
    until(Duration::from_secs(30), || a.owned().len() == 1)
        .await
        .expect("a took the shard");
    // The next round renews the shard, its answer lost, then writes the extension.
    faults.lose_next_answer("renew", leader_core::faults::Fault::Unavailable);
    write.notify_one();
    until(TIMINGS.lease_duration, || written.lock().unwrap().is_some())
        .await
        .expect("the write was answered");
    // The write lost its compare-and-swap once, and landed over the record read.
    assert_eq!(faults.failures("renew"), 1, "{:?}", faults.calls());
    assert_eq!(faults.failures("update"), 1, "{:?}", faults.calls());
    assert_eq!(*written.lock().unwrap(), Some(Ok(())));
    let record = stored_record(&store, &leader_core::backend::shard_key("jobs", 0)).await;
    assert_eq!(
        record.extensions.get("progress").map(String::as_str),
        Some("7")
    );
    sleep(TIMINGS.lease_duration).await;
    assert!(
        ends.lock().unwrap().is_empty(),
        "{:?}",
        ends.lock().unwrap()
    );
    assert_eq!(a.owned().len(), 1);
    a.leave().await;
}

/// A shard's work that returns while another holder of its term has a request waiting (an
/// extensions write) still gives the shard up: the give-up is asked again until the member
/// takes it, and the shard is never left owned with no work running.
#[tokio::test]
async fn a_give_up_is_never_lost() {
    tokio::time::pause();
    let (a, ends) = two_shards_with_work(|shard, term| async move {
        if shard == 0 {
            // Another holder of the term asks for a write, which waits for the member's next
            // round; the work returns meanwhile.
            let other = term.clone();
            tokio::spawn(async move {
                let _ = other.set_extension("note", Some("x".into())).await;
            });
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
            return;
        }
        std::future::pending::<()>().await;
    });
    until_given_up(&ends, 0).await;
    assert_eq!(
        ends.lock().unwrap().first(),
        Some(&(0, StepDownReason::SteppedDown))
    );
    a.leave().await;
}

/// Claims that the store applies at once but answers past the round's budget (a slow
/// network) are waited for: the member takes every shard with its first claim of each (the
/// fencing tokens are all 1: no claim was dropped after the store applied it), and no term
/// ends by its deadline.
#[tokio::test]
async fn claims_answered_late_are_not_dropped() {
    tokio::time::pause();
    const COUNT: u32 = 8;
    let (shards, expired) = late_member(COUNT, Duration::ZERO, TIMINGS.retry_period);
    let shards = shards.build().expect("valid configuration");
    let a = Member::start(shards, Shards::run);
    until(TIMINGS.lease_duration * 2, || {
        a.owned().len() == COUNT as usize
    })
    .await
    .unwrap_or_else(|| panic!("a owns {:?}", a.state.borrow().tokens()));
    let tokens = a.state.borrow().tokens();
    assert!(tokens.values().all(|&t| t == 1), "{tokens:?}");
    assert_eq!(expired.load(Ordering::SeqCst), 0);
    a.leave().await;
}

/// S3 for a shard handed over by a release, as for the elector's lease: one the store
/// confirmed alive so long ago that the term would end before its first renewal is renewed
/// before the shard's work starts, and while that renewal fails, the work does not start.
#[tokio::test]
async fn a_handed_shard_with_too_little_left_is_renewed_before_its_work_starts() {
    tokio::time::pause();
    let store = MemoryStore::new();
    let failing_writes = Switch::default();
    let faults = Faults::new();
    let locks = KeyedLocks::new("a", "memory", {
        let (failing_writes, faults) = (failing_writes.clone(), faults.clone());
        move |key, identity| -> Arc<dyn ResourceLock> {
            let lock = store.lock(key, identity).with_renewal_in_store(true);
            if !key.starts_with("jobs-shard-") {
                return Arc::new(lock);
            }
            let confirmed_ago = TIMINGS.renew_deadline - TIMINGS.retry_period / 2;
            let handed = TestLock::new(lock)
                .handed(confirmed_ago)
                .failing_writes(&failing_writes);
            Arc::new(FaultyLock::with_faults(handed, faults.clone()))
        }
    });
    let shards = Shards::builder("jobs", 1, locks)
        .timings(TIMINGS)
        .build()
        .unwrap();
    let starts = Arc::new(AtomicUsize::new(0));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(shards.run_per_shard(shutdown.clone(), {
        let starts = starts.clone();
        move |_, _| {
            starts.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>()
        }
    }));
    failing_writes.set(true);
    sleep(TIMINGS.renew_deadline * 4).await;
    assert_eq!(
        starts.load(Ordering::SeqCst),
        0,
        "the work started on a lease nobody confirmed"
    );
    failing_writes.set(false);
    until(Duration::from_secs(10), || {
        starts.load(Ordering::SeqCst) == 1
    })
    .await
    .expect("the work starts once the renewal succeeds");
    let (operations, next) = after_last_acquisition(&faults);
    assert_eq!(
        next,
        Some("renew"),
        "a renewal confirms the handed lease before the work starts: {operations:?}"
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
