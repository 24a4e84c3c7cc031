//! The view of a whole shard set, read by a process that takes no part in it: the count, the
//! members, each shard's owner and token as the members themselves hold them, and the shards
//! nobody owns once a member dies (on tokio's paused clock, the memory store).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use leader_core::backend::KeyedLocks;
use leader_core::{
    CancellationToken, MemoryStore, RecordState, ResourceLock, ShardSetView, ShardSetViewError,
    Shards, ShardsError, ShardsState, Timings, WallClock,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

const TIMINGS: Timings = Timings {
    lease_duration: Duration::from_secs(3),
    renew_deadline: Duration::from_secs(2),
    retry_period: Duration::from_millis(500),
};
const COUNT: u32 = 6;
const NAME: &str = "jobs";

struct Member {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), ShardsError>>,
    state: watch::Receiver<ShardsState>,
}

impl Member {
    fn tokens(&self) -> BTreeMap<u32, u64> {
        self.state.borrow().tokens()
    }
}

fn locks(store: &MemoryStore, identity: &str) -> KeyedLocks {
    let store = store.clone();
    KeyedLocks::new(identity, "memory", move |key, identity| {
        Arc::new(store.lock(key, identity))
    })
}

fn join(store: &MemoryStore, identity: &str) -> Member {
    let shards = Shards::builder(NAME, COUNT, locks(store, identity))
        .timings(TIMINGS)
        .build()
        .expect("valid configuration");
    let (state, shutdown, task) = common::spawn_member(shards);
    Member {
        shutdown,
        task,
        state,
    }
}

/// Every shard owned, two by each member.
async fn balanced(members: &[&Member]) {
    let start = Instant::now();
    while !members.iter().all(|m| m.tokens().len() == 2) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "never balanced: {:?}",
            members.iter().map(|m| m.tokens()).collect::<Vec<_>>()
        );
        sleep(TIMINGS.retry_period).await;
    }
}

async fn view(reader: &KeyedLocks) -> ShardSetView {
    ShardSetView::read(reader, NAME)
        .await
        .expect("the roster reads")
        .expect("a roster")
}

/// The shards and tokens the view shows `identity` owning.
fn owned_in(view: &ShardSetView, identity: &str) -> BTreeMap<u32, u64> {
    view.shards
        .iter()
        .filter(|s| s.record.owner() == Some(identity))
        .map(|s| (s.shard, s.record.fencing_token.expect("a token")))
        .collect()
}

/// Three members of a set of six shards: the view names the three, alive, and each shard's
/// owner with the fencing token its owner holds. Once a member crashed and the others took its
/// shards after their lease, the view shows them with the new owners and greater tokens.
#[tokio::test]
async fn the_view_shows_owners_and_tokens_as_members_hold_them() {
    tokio::time::pause();
    let store = MemoryStore::new();
    let reader = locks(&store, "status");
    assert!(
        ShardSetView::read(&reader, NAME)
            .await
            .expect("reads")
            .is_none(),
        "a set nobody ran"
    );
    let (a, b, c) = (join(&store, "a"), join(&store, "b"), join(&store, "c"));
    balanced(&[&a, &b, &c]).await;

    let seen = view(&reader).await;
    assert_eq!(seen.name, NAME);
    assert_eq!(seen.count, COUNT);
    assert_eq!(seen.shards.len(), COUNT as usize);
    assert!(seen.unowned.is_empty(), "unowned: {:?}", seen.unowned);
    let identities: Vec<&str> = seen.members.iter().map(|m| m.identity.as_str()).collect();
    assert_eq!(identities, ["a", "b", "c"]);
    for (identity, member) in [("a", &a), ("b", &b), ("c", &c)] {
        let shown = seen.member(identity).expect("a member");
        assert!(shown.alive, "{identity} not alive: {shown:?}");
        assert_eq!(shown.static_membership_window, None, "not static");
        assert_eq!(shown.record.state, RecordState::Held);
        assert!(shown.record.renew_time.is_some());
        assert_eq!(owned_in(&seen, identity), member.tokens(), "{identity}");
        assert_eq!(
            shown.shards,
            member.tokens().into_keys().collect::<Vec<_>>(),
            "{identity}"
        );
    }
    for shard in &seen.shards {
        assert!(shard.record.acquire_time.is_some(), "{shard:?}");
        assert_eq!(
            shard.record.key,
            leader_core::backend::shard_key(NAME, shard.shard)
        );
    }

    // A crash: the process is gone, its records stay as they were.
    let crashed = c.tokens();
    c.task.abort();
    let seen = view(&reader).await;
    assert_eq!(owned_in(&seen, "c"), crashed, "before its leases ran out");
    let start = Instant::now();
    while a.tokens().len() + b.tokens().len() < COUNT as usize {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "c's shards never taken"
        );
        sleep(TIMINGS.retry_period).await;
    }
    let seen = view(&reader).await;
    assert!(seen.unowned.is_empty(), "unowned: {:?}", seen.unowned);
    assert!(owned_in(&seen, "c").is_empty());
    assert_eq!(owned_in(&seen, "a"), a.tokens());
    assert_eq!(owned_in(&seen, "b"), b.tokens());
    for (shard, token) in crashed {
        let now = seen.shard(shard).expect("a shard");
        assert!(
            now.record.fencing_token > Some(token),
            "shard {shard}: token {:?} after {token}",
            now.record.fencing_token
        );
    }
    for member in [a, b] {
        member.shutdown.cancel();
        member.task.await.expect("task").expect("ran");
    }
}

/// A member dies while the others leave: the others' shards show free at once, the dead
/// member's still its own until their lease runs out, then expired: every shard unowned, the
/// dead member not alive, its shards still naming it with their tokens.
#[tokio::test]
async fn a_dead_members_shards_show_unowned_once_their_lease_ran_out() {
    tokio::time::pause();
    let store = MemoryStore::new();
    let reader = locks(&store, "status");
    let (a, b, c) = (join(&store, "a"), join(&store, "b"), join(&store, "c"));
    balanced(&[&a, &b, &c]).await;
    let dead = c.tokens();
    c.task.abort();
    let left: Vec<u32> = a
        .tokens()
        .into_keys()
        .chain(b.tokens().into_keys())
        .collect();
    for member in [a, b] {
        member.shutdown.cancel();
        member.task.await.expect("task").expect("ran");
    }

    let seen = view(&reader).await;
    assert_eq!(owned_in(&seen, "c"), dead);
    let mut unowned = left.clone();
    unowned.sort_unstable();
    assert_eq!(seen.unowned, unowned);
    for shard in &left {
        let shown = seen.shard(*shard).expect("a shard");
        assert_eq!(shown.record.state, RecordState::Free, "{shown:?}");
        assert!(shown.record.fencing_token.is_some_and(|t| t > 0));
    }
    let members: Vec<&str> = seen.members.iter().map(|m| m.identity.as_str()).collect();
    assert_eq!(members, ["c"], "a and b left the roster");
    assert!(seen.member("c").expect("c").alive);

    // Read as of a wall clock past the dead member's lease.
    let (clock, step) = WallClock::stepped();
    step.step(chrono::TimeDelta::seconds(10));
    let seen = ShardSetView::read_with_clock(&reader, NAME, &clock)
        .await
        .expect("reads")
        .expect("a roster");
    assert_eq!(seen.unowned, (0..COUNT).collect::<Vec<_>>());
    let c = seen.member("c").expect("c");
    assert!(!c.alive);
    assert_eq!(c.record.state, RecordState::Expired);
    assert!(c.shards.is_empty());
    for (shard, token) in dead {
        let shown = seen.shard(shard).expect("a shard");
        assert_eq!(shown.record.state, RecordState::Expired);
        assert_eq!(shown.record.holder.as_deref(), Some("c"));
        assert_eq!(shown.record.fencing_token, Some(token));
    }
}

/// A roster whose count is not a number is an error naming it, not a panic; a shard record
/// that is not a record is shown unreadable, and the rest of the view stands.
#[tokio::test]
async fn bad_records_are_shown_or_named() {
    tokio::time::pause();
    let store = MemoryStore::new();
    let reader = locks(&store, "status");
    let a = join(&store, "a");
    let start = Instant::now();
    while a.tokens().len() < COUNT as usize {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "a never took all"
        );
        sleep(TIMINGS.retry_period).await;
    }
    store.corrupt(&leader_core::backend::shard_key(NAME, 2), "not a record");
    let seen = view(&reader).await;
    let bad = seen.shard(2).expect("shard 2");
    assert_eq!(bad.record.state, RecordState::Unreadable);
    assert!(bad.record.error.is_some());
    assert_eq!(seen.unowned, [2]);
    assert_eq!(owned_in(&seen, "a").len(), COUNT as usize - 1);
    a.task.abort();

    let roster = store.lock(leader_core::backend::roster_key(NAME), "operator");
    let mut current = roster.get().await.expect("reads").expect("a roster");
    current
        .record
        .extensions
        .insert(leader_core::COUNT_EXTENSION.into(), "many".into());
    roster
        .update(&current.version, &current.record)
        .await
        .expect("written");
    match ShardSetView::read(&reader, NAME).await {
        Err(ShardSetViewError::InvalidRoster(ShardsError::InvalidRoster { value, .. })) => {
            assert_eq!(value.as_deref(), Some("many"));
        }
        other => panic!("a roster with no count: {other:?}"),
    }
    store.corrupt(&leader_core::backend::roster_key(NAME), "not a record");
    match ShardSetView::read(&reader, NAME).await {
        Err(ShardSetViewError::Roster { roster, .. }) => {
            assert_eq!(roster, leader_core::backend::roster_key(NAME));
        }
        other => panic!("an unreadable roster: {other:?}"),
    }
}
