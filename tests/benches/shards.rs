//! Shard sets: what a member costs the store per round, the CPU of a set's members, and how
//! long a join and a leave take to rebalance.
//!
//! Per backend, in this process: `MEMBERS` members (default 10) of a set of `SHARDS` shards
//! (default 1,000), lease 3 s, renew deadline 2 s, retry period 500 ms. Measured: the time
//! from the start until every shard is owned and the members own within one of each other;
//! then, over `WINDOW_S` seconds (default 10) with nothing changing, the requests each member
//! sent per retry period (counted on the wire where the client counts them: etcd's requests
//! and keep-alive messages, the test Consul server's requests, object storage's requests;
//! on Postgres, MySQL, Redis and Kubernetes, at the member: a batched read, batch of renewals
//! or round of both as one request, an update per Lease on Kubernetes), and the CPU this
//! process used (all members
//! together); then a member joining, and one leaving (shut down, its shards
//! released), each until balanced again, and the spread (most owned less fewest) after it;
//! then the set resized to twice its shards while it runs (`resize_shard_set`), and back,
//! each until every shard of the new count is owned and the members within one of each other
//! (`RESIZE=0` leaves that out).
//!
//! ```text
//! cargo bench -p leader-tests --bench shards
//! SHARDS=10000 BENCH_BACKENDS=postgres,redis,etcd cargo bench -p leader-tests --bench shards
//! ```

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Backend, cpu_time, knob, ms};
use leader_core::backend::{Known, Renewal, RenewedAndRead, Reread};
use leader_core::faults::{Faults, FaultyLock};
use leader_core::{
    CancellationToken, LockError, LockSet, Observed, ResourceLock, Shards, ShardsState, async_trait,
};
use leader_test_support::{LEASE, RENEW, RETRY};
use tokio::sync::watch;

/// A member's records, its requests counted: a read or a round of renewals as one request
/// where the backend batches it, as one per record where it does not, and every request of a
/// record's own lock.
#[derive(Debug)]
struct Counting {
    inner: Box<dyn LockSet>,
    batched: Batched,
    batches: AtomicUsize,
    faults: Faults,
    locks: Mutex<HashMap<String, Arc<dyn ResourceLock>>>,
}

impl Counting {
    fn requests(&self) -> usize {
        self.batches.load(Ordering::Relaxed) + self.faults.calls().len()
    }

    fn batch(&self, batched: bool, records: usize) {
        let n = if batched { 1 } else { records };
        self.batches.fetch_add(n, Ordering::Relaxed);
    }
}

/// Which of a set's operations a backend does in one request whatever the number of records.
#[derive(Clone, Copy, Debug)]
struct Batched {
    reads: bool,
    renewals: bool,
    /// A round's renewals and read together.
    rounds: bool,
}

impl Batched {
    fn of(backend: &Backend) -> Self {
        match backend {
            // One statement, one script: each, and a round of both.
            Backend::Postgres(_) | Backend::Redis(_) => Self {
                reads: true,
                renewals: true,
                rounds: true,
            },
            // One statement each: a round is both, one after the other.
            Backend::Mysql(_) => Self {
                reads: true,
                renewals: true,
                rounds: false,
            },
            // One list of the namespace's Leases; an update per Lease.
            Backend::Kubernetes(..) => Self {
                reads: true,
                renewals: false,
                rounds: false,
            },
            // Counted on the wire (etcd, Consul, object storage), or a request per record.
            _ => Self {
                reads: false,
                renewals: false,
                rounds: false,
            },
        }
    }
}

#[async_trait]
impl LockSet for Counting {
    fn lock(&self, key: &str) -> Arc<dyn ResourceLock> {
        let mut locks = self.locks.lock().expect("locks");
        locks
            .entry(key.to_owned())
            .or_insert_with(|| {
                Arc::new(FaultyLock::with_faults(
                    self.inner.lock(key),
                    self.faults.clone(),
                ))
            })
            .clone()
    }
    fn identity(&self) -> &str {
        self.inner.identity()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    async fn get_many(&self, keys: &[String]) -> Vec<Result<Option<Observed>, LockError>> {
        self.batch(self.batched.reads, keys.len());
        self.inner.get_many(keys).await
    }
    async fn get_changed(
        &self,
        keys: &[String],
        known: &[Known<'_>],
    ) -> Vec<Result<Reread, LockError>> {
        self.batch(self.batched.reads, keys.len());
        self.inner.get_changed(keys, known).await
    }
    fn reads_show_expiry(&self) -> bool {
        self.inner.reads_show_expiry()
    }
    async fn renew_many(&self, renewals: &[Renewal]) -> Vec<Result<Observed, LockError>> {
        self.batch(self.batched.renewals, renewals.len());
        self.inner.renew_many(renewals).await
    }
    async fn renew_and_read(
        &self,
        renewals: &[Renewal],
        keys: &[String],
        known: &[Known<'_>],
    ) -> RenewedAndRead {
        if self.batched.rounds {
            self.batch(true, 1);
            return self.inner.renew_and_read(renewals, keys, known).await;
        }
        // As the backend does it: the renewals, then the read, each counted.
        let renewed = self.renew_many(renewals).await;
        let read = self.get_changed(keys, known).await;
        RenewedAndRead { renewed, read }
    }
}

struct Member {
    counting: Arc<Counting>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    state: watch::Receiver<ShardsState>,
}

/// How many shard terms ended, by reason, over all members: a set that does not settle shows
/// why (terms lost to others, or ended by their deadline) on the benchmark's standard error.
type Ends = Arc<Mutex<std::collections::BTreeMap<String, usize>>>;

fn join(backend: &Arc<Backend>, name: &str, count: u32, identity: &str, ends: &Ends) -> Member {
    let counting = Arc::new(Counting {
        inner: backend.lock_set(name, identity),
        batched: Batched::of(backend),
        batches: AtomicUsize::new(0),
        faults: Faults::new(),
        locks: Mutex::default(),
    });
    let shards = Shards::builder(name, count, counting.clone())
        .lease_duration(LEASE)
        .renew_deadline(RENEW)
        .retry_period(RETRY)
        .on_shard_stopped({
            let ends = ends.clone();
            move |_, stop| {
                let mut ends = ends
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                *ends.entry(format!("{:?}", stop.reason)).or_default() += 1;
            }
        })
        .build()
        .expect("valid shard set");
    let (shutdown, task, state) = common::run_member(shards, |_, _| std::future::pending::<()>());
    Member {
        counting,
        shutdown,
        task,
        state,
    }
}

async fn until_balanced(members: &[Member], count: u32, within: Duration) -> Option<Duration> {
    let states: Vec<_> = members.iter().map(|m| &m.state).collect();
    common::until_balanced(&states, count, within).await
}

/// How many shards each member owns.
fn owned(members: &[Member]) -> Vec<usize> {
    members
        .iter()
        .map(|m| m.state.borrow().tokens().len())
        .collect()
}

fn spread(members: &[Member]) -> usize {
    let owned = owned(members);
    owned.iter().max().unwrap_or(&0) - owned.iter().min().unwrap_or(&0)
}

fn took(d: Option<Duration>) -> String {
    d.map_or_else(|| "not within 120 s".into(), ms)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let count: u32 = knob("SHARDS", 1000);
    let members: usize = knob("MEMBERS", 10);
    let window = Duration::from_secs(knob("WINDOW_S", 10));
    println!(
        "{count} shards over {members} members in one process (lease {}, retry period {}):\n",
        ms(LEASE),
        ms(RETRY)
    );
    println!(
        "| backend | balanced after start | requests per member per retry period | CPU (cores, all members) | rebalanced after a join | after a leave | spread after | balanced after a resize to twice the shards | and back |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let within = Duration::from_secs(120);
    for backend in Backend::available().await {
        // A session per record: shard sets refuse them (`leader run --shards` says so).
        if matches!(
            backend,
            Backend::PostgresAdvisory(_) | Backend::MysqlNamed(_)
        ) {
            continue;
        }
        let backend = Arc::new(backend);
        let name = format!("shards-bench-{:08x}", fastrand::u32(..));
        let ends = Ends::default();
        let mut set: Vec<Member> = (0..members)
            .map(|i| join(&backend, &name, count, &format!("m{i}"), &ends))
            .collect();
        let started = until_balanced(&set, count, within).await;
        // A round for the set to settle, then the steady window.
        tokio::time::sleep(RETRY * 2).await;
        let sent = |set: &[Member]| {
            backend
                .wire_requests()
                .unwrap_or_else(|| set.iter().map(|m| m.counting.requests()).sum::<usize>())
        };
        let (requests, cpu, clock) = (sent(&set), cpu_time(), Instant::now());
        tokio::time::sleep(window).await;
        let (cpu, elapsed) = (cpu_time() - cpu, clock.elapsed());
        let requests = sent(&set) - requests;
        let rounds = elapsed.as_secs_f64() / RETRY.as_secs_f64();
        let per_member = format!("{:.2}", requests as f64 / members as f64 / rounds);
        let cores = cpu.as_secs_f64() / elapsed.as_secs_f64();
        let ended = |what: &str, set: &[Member]| {
            eprintln!(
                "{}: {what}: owned {:?}, terms ended so far {:?}",
                backend.name(),
                owned(set),
                ends.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
            );
        };
        ended("start", &set);
        set.push(join(&backend, &name, count, &format!("m{members}"), &ends));
        let joined = until_balanced(&set, count, within).await;
        ended("join", &set);
        let leaving = set.remove(0);
        leaving.shutdown.cancel();
        let _ = leaving.task.await;
        let left = until_balanced(&set, count, within).await;
        ended("leave", &set);
        let spread_after = spread(&set);
        // Resized while running: doubled, then back.
        let operator = backend.lock_set(&name, "bench-operator");
        let resizes = if knob("RESIZE", 1) == 0 {
            Vec::new()
        } else {
            vec![count * 2, count]
        };
        let mut resized = Vec::new();
        for to in resizes {
            leader_core::resize_shard_set(&*operator, &name, to)
                .await
                .expect("resized");
            resized.push(until_balanced(&set, to, within).await);
            ended(&format!("resize to {to}"), &set);
        }
        println!(
            "| {} | {} | {per_member} | {cores:.3} | {} | {} | {spread_after} | {} | {} |",
            backend.name(),
            took(started),
            took(joined),
            took(left),
            resized.first().map_or_else(|| "-".to_owned(), |&d| took(d)),
            resized.get(1).map_or_else(|| "-".to_owned(), |&d| took(d)),
        );
        for member in set {
            member.shutdown.cancel();
            let _ = member.task.await;
        }
    }
}
