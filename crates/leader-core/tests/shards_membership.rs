//! Who takes part in a shard set, on tokio's paused clock and the in-memory store: how long a
//! static member's shards wait for it (its window, after a shutdown or a crash), the warning for an identity that cannot
//! outlive its process, a drained member whose terms lapsed, a roster deleted while the set
//! runs, a second reservation of the same member, and a member handing many shards over at
//! once.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::backend::{KeyedLocks, member_key, roster_key, shard_key};
use leader_core::conformance::{ShardLog, balanced};
use leader_core::faults::{Fault, Faults, FaultyLock};
use leader_core::{
    CancellationToken, ConfigError, LeaderElectionRecord, MAX_STATIC_MEMBERSHIP_WINDOW,
    MemoryStore, ResourceLock, ShardSetView, Shards, ShardsBuilder, ShardsError, ShardsState,
    Timings, TokioClock, WallClock, drain_member,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

use common::{Logs, until};

const TIMINGS: Timings = Timings {
    lease_duration: Duration::from_secs(3),
    renew_deadline: Duration::from_secs(2),
    retry_period: Duration::from_millis(500),
};

const NAME: &str = "jobs";

/// One member of the set, running until it leaves.
struct Member {
    /// Faults of the requests on the shard records alone.
    shard_faults: Faults,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), ShardsError>>,
    state: watch::Receiver<ShardsState>,
}

impl Member {
    fn owned(&self) -> BTreeSet<u32> {
        self.state.borrow().tokens().into_keys().collect()
    }

    async fn leave(self) {
        self.shutdown.cancel();
        self.task.await.expect("member task").expect("left");
    }
}

/// A set of `count` shards on one in-memory store, with the work of every member logged.
struct Set {
    store: MemoryStore,
    count: u32,
    log: ShardLog,
    /// Every term started: the member, the shard, when.
    starts: Arc<Mutex<Vec<(String, u32, Instant)>>>,
}

impl Set {
    fn new(count: u32) -> Self {
        Self {
            store: MemoryStore::new(),
            count,
            log: ShardLog::default(),
            starts: Arc::default(),
        }
    }

    /// Starts member `identity`, its builder set up by `configure` beyond the timings.
    fn join(
        &self,
        identity: &str,
        configure: impl FnOnce(ShardsBuilder) -> ShardsBuilder,
    ) -> Member {
        let shard_faults = Faults::new();
        let (store, faults) = (self.store.clone(), shard_faults.clone());
        let locks = KeyedLocks::new(identity, "memory", move |key, identity| {
            let lock = store.lock(key, identity);
            if key.starts_with("jobs-shard-") {
                Arc::new(FaultyLock::with_faults(lock, faults.clone()))
            } else {
                Arc::new(lock)
            }
        });
        let starts = self.starts.clone();
        let member = identity.to_owned();
        let builder = Shards::builder(NAME, self.count, locks)
            .timings(TIMINGS)
            .on_shard_started(move |shard, _| {
                let mut starts = starts.lock().unwrap_or_else(|p| p.into_inner());
                starts.push((member.clone(), shard, Instant::now()));
            });
        let shards = configure(builder).build().expect("valid configuration");
        let state = shards.subscribe();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(shards.run_per_shard(shutdown.clone(), self.log.work(identity)));
        Member {
            shard_faults,
            shutdown,
            task,
            state,
        }
    }

    /// The terms `member` started at or after `since`.
    fn started_by(&self, member: &str, since: Instant) -> Vec<u32> {
        let starts = self.starts.lock().unwrap_or_else(|p| p.into_inner());
        starts
            .iter()
            .filter(|(m, _, at)| m == member && *at >= since)
            .map(|&(_, shard, _)| shard)
            .collect()
    }

    /// A lock on `key` for writing records by hand, as `identity`.
    fn lock(&self, key: &str, identity: &str) -> Arc<dyn ResourceLock> {
        Arc::new(self.store.lock(key, identity))
    }
}

/// Keys of the operator's tools (`leader shards drain`).
fn operator(set: &Set) -> KeyedLocks {
    let store = set.store.clone();
    KeyedLocks::new("operator", "memory", move |key, identity| {
        Arc::new(store.lock(key, identity))
    })
}

fn balanced_members(members: &[&Member], count: u32) -> bool {
    let states: Vec<_> = members.iter().map(|m| &m.state).collect();
    balanced(&states, count)
}

/// Since `before` (moves by shard), each of the shards `held` moved once and no other shard
/// of the set's 9 moved.
fn moved_once_each(set: &Set, before: &BTreeMap<u32, usize>, held: &BTreeSet<u32>) {
    let after = set.log.moves_by_shard();
    for shard in 0..9 {
        let moved =
            after.get(&shard).copied().unwrap_or(0) - before.get(&shard).copied().unwrap_or(0);
        let expected = usize::from(held.contains(&shard));
        assert_eq!(moved, expected, "shard {shard} moved {moved} times");
    }
}

/// Three static members with `window`, balanced over 9 shards.
async fn three_static_members(set: &Set, window: Duration) -> [Member; 3] {
    let static_member =
        |b: ShardsBuilder| b.static_membership(true).static_membership_window(window);
    let members = ["a", "b", "c"].map(|id| set.join(id, static_member));
    until(Duration::from_secs(30), || {
        balanced_members(&members.iter().collect::<Vec<_>>(), set.count)
    })
    .await
    .expect("balanced");
    members
}

/// A static member away for longer than its window of two leases: its shards wait for the
/// window, then move to the others, each once; back, it takes its share as any newcomer.
#[tokio::test(start_paused = true)]
async fn a_restart_longer_than_the_window_moves_each_shard_once() {
    let window = TIMINGS.lease_duration * 2;
    let set = Set::new(9);
    let [a, b, c] = three_static_members(&set, window).await;
    let held = c.owned();
    let moves = set.log.moves_by_shard();
    c.leave().await;
    let took = until(window * 3, || balanced_members(&[&a, &b], 9))
        .await
        .expect("the others took c's shards");
    assert!(
        took >= window - TIMINGS.retry_period,
        "c's shards taken after {took:?}, within the window of {window:?}"
    );
    assert!(
        took <= window + TIMINGS.retry_period * 4,
        "c's shards taken after {took:?}"
    );
    // Long after the window: each of c's shards moved once, the others not at all.
    sleep(window * 2).await;
    moved_once_each(&set, &moves, &held);
    let before_return = set.log.moves();
    let c = set.join("c", |b| {
        b.static_membership(true).static_membership_window(window)
    });
    until(Duration::from_secs(30), || {
        balanced_members(&[&a, &b, &c], 9)
    })
    .await
    .expect("balanced after c's return");
    assert_eq!(
        set.log.moves() - before_return,
        c.owned().len(),
        "more moved than c's share"
    );
    for m in [a, b, c] {
        m.leave().await;
    }
    set.log.check("a restart longer than the window");
}

/// How a static member goes away before it starts again.
#[derive(Clone, Copy, PartialEq)]
enum Away {
    /// Shut down: its shards released reserved for it.
    Shutdown,
    /// A crash: nothing released.
    Crash,
    /// A crash whose records the store deletes once their leases run out (etcd, ZooKeeper).
    CrashDeleted,
    /// As `CrashDeleted`, just after a member's read of the shards failed: what it knew of
    /// the records went with that read, what it saw of their holder did not.
    CrashDeletedAfterAFailedRead,
}

/// A static member away for three leases (`how`), within its window of four, then started
/// again: nobody takes its shards meanwhile, and the new process takes them back: no shard
/// moves.
async fn away_within_the_window(how: Away) {
    // The members write the system's time into their records, which stands still with tokio's
    // paused clock; the view judges expiry by one that moves with it from now.
    let clock = WallClock::from_clock(TokioClock::starting_at(chrono::Utc::now()));
    let window = TIMINGS.lease_duration * 4;
    let set = Set::new(9);
    let [a, b, c] = three_static_members(&set, window).await;
    let held = c.owned();
    let moves = set.log.moves();
    if how == Away::Shutdown {
        c.leave().await;
    } else {
        c.task.abort();
    }
    sleep(TIMINGS.lease_duration + TIMINGS.retry_period).await;
    if how == Away::CrashDeletedAfterAFailedRead {
        a_read_of_the_shards_fails(&a).await;
    }
    if matches!(how, Away::CrashDeleted | Away::CrashDeletedAfterAFailedRead) {
        set.store.delete(&member_key(NAME, "c"));
        for &shard in &held {
            set.store.delete(&shard_key(NAME, shard));
        }
    }
    sleep(TIMINGS.lease_duration * 2).await;
    for other in [&a, &b] {
        let taken: Vec<_> = other.owned().intersection(&held).copied().collect();
        assert!(
            taken.is_empty(),
            "c's shards {taken:?} taken within the window"
        );
    }
    if how != Away::Shutdown {
        // What `leader status` shows of it: gone, and how long its shards wait.
        let seen = ShardSetView::read_with_clock(&operator(&set), NAME, &clock)
            .await
            .expect("the roster reads")
            .expect("a set");
        let shown = seen.member("c").expect("the roster still names c");
        assert!(!shown.alive, "{shown:?}");
        assert_eq!(shown.static_membership_window, Some(window));
    }
    let c = set.join("c", |b| {
        b.static_membership(true).static_membership_window(window)
    });
    // After a crash, once the leases of its shards have run out (S13).
    until(TIMINGS.lease_duration * 3, || c.owned() == held)
        .await
        .unwrap_or_else(|| panic!("c took {:?} back, not {held:?}", c.owned()));
    sleep(TIMINGS.lease_duration * 2).await;
    assert!(balanced_members(&[&a, &b, &c], 9));
    assert_eq!(c.owned(), held, "c's shards moved after its restart");
    assert_eq!(set.log.moves(), moves, "shards moved in the restart");
    for m in [a, b, c] {
        m.leave().await;
    }
    if how == Away::Shutdown {
        set.log.check("a restart within the window");
    }
}

/// Makes `member`'s next read of the shards fail, and waits for it. The failure is set just
/// before that read is due (a settled member reads them every half lease), so that its
/// renewals, which fail too meanwhile, keep its terms.
async fn a_read_of_the_shards_fails(member: &Member) {
    let reads = |faults: &Faults| {
        faults
            .calls()
            .into_iter()
            .filter(|c| c.operation == "get")
            .map(|c| (c.sent, c.ok))
            .collect::<Vec<_>>()
    };
    let last = reads(&member.shard_faults)
        .iter()
        .map(|&(sent, _)| sent)
        .max()
        .expect("the member reads the shards");
    tokio::time::sleep_until(last + TIMINGS.lease_duration / 2 - Duration::from_millis(20)).await;
    let failing = Instant::now();
    member.shard_faults.fail_all(Some(Fault::Unavailable));
    until(TIMINGS.lease_duration, || {
        reads(&member.shard_faults)
            .iter()
            .any(|&(sent, ok)| sent >= failing && ok == Some(false))
    })
    .await
    .expect("the member's read of the shards fails");
    member.shard_faults.fail_all(None);
}

#[tokio::test(start_paused = true)]
async fn a_restart_longer_than_the_lease_within_the_window_moves_no_shard() {
    away_within_the_window(Away::Shutdown).await;
}

#[tokio::test(start_paused = true)]
async fn a_crash_and_a_restart_within_the_window_moves_no_shard() {
    away_within_the_window(Away::Crash).await;
}

#[tokio::test(start_paused = true)]
async fn a_crash_whose_records_the_store_deletes_moves_no_shard_within_the_window() {
    away_within_the_window(Away::CrashDeleted).await;
}

#[tokio::test(start_paused = true)]
async fn a_crash_whose_records_the_store_deletes_after_a_failed_read_moves_no_shard() {
    away_within_the_window(Away::CrashDeletedAfterAFailedRead).await;
}

/// A static member that crashes for good: its shards wait for its lease to run out and then
/// for its window, and move to the others, each once.
#[tokio::test(start_paused = true)]
async fn a_crash_for_good_keeps_the_shards_for_the_window_then_moves_each_once() {
    let window = TIMINGS.lease_duration * 2;
    let set = Set::new(9);
    let [a, b, c] = three_static_members(&set, window).await;
    let held = c.owned();
    let moves = set.log.moves_by_shard();
    c.task.abort();
    let took = until(window * 4, || balanced_members(&[&a, &b], 9))
        .await
        .expect("the others took c's shards");
    let least = TIMINGS.lease_duration + window - TIMINGS.retry_period;
    let most = TIMINGS.lease_duration + window + TIMINGS.retry_period * 6;
    assert!(
        (least..=most).contains(&took),
        "c's shards taken {took:?} after its crash, not after its lease and window \
         ({least:?} to {most:?})"
    );
    sleep(window * 2).await;
    moved_once_each(&set, &moves, &held);
    for m in [a, b] {
        m.leave().await;
    }
}

/// The window is the lease unless set, and is refused shorter than the lease or past the
/// limit, naming both.
#[tokio::test(start_paused = true)]
async fn the_static_membership_window_is_the_lease_unless_set_and_is_checked() {
    let set = Set::new(3);
    let locks = |identity: &str| {
        let store = set.store.clone();
        KeyedLocks::new(identity, "memory", move |key, identity| {
            Arc::new(store.lock(key, identity))
        })
    };
    let shards = Shards::builder(NAME, 3, locks("a"))
        .timings(TIMINGS)
        .static_membership(true)
        .build()
        .expect("valid");
    assert_eq!(
        shards.config().static_membership_window,
        TIMINGS.lease_duration
    );
    let set_to = |window| {
        Shards::builder(NAME, 3, locks("a"))
            .timings(TIMINGS)
            .static_membership(true)
            .static_membership_window(window)
            .build()
    };
    let window = Duration::from_secs(600);
    assert_eq!(
        set_to(window)
            .expect("valid")
            .config()
            .static_membership_window,
        window
    );
    for wrong in [
        TIMINGS.lease_duration - Duration::from_millis(1),
        Duration::ZERO,
        MAX_STATIC_MEMBERSHIP_WINDOW + Duration::from_secs(1),
    ] {
        let err = set_to(wrong).expect_err("refused");
        assert_eq!(
            err,
            ConfigError::InvalidStaticMembershipWindow {
                window: wrong,
                lease_duration: TIMINGS.lease_duration,
                max: MAX_STATIC_MEMBERSHIP_WINDOW,
            }
        );
        assert!(
            err.to_string().contains("static membership window"),
            "{err}"
        );
    }
}

/// Static membership under a Deployment's Pod name (a ReplicaSet's random suffix) is warned
/// of once, naming the identity; a StatefulSet's Pod name, or the same name without static
/// membership, is not.
#[tokio::test(start_paused = true)]
async fn static_membership_under_a_replica_sets_pod_name_is_warned_of_once() {
    let logs = Logs::default();
    let _guard = logs.capture();
    let set = Set::new(2);
    let pod = "worker-7d4b9c8f6-x2kqz";
    let members = [
        set.join(pod, |b| b.static_membership(true)),
        set.join("worker-0", |b| b.static_membership(true)),
        set.join("worker-5f8d9c7b4d-q9wzt", |b| b),
    ];
    sleep(TIMINGS.lease_duration * 3).await;
    let warned = logs.lines_with("ReplicaSet");
    assert_eq!(warned.len(), 1, "{warned:#?}");
    assert!(
        warned[0].contains("WARN") && warned[0].contains(pod),
        "{}",
        warned[0]
    );
    assert!(warned[0].contains("StatefulSet"), "{}", warned[0]);
    for m in members {
        m.leave().await;
    }
}

/// An outage of the store is logged as the elector logs one (S9): a line when it starts and
/// a summary every 10 s, not a line per failed request of every round.
#[tokio::test(start_paused = true)]
async fn an_outage_is_logged_in_a_few_lines() {
    let logs = Logs::default();
    let _guard = logs.capture();
    let (store, faults) = (MemoryStore::new(), Faults::new());
    let every = faults.clone();
    let locks = KeyedLocks::new("a", "memory", move |key, identity| {
        Arc::new(FaultyLock::with_faults(
            store.lock(key, identity),
            every.clone(),
        ))
    });
    let shards = Shards::builder(NAME, 4, locks)
        .timings(TIMINGS)
        .build()
        .expect("valid configuration");
    let state = shards.subscribe();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(shards.run(shutdown.clone()));
    until(Duration::from_secs(30), || state.borrow().owned.len() == 4)
        .await
        .expect("all shards taken");
    faults.fail_all(Some(Fault::Unavailable));
    sleep(Duration::from_secs(60)).await;
    let lines = logs.lines_with("shard set request");
    assert!(!lines.is_empty(), "the outage was not logged");
    // The start, and a summary at most every 10 s.
    assert!(
        lines.len() <= 8,
        "{} lines in a minute: {lines:#?}",
        lines.len()
    );
    faults.fail_all(None);
    shutdown.cancel();
    task.await.expect("member task").expect("left");
}

/// A drained member whose shard terms lapsed (its shard requests failed while its member
/// record lived on) starts no term of them again when its requests come back: it frees them,
/// and the member that should own them takes them.
#[tokio::test(start_paused = true)]
async fn a_drained_member_takes_no_shard_whose_term_lapsed() {
    let set = Set::new(4);
    let a = set.join("a", |b| b);
    let b = set.join("b", |b| b);
    until(Duration::from_secs(30), || balanced_members(&[&a, &b], 4))
        .await
        .expect("balanced");
    assert_eq!(a.owned().len(), 2);
    a.shard_faults.fail_all(Some(Fault::Unavailable));
    until(Duration::from_secs(30), || a.owned().is_empty())
        .await
        .expect("a's terms lapsed");
    let drained = Instant::now();
    assert!(
        !drain_member(&operator(&set), NAME, "a", true)
            .await
            .expect("drained")
    );
    // a reads the drain (the roster and the member records are not shard records).
    sleep(TIMINGS.retry_period * 4).await;
    a.shard_faults.fail_all(None);
    until(Duration::from_secs(30), || b.owned().len() == 4)
        .await
        .unwrap_or_else(|| panic!("b owns {:?}, a {:?}", b.owned(), a.owned()));
    sleep(TIMINGS.lease_duration * 3).await;
    assert_eq!(
        set.started_by("a", drained),
        Vec::<u32>::new(),
        "a drained member started terms"
    );
    assert!(a.owned().is_empty() && b.owned().len() == 4);
    for m in [a, b] {
        m.leave().await;
    }
    set.log.check("a drained member's lapsed shards");
}

/// The roster deleted while the set runs (by hand, or by a store that dropped it) is created
/// again as the members last read it: every member, the drain and the count; the drained
/// member stays drained.
#[tokio::test(start_paused = true)]
async fn a_roster_deleted_while_the_set_runs_comes_back_with_its_members_and_drains() {
    let set = Set::new(6);
    let members = ["a", "b", "c"].map(|id| set.join(id, |b| b));
    let [a, b, c] = &members;
    until(Duration::from_secs(30), || balanced_members(&[a, b, c], 6))
        .await
        .expect("balanced");
    drain_member(&operator(&set), NAME, "c", true)
        .await
        .expect("drained");
    until(Duration::from_secs(30), || {
        c.owned().is_empty() && balanced_members(&[a, b], 6)
    })
    .await
    .expect("c drained");
    let key = roster_key(NAME);
    set.store.delete(&key);
    sleep(TIMINGS.retry_period * 4).await;
    let roster = set
        .lock(&key, "operator")
        .get()
        .await
        .expect("read")
        .expect("the roster is back")
        .record;
    for id in ["a", "b", "c"] {
        let entry = format!("member.{}", member_key(NAME, id));
        assert_eq!(
            roster.extensions.get(&entry).map(String::as_str),
            Some(id),
            "{id} left out: {roster:?}"
        );
    }
    let drain = format!("drain.{}", member_key(NAME, "c"));
    assert_eq!(
        roster.extensions.get(&drain).map(String::as_str),
        Some("c"),
        "the drain was lost: {roster:?}"
    );
    assert_eq!(
        roster.extensions.get("shards.count").map(String::as_str),
        Some("6")
    );
    sleep(TIMINGS.lease_duration * 3).await;
    assert!(c.owned().is_empty(), "c took {:?}", c.owned());
    assert!(balanced_members(&[a, b], 6));
    for m in members {
        m.leave().await;
    }
    set.log.check("a roster deleted");
}

/// A shard reserved for `x` (a static member away), then taken by `x` and reserved for it
/// again, between two reads of a member: the second reservation is a new request, which the
/// member stands back from for a lease of its own, not for what was left of the first's.
#[tokio::test(start_paused = true)]
async fn a_second_reservation_of_one_member_gets_a_stand_back_of_its_own() {
    let set = Set::new(1);
    let shard = set.lock("jobs-shard-0", "x");
    let now = chrono::Utc::now();
    let reserved = |token| {
        let mut record = LeaderElectionRecord::new("", TIMINGS.lease_duration, now, token);
        record.preferred_holder = Some("x".to_owned());
        record
    };
    let first = shard.create(&reserved(1)).await.expect("created");
    let m = set.join("m", |b| b);
    // m stands back from the first reservation, seen at its first read.
    sleep(TIMINGS.lease_duration.mul_f64(0.8)).await;
    assert!(m.owned().is_empty(), "m took a shard reserved for x");
    // x comes back, takes its shard, and shuts down again: a new reservation.
    let held = shard
        .update(
            &first.version,
            &LeaderElectionRecord::new("x", TIMINGS.lease_duration, now, 2),
        )
        .await
        .expect("x took its shard");
    shard
        .update(&held.version, &reserved(2))
        .await
        .expect("reserved again");
    let took = until(TIMINGS.lease_duration * 3, || m.owned().contains(&0))
        .await
        .expect("m took the shard once x stayed away");
    assert!(
        took >= TIMINGS.lease_duration - TIMINGS.retry_period,
        "m took the shard {took:?} after its second reservation"
    );
    m.leave().await;
}

/// The most requests of `operation` in flight at once among `calls` sent at or after `since`.
fn most_at_once(calls: &[leader_core::faults::Call], operation: &str, since: Instant) -> usize {
    let mut events: Vec<(Instant, i32)> = Vec::new();
    for call in calls
        .iter()
        .filter(|c| c.operation == operation && c.sent >= since)
    {
        events.push((call.sent, 1));
        events.push((call.returned.unwrap_or(Instant::now()), -1));
    }
    // At one instant, answers before requests: a write that ends as another starts is not
    // two at once.
    events.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in events {
        now += step;
        most = most.max(now);
    }
    usize::try_from(most).unwrap_or(0)
}

/// A member that owns 240 shards and hands half of them to a newcomer stops their work at
/// once but writes the releases at most 32 at a time (each write slowed to 200 ms here, so
/// that they would all overlap if sent together): a join or a shrink at 10,000 shards is no
/// burst of thousands of writes.
#[tokio::test(start_paused = true)]
async fn a_handover_of_many_shards_writes_a_few_releases_at_a_time() {
    let set = Set::new(240);
    let a = set.join("a", |b| b);
    until(Duration::from_secs(30), || a.owned().len() == 240)
        .await
        .expect("a takes every shard");
    a.shard_faults.delay_requests(Duration::from_millis(200));
    let joined = Instant::now();
    let b = set.join("b", |b| b);
    until(Duration::from_secs(60), || balanced_members(&[&a, &b], 240))
        .await
        .expect("balanced after the join");
    let calls = a.shard_faults.calls();
    let releases = calls
        .iter()
        .filter(|c| c.operation == "update" && c.sent >= joined)
        .count();
    assert!(releases >= 100, "a released {releases} shards");
    let most = most_at_once(&calls, "update", joined);
    assert!(
        (2..=32).contains(&most),
        "{most} release writes at once (of {releases})"
    );
    for m in [a, b] {
        m.leave().await;
    }
    set.log.check("a handover of many shards");
}
