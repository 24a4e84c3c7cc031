//! A shard set's terms through trouble, on tokio's paused clock and the in-memory store: a
//! renewal batch that reached the store but timed out keeps its shards (the records are read
//! again before any is declared lost), and a shard whose work keeps ending is taken again after
//! a back-off that grows, not at once every time.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::backend::KeyedLocks;
use leader_core::faults::{Faults, FaultyLock};
use leader_core::{
    CancellationToken, MemoryStore, Shards, ShardsBuilder, ShardsError, ShardsState,
    StepDownReason, Timings,
};
use tokio::sync::watch;
use tokio::time::{Instant, sleep};

use common::until;

const TIMINGS: Timings = Timings {
    lease_duration: Duration::from_secs(10),
    renew_deadline: Duration::from_secs(8),
    retry_period: Duration::from_secs(1),
};

/// Member `identity` of set `jobs` whose requests on shard records go through `faults`.
fn locks(store: &MemoryStore, identity: &str, faults: &Faults) -> KeyedLocks {
    let (store, faults) = (store.clone(), faults.clone());
    KeyedLocks::new(identity, "memory", move |key, identity| {
        let lock = store.lock(key, identity);
        if key.starts_with("jobs-shard-") {
            Arc::new(FaultyLock::with_faults(lock, faults.clone()))
        } else {
            Arc::new(lock)
        }
    })
}

/// A renewal batch whose answers come after the request timeout (the store renewed every
/// record, the member never heard): the next round's renewals carry the versions from before and
/// conflict. The member reads the records again, finds them still its own with its terms'
/// tokens, and keeps every shard: no term ends, no token changes, no work restarts.
#[tokio::test(start_paused = true)]
async fn a_renewal_that_timed_out_after_reaching_the_store_keeps_the_shards() {
    const COUNT: u32 = 4;
    let store = MemoryStore::new();
    let faults = Faults::new();
    let Running {
        state,
        stopped,
        shutdown,
        task,
    } = run(&store, &faults, COUNT, |b| {
        b.request_timeout(Duration::from_secs(2))
    });
    assert!(
        until(Duration::from_secs(30), || state.borrow().tokens().len()
            == COUNT as usize)
        .await
        .is_some(),
        "a took every shard"
    );
    // Settled: a few rounds of plain renewals.
    sleep(TIMINGS.lease_duration).await;
    let tokens = state.borrow().tokens();
    let renewals_before = renewals(&faults);

    // One round's renewals reach the store and are answered after the request timeout.
    faults.delay_responses(Duration::from_secs(3));
    assert!(
        until(TIMINGS.retry_period * 2, || renewals(&faults)
            > renewals_before)
        .await
        .is_some(),
        "a round of renewals"
    );
    faults.delay_responses(Duration::ZERO);
    sleep(TIMINGS.lease_duration * 2).await;

    assert_eq!(
        *stopped.lock().unwrap(),
        Vec::new(),
        "terms ended after a renewal that timed out"
    );
    assert_eq!(state.borrow().tokens(), tokens, "the shards' terms changed");
    let late = faults
        .calls()
        .iter()
        .filter(|c| c.operation == "renew" && c.sent > Instant::now() - TIMINGS.lease_duration)
        .all(|c| c.ok == Some(true));
    assert!(late, "renewals still fail a lease later");
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// Member `a` of set `jobs`, running work that never ends on its shards.
struct Running {
    state: watch::Receiver<ShardsState>,
    /// Each shard whose term ended, with why, in order.
    stopped: Arc<Mutex<Vec<(u32, StepDownReason)>>>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), ShardsError>>,
}

/// Starts member `a` of set `jobs` of `count` shards with [`TIMINGS`], as `configure` sets it.
fn run(
    store: &MemoryStore,
    faults: &Faults,
    count: u32,
    configure: impl FnOnce(ShardsBuilder) -> ShardsBuilder,
) -> Running {
    let stopped = Arc::new(Mutex::new(Vec::new()));
    let builder = Shards::builder("jobs", count, locks(store, "a", faults))
        .timings(TIMINGS)
        .on_shard_stopped({
            let stopped = stopped.clone();
            move |shard, stop| stopped.lock().unwrap().push((shard, stop.reason))
        });
    let (state, shutdown, task) = common::spawn_member(configure(builder).build().unwrap());
    Running {
        state,
        stopped,
        shutdown,
        task,
    }
}

fn renewals(faults: &Faults) -> usize {
    faults
        .calls()
        .iter()
        .filter(|c| c.operation == "renew")
        .count()
}

/// A shard whose work returns at once (a COMMAND that crashes) is given up each time, and
/// taken again by the same member only after a back-off that doubles with each give-up that
/// follows a short term; once the work has run a long while, the next give-up waits the
/// shortest back-off again.
#[tokio::test(start_paused = true)]
async fn work_that_keeps_ending_is_taken_again_after_a_growing_back_off() {
    let store = MemoryStore::new();
    let starts = Arc::new(Mutex::new(Vec::new()));
    let run_for = Arc::new(Mutex::new(Duration::ZERO));
    let stopped = Arc::new(Mutex::new(Vec::new()));
    let shards = Shards::builder("jobs", 1, locks(&store, "a", &Faults::new()))
        .timings(TIMINGS)
        .on_shard_stopped({
            let stopped = stopped.clone();
            move |_, stop| stopped.lock().unwrap().push(stop.reason)
        })
        .build()
        .unwrap();
    let state: watch::Receiver<ShardsState> = shards.subscribe();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(shards.run_per_shard(shutdown.clone(), {
        let (starts, run_for) = (starts.clone(), run_for.clone());
        move |_, _| {
            starts.lock().unwrap().push(Instant::now());
            let run = *run_for.lock().unwrap();
            async move { sleep(run).await }
        }
    }));
    sleep(Duration::from_secs(60)).await;
    let crashing: Vec<Instant> = starts.lock().unwrap().clone();
    let gaps: Vec<Duration> = crashing.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        (4..=9).contains(&crashing.len()),
        "{} starts in a minute: {gaps:?}",
        crashing.len()
    );
    assert!(
        gaps.windows(2).all(|w| w[1] >= w[0]),
        "the waits do not grow: {gaps:?}"
    );
    assert!(
        gaps.last().is_some_and(|g| *g >= TIMINGS.retry_period * 8),
        "the waits do not grow: {gaps:?}"
    );
    assert!(
        stopped
            .lock()
            .unwrap()
            .iter()
            .all(|r| *r == StepDownReason::SteppedDown)
    );

    // The work now runs a long while before it ends: the back-off starts again.
    *run_for.lock().unwrap() = Duration::from_secs(3600);
    let count = crashing.len();
    assert!(
        until(Duration::from_secs(600), || starts.lock().unwrap().len()
            > count)
        .await
        .is_some(),
        "the shard was never taken again"
    );
    *run_for.lock().unwrap() = Duration::ZERO;
    let long = *starts.lock().unwrap().last().unwrap();
    assert!(
        until(Duration::from_secs(3700), || starts.lock().unwrap().len()
            > count + 1)
        .await
        .is_some(),
        "the shard was never taken again after its long run"
    );
    let again = starts.lock().unwrap()[count + 1];
    let wait = again - (long + Duration::from_secs(3600));
    assert!(
        wait <= TIMINGS.retry_period * 3,
        "a give-up after a long run waited {wait:?}"
    );
    drop(state);
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// S5: a shard's record deleted under its term (by hand, by a bucket's lifecycle rule, by a
/// cache's eviction) ends the term, and the member's next term on it takes a token above the
/// last one it saw, not 1 again; a shard it did not lose keeps its term.
#[tokio::test(start_paused = true)]
async fn a_deleted_shard_record_gives_out_no_token_seen_again() {
    let store = MemoryStore::new();
    let Running {
        state,
        stopped,
        shutdown,
        task,
    } = run(&store, &Faults::new(), 2, |b| b);
    assert!(
        until(Duration::from_secs(30), || state.borrow().tokens().len()
            == 2)
        .await
        .is_some(),
        "a took both shards"
    );
    let before = state.borrow().tokens();
    store.delete("jobs-shard-0");
    assert!(
        until(TIMINGS.lease_duration * 3, || !stopped
            .lock()
            .unwrap()
            .is_empty()
            && state.borrow().tokens().len() == 2)
        .await
        .is_some(),
        "shard 0's term did not end, or was not taken again"
    );
    let after = state.borrow().tokens();
    assert!(
        after[&0] > before[&0],
        "shard 0: token {} then {}",
        before[&0],
        after[&0]
    );
    assert_eq!(after[&1], before[&1], "shard 1's term changed");
    let ended: Vec<u32> = stopped.lock().unwrap().iter().map(|(s, _)| *s).collect();
    assert_eq!(ended, vec![0]);
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
