//! Shard sets in a rolling restart: how many shards move, and how long the restart takes.
//!
//! Per backend, in this process: `MEMBERS` members (default 10) of a set of `SHARDS` shards
//! (default 1,000), lease 3 s, renew deadline 2 s, retry period 500 ms. Once the set is
//! balanced, each member in turn is shut down (its shards released), started again under its
//! identity `RESTART_MS` later (default 1,000: within the lease), and the set left to balance
//! again before the next; once without static membership and once with it. Measured: the
//! moves (a shard's term starting on another member than its last), the most moves of one
//! shard, and the time from the first shutdown until the set is balanced after the last start.
//! `CRASH=1` crashes each member instead (its task aborted: nothing released); `WINDOW_MS`
//! sets the static membership window (default: the lease).
//!
//! ```text
//! BENCH_BACKENDS=postgres,redis cargo bench -p leader-tests --bench restarts
//! CRASH=1 RESTART_MS=5000 WINDOW_MS=10000 cargo bench -p leader-tests --bench restarts
//! ```

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Backend, knob, ms};
use leader_core::conformance::ShardLog;
use leader_core::{CancellationToken, Shards, ShardsState};
use leader_test_support::{LEASE, RENEW, RETRY};
use tokio::sync::watch;
use tokio::task::JoinHandle;

struct Member {
    shutdown: CancellationToken,
    task: JoinHandle<()>,
    state: watch::Receiver<ShardsState>,
}

struct Set {
    backend: Arc<Backend>,
    name: String,
    count: u32,
    static_membership: bool,
    /// The static membership window, when not the lease.
    window: Option<Duration>,
    /// Each shard's terms, by member.
    log: ShardLog,
}

impl Set {
    fn join(&self, identity: &str) -> Member {
        let shards = Shards::builder(
            self.name.as_str(),
            self.count,
            self.backend.lock_set(&self.name, identity),
        )
        .lease_duration(LEASE)
        .renew_deadline(RENEW)
        .retry_period(RETRY)
        .static_membership(self.static_membership);
        let shards = match self.window.filter(|_| self.static_membership) {
            Some(window) => shards.static_membership_window(window),
            None => shards,
        }
        .build()
        .expect("valid shard set");
        let (shutdown, task, state) = common::run_member(shards, self.log.work(identity));
        Member {
            shutdown,
            task,
            state,
        }
    }

    /// The moves since `since` (each shard's moves then, [`ShardLog::moves_by_shard`]), and
    /// the most of one shard.
    fn moves(&self, since: &BTreeMap<u32, usize>) -> (usize, usize) {
        let per_shard: Vec<usize> = self
            .log
            .moves_by_shard()
            .into_iter()
            .map(|(shard, moves)| moves - since.get(&shard).copied().unwrap_or(0))
            .collect();
        (
            per_shard.iter().sum(),
            per_shard.into_iter().max().unwrap_or(0),
        )
    }
}

async fn until_balanced(members: &[Member], count: u32, within: Duration) -> Option<Duration> {
    let states: Vec<_> = members.iter().map(|m| &m.state).collect();
    common::until_balanced(&states, count, within).await
}

/// One rolling restart: `(moves, most moves of one shard, duration)`, or `None` when the set
/// did not balance within two minutes of a step.
async fn rolling_restart(
    set: &Set,
    members: usize,
    pause: Duration,
    crash: bool,
) -> Option<(usize, usize, Duration)> {
    let within = Duration::from_secs(120);
    let identities: Vec<String> = (0..members).map(|i| format!("m{i}")).collect();
    let mut running: Vec<Member> = identities.iter().map(|id| set.join(id)).collect();
    until_balanced(&running, set.count, within).await?;
    tokio::time::sleep(RETRY * 2).await;
    let before = set.log.moves_by_shard();
    let started = Instant::now();
    for (i, identity) in identities.iter().enumerate() {
        let old = running.remove(i);
        if crash {
            old.task.abort();
        } else {
            old.shutdown.cancel();
        }
        let _ = old.task.await;
        tokio::time::sleep(pause).await;
        running.insert(i, set.join(identity));
        until_balanced(&running, set.count, within).await?;
    }
    let took = started.elapsed();
    // The set as it stands once balanced, for a round, so that late moves are counted too.
    tokio::time::sleep(RETRY * 2).await;
    let (moves, most) = set.moves(&before);
    for member in running {
        member.shutdown.cancel();
        let _ = member.task.await;
    }
    Some((moves, most, took))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let count: u32 = knob("SHARDS", 1000);
    let members: usize = knob("MEMBERS", 10);
    let pause = Duration::from_millis(knob("RESTART_MS", 1000));
    let crash = knob("CRASH", 0) != 0;
    let window = Some(Duration::from_millis(knob("WINDOW_MS", 0))).filter(|w| !w.is_zero());
    println!(
        "A rolling restart of {members} members of a set of {count} shards in one process, each started again {} after its {} (lease {}, retry period {}, static membership window {}):\n",
        ms(pause),
        if crash { "crash" } else { "shutdown" },
        ms(LEASE),
        ms(RETRY),
        window.map_or_else(|| "the lease".to_owned(), ms),
    );
    println!(
        "| backend | static membership | shard moves | most moves of one shard | rolling restart took |"
    );
    println!("|---|---|---|---|---|");
    for backend in Backend::available().await {
        let backend = Arc::new(backend);
        // A session per record: shard sets refuse them.
        if matches!(
            *backend,
            Backend::PostgresAdvisory(_) | Backend::MysqlNamed(_)
        ) {
            continue;
        }
        for static_membership in [false, true] {
            let set = Set {
                backend: backend.clone(),
                name: format!("restarts-bench-{:08x}", fastrand::u32(..)),
                count,
                static_membership,
                window,
                log: ShardLog::default(),
            };
            let row = match rolling_restart(&set, members, pause, crash).await {
                Some((moves, most, took)) => format!("{moves} | {most} | {}", ms(took)),
                None => "not balanced within 120 s | | ".into(),
            };
            println!(
                "| {} | {} | {row} |",
                backend.name(),
                if static_membership { "on" } else { "off" }
            );
        }
    }
}
