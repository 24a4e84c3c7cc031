//! The runner's rounds on tokio's paused clock, request by request.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::sleep;
use tokio_util::sync::CancellationToken;

use super::super::{KeyedLocks, Known, LockSet, Renewal, RenewedAndRead, Shards};
use crate::config::Timings;
use crate::error::LockError;
use crate::leadership::StepDownReason;
use crate::lock::ResourceLock;
use crate::memory::MemoryStore;
use crate::record::Observed;

const TIMINGS: Timings = Timings {
    lease_duration: Duration::from_secs(10),
    renew_deadline: Duration::from_secs(8),
    retry_period: Duration::from_secs(1),
};

/// A member's records, with the number of keys of each read, and a 0 for each batch of
/// renewals sent alone (not with a read).
#[derive(Debug)]
struct Reads {
    inner: KeyedLocks,
    sizes: Arc<Mutex<Vec<usize>>>,
}

#[async_trait]
impl LockSet for Reads {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        self.inner.lock(key)
    }
    fn identity(&self) -> &str {
        self.inner.identity()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        self.sizes.lock().unwrap().push(keys.len());
        self.inner.get_many(keys).await
    }
    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        self.sizes.lock().unwrap().push(0);
        self.inner.renew_many(renewals).await
    }
    async fn renew_and_read(
        &self,
        renewals: &[Renewal],
        keys: &[String],
        known: &[Known<'_>],
    ) -> RenewedAndRead {
        self.sizes.lock().unwrap().push(keys.len());
        self.inner.renew_and_read(renewals, keys, known).await
    }
}

/// Once balanced, a member reads every shard once per half a lease, and otherwise the
/// roster and the members alone, with its renewals in the same request (its renewals go
/// alone before a full read); a round that changes nothing publishes nothing. Then a join is seen by the members' read, and the
/// shards are read again at once.
#[tokio::test(start_paused = true)]
async fn a_settled_member_reads_the_shards_only_now_and_then() {
    const COUNT: u32 = 30;
    let store = MemoryStore::new();
    let shutdown = CancellationToken::new();
    let join = |identity: &str| {
        let store = store.clone();
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let locks = Reads {
            inner: KeyedLocks::new(identity, "memory", move |key, identity| {
                Arc::new(store.lock(key, identity))
            }),
            sizes: sizes.clone(),
        };
        let shards = Shards::builder("jobs", COUNT, locks)
            .timings(TIMINGS)
            .build()
            .unwrap();
        let state = shards.subscribe();
        let task = tokio::spawn(
            shards.run_per_shard(shutdown.clone(), |_, _| std::future::pending::<()>()),
        );
        (sizes, state, task)
    };
    let (sizes, mut state, first) = join("a");
    let others = [join("b"), join("c")];
    let mut waited = Duration::ZERO;
    while state.borrow().owned.len() != 10
        || others.iter().any(|(_, s, _)| s.borrow().owned.len() != 10)
    {
        assert!(waited < Duration::from_secs(120), "not balanced");
        sleep(TIMINGS.retry_period).await;
        waited += TIMINGS.retry_period;
    }
    sleep(TIMINGS.lease_duration).await;
    state.mark_unchanged();
    sizes.lock().unwrap().clear();
    // Twenty rounds with nothing changing.
    sleep(TIMINGS.retry_period * 20).await;
    let mut reads = std::mem::take(&mut *sizes.lock().unwrap());
    let alone = reads.iter().filter(|&&n| n == 0).count();
    reads.retain(|&n| n > 0);
    assert!(
        (19..=21).contains(&reads.len()),
        "a read a round: {reads:?}"
    );
    let full = reads.iter().filter(|&&n| n > COUNT as usize).count();
    assert_eq!(
        alone, full,
        "renewals sent apart from a read of the members: {reads:?}"
    );
    let light = reads.iter().filter(|&&n| n == 4).count();
    assert_eq!(full + light, reads.len(), "{reads:?}");
    assert!(
        (3..=5).contains(&full),
        "a full read per half a lease: {reads:?}"
    );
    assert!(light >= 14, "{reads:?}");
    assert!(
        !state.has_changed().unwrap(),
        "a round that changed nothing published"
    );

    // A newcomer: every member reads the shards again, and the set balances.
    let newcomer = join("d");
    let mut waited = Duration::ZERO;
    while [&state, &others[0].1, &others[1].1, &newcomer.1]
        .iter()
        .map(|s| s.borrow().owned.len())
        .any(|n| !(7..=8).contains(&n))
    {
        assert!(
            waited <= TIMINGS.lease_duration + TIMINGS.retry_period * 2,
            "not balanced after a join"
        );
        sleep(TIMINGS.retry_period).await;
        waited += TIMINGS.retry_period;
    }
    assert!(state.has_changed().unwrap());
    shutdown.cancel();
    for task in [first, newcomer.2] {
        task.await.unwrap().unwrap();
    }
    for (_, _, task) in others {
        task.await.unwrap().unwrap();
    }
}

/// A member whose releases take longer than a lease (its shards' work is slow to stop)
/// gives its surplus away once: the shards it is releasing, though their records still name
/// it, are not counted as its own again, nor taken back once their lease runs out (while
/// their work still runs), nor given twice.
#[tokio::test(start_paused = true)]
async fn slow_releases_give_the_surplus_away_once() {
    const COUNT: u32 = 20;
    let store = MemoryStore::new();
    let shutdown = CancellationToken::new();
    let handed = Arc::new(Mutex::new(Vec::new()));
    let slow_stop = Arc::new(Mutex::new(Duration::ZERO));
    let join = |identity: &str, slow_stop: Arc<Mutex<Duration>>| {
        let store = store.clone();
        let locks = KeyedLocks::new(identity, "memory", move |key, identity| {
            // On the store's clock, as on Postgres: a record that names this member is
            // waited out by the store's clock, as any holder's (S13).
            Arc::new(store.lock(key, identity).with_store_clock(true))
        });
        let handed = handed.clone();
        let shards = Shards::builder("jobs", COUNT, locks)
            .timings(TIMINGS)
            .stop_grace(TIMINGS.lease_duration * 2)
            .on_shard_started(move |_, term| {
                // The work's last part stops `slow_stop` after its term ends.
                let slow_stop = slow_stop.clone();
                tokio::spawn(async move {
                    term.lost().await;
                    let wait = *slow_stop.lock().unwrap();
                    sleep(wait).await;
                    drop(term);
                });
            })
            .on_shard_stopped(move |shard, stop| {
                if stop.reason == StepDownReason::HandedOver {
                    handed.lock().unwrap().push(shard);
                }
            })
            .build()
            .unwrap();
        let state = shards.subscribe();
        let task = tokio::spawn(
            shards.run_per_shard(shutdown.clone(), |_, _| std::future::pending::<()>()),
        );
        (state, task)
    };
    let (a, first) = join("a", slow_stop.clone());
    let mut waited = Duration::ZERO;
    while a.borrow().owned.len() != COUNT as usize {
        assert!(
            waited < Duration::from_secs(60),
            "a alone took not every shard"
        );
        sleep(TIMINGS.retry_period).await;
        waited += TIMINGS.retry_period;
    }
    // Each of a's releases now waits a lease and three rounds for its work to stop.
    *slow_stop.lock().unwrap() = TIMINGS.lease_duration + TIMINGS.retry_period * 3;
    let (b, second) = join("b", Arc::default());
    let mut waited = Duration::ZERO;
    while a.borrow().owned.len() != 10 || b.borrow().owned.len() != 10 {
        assert!(
            waited < TIMINGS.lease_duration * 3,
            "not balanced: a {}, b {}",
            a.borrow().owned.len(),
            b.borrow().owned.len()
        );
        sleep(TIMINGS.retry_period).await;
        waited += TIMINGS.retry_period;
    }
    sleep(TIMINGS.lease_duration).await;
    assert_eq!(
        handed.lock().unwrap().len(),
        10,
        "{:?}",
        handed.lock().unwrap()
    );
    assert_eq!((a.borrow().owned.len(), b.borrow().owned.len()), (10, 10));
    *slow_stop.lock().unwrap() = Duration::ZERO;
    shutdown.cancel();
    first.await.unwrap().unwrap();
    second.await.unwrap().unwrap();
}
