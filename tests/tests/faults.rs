//! Faults across backends: three replicas of `leader run -- fenced-writer` on the file lock and,
//! through a TCP proxy each, on private Postgres (table and advisory locks), MariaDB, NATS,
//! ZooKeeper, Redis, etcd, Kubernetes API and Consul servers (the last two the test support's)
//! and moto's S3 and DynamoDB server;
//! into whichever replica leads: SIGKILL, SIGSTOP past the lease then
//! SIGCONT, its network cut (a partition of the leader alone), a latency spike beyond the renew
//! deadline; into the server: crashed and restarted, frozen with SIGSTOP, every connection
//! refused (a full outage, during which the replicas' failed attempts are counted). On
//! Kubernetes also a mixed fleet: two of our replicas beside two kubert claimants (another
//! project's Lease client, writing with PATCH), faults into whichever leads. The checker asserts
//! that no two terms overlapped (`CLOCK_MONOTONIC` intervals), that fencing tokens grew, that
//! the fenced sink accepted no stale write (and refused the frozen leaders' ones), that a leader
//! was back within the bound after every fault, and that no replica retried faster than S9
//! allows during an outage.
//!
//! On a three-member etcd cluster (its own, on loopback) also faults of one member (killed and
//! restarted, frozen, cut off from the replicas), each of which must cost the leader nothing:
//! the report counts leaderships lost to a member's fault. And on every backend the schedule
//! workload (`leader cron`, see `harness::firings`): every scheduled instant started, none
//! twice, no two firings of a term side by side under forbid and replace, no stale write
//! accepted, under faults into the leader and the server, with configuration changes (schedule
//! and overlap policy) rolled out under it and replicas whose clocks disagree.
//! And the shard workload on every backend but the advisory lock (`leader run --shards 4
//! --static-membership`, see `harness::shards`): per shard, no two terms at once, tokens that
//! grow, no stale write accepted, under faults into each replica in turn and into the server,
//! with rolling restarts and resizes of the running set beside them.
//!
//! By default one round (each fault once per backend), in order. Knobs for the long run:
//! - `FAULT_ROUNDS=N`: N rounds, or `FAULT_COUNT=N`: N faults per backend (the kinds in turn);
//! - `FAULT_KINDS=K1,K2`: only these kinds, named as in the table (`sigkill`, `network cut`);
//! - `FAULT_SEED=S`: shuffle the schedule with seed S (a random seed when `FAULT_SHUFFLE=1`);
//!   the seed is printed, so a failing schedule can be replayed;
//! - `FAULT_LEASE_MS=L`: a shorter lease (renew deadline 3/4 of it, retry period 1/8; the
//!   mixed fleet keeps whole seconds, as kubert needs);
//! - `FAULT_OUTAGE_MS=O`: how long a full outage lasts (default three leases);
//! - `FAULT_PARALLEL=1`: backends at the same time instead of one after the other.
//! - `FAULT_CHANGE_EVERY=N`: the schedule workload rolls out a new configuration revision after
//!   every Nth fault (default 50, or every quarter of a shorter run).
//!
//! For example `FAULT_COUNT=1000 FAULT_SHUFFLE=1 FAULT_LEASE_MS=800 cargo test -p leader-tests
//! --release --test faults -- --nocapture`. A run says every violation as it happens and its
//! progress every 100 faults, and prints a summary table at the end. Needs the Postgres
//! of `DATABASE_URL` for the sink, and Debian's PostgreSQL, MariaDB, `nats-server`, `zookeeperd`,
//! `redis-server` and `etcd` for the private servers (`scripts/setup` installs them).

use std::sync::Mutex;
use std::time::Duration;

use leader_test_support::bench::knob_if_set as knob;
use leader_tests::database_url;
use leader_tests::harness::campaign::{self, Backend, Fault, Report, Settings};
use leader_tests::harness::run_or_skip;
use leader_tests::on_each_harness_backend;

/// The faults to inject into `backend`, in order: `FAULT_COUNT` faults (or `FAULT_ROUNDS`
/// rounds) of its kinds in turn, shuffled with `FAULT_SEED` (or a random seed with
/// `FAULT_SHUFFLE=1`).
fn schedule(backend: Backend) -> (Vec<Fault>, Option<u64>) {
    // `FAULT_KINDS=sigkill,latency spike`: only these kinds (names as in the table).
    let only = std::env::var("FAULT_KINDS").ok();
    let kinds: Vec<Fault> = backend
        .faults()
        .iter()
        .copied()
        .filter(|f| {
            only.as_deref()
                .is_none_or(|only| only.split(',').any(|k| k.trim() == f.name()))
        })
        .collect();
    let count = knob::<usize>("FAULT_COUNT")
        .unwrap_or_else(|| knob::<usize>("FAULT_ROUNDS").unwrap_or(1) * kinds.len());
    let mut faults: Vec<Fault> = kinds.iter().copied().cycle().take(count).collect();
    let seed = knob::<u64>("FAULT_SEED").or_else(|| {
        std::env::var("FAULT_SHUFFLE")
            .is_ok_and(|v| v == "1")
            .then(|| fastrand::u64(..))
    });
    if let Some(seed) = seed {
        fastrand::Rng::with_seed(seed).shuffle(&mut faults);
    }
    (faults, seed)
}

/// `Settings` with `FAULT_LEASE_MS` and `FAULT_OUTAGE_MS` applied.
fn settings() -> Settings {
    let mut settings = Settings::default();
    if let Some(lease) = knob::<u64>("FAULT_LEASE_MS") {
        settings.lease = Duration::from_millis(lease);
        settings.renew = settings.lease * 3 / 4;
        settings.retry = settings.lease / 8;
        settings.outage = settings.lease * 3;
    }
    if let Some(outage) = knob::<u64>("FAULT_OUTAGE_MS") {
        settings.outage = Duration::from_millis(outage);
    }
    settings
}

/// One campaign at a time: they time failovers on a two-core machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Every report so far, for the summary table.
static REPORTS: Mutex<Vec<Report>> = Mutex::new(Vec::new());

fn campaign(backend: Backend) {
    campaign_with(backend, settings());
}

fn campaign_with(backend: Backend, settings: Settings) -> Option<Report> {
    let _turn = turn();
    let (faults, seed) = schedule(backend);
    if let Some(seed) = seed {
        eprintln!(
            "{}: {} faults shuffled with FAULT_SEED={seed}",
            backend.name(),
            faults.len()
        );
    }
    let programs = leader_tests::programs!();
    let report = run_or_skip(
        &format!("the {} campaign", backend.name()),
        campaign::run(backend, &faults, settings, &programs, &database_url()),
    )?;
    let mut reports = REPORTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    reports.push(report.clone());
    reports.sort_by_key(|r| r.backend);
    eprintln!(
        "{}: recoveries {:?}; frozen leaders stopped their COMMAND {:?} after SIGCONT\n\n{}",
        backend.name(),
        report.recoveries,
        report.resumed_stops,
        Report::table(&reports)
    );
    assert_clean(
        backend,
        &report.violations,
        report.recoveries.len(),
        &faults,
    );
    // A peer's frozen term writes nothing; ours always do, and must be refused (checked per
    // frozen term in the report's violations).
    if report.peers == 0 && faults.contains(&Fault::Freeze) {
        assert!(report.stale_refused > 0, "the fence was exercised");
    }
    Some(report)
}

on_each_harness_backend!(campaign:
    faults_on_the_file_lock => File,
    faults_on_postgres => Postgres,
    faults_on_mysql => Mysql,
    faults_on_mysql_get_lock => MysqlNamed,
    faults_on_nats => Nats,
    faults_on_zookeeper => ZooKeeper,
    faults_on_redis => Redis,
    faults_on_etcd => Etcd,
    faults_on_the_postgres_advisory_lock => Advisory,
    faults_on_consul => Consul,
    faults_on_kubernetes => Kubernetes,
    faults_on_object_storage => ObjectStore,
    faults_on_dynamodb => DynamoDb,
);

/// This run's turn: the workloads run one after the other unless `FAULT_PARALLEL=1`.
fn turn() -> Option<std::sync::MutexGuard<'static, ()>> {
    let parallel = std::env::var("FAULT_PARALLEL").is_ok_and(|v| v == "1");
    (!parallel).then(|| {
        ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    })
}

/// A workload's faults: `FAULT_COUNT` faults (or `FAULT_ROUNDS` rounds) of `kinds` in turn,
/// shuffled with `FAULT_SEED`.
fn workload_faults(kinds: &[Fault]) -> Vec<Fault> {
    let count = knob::<usize>("FAULT_COUNT")
        .unwrap_or_else(|| knob::<usize>("FAULT_ROUNDS").unwrap_or(1) * kinds.len());
    let mut faults: Vec<Fault> = kinds.iter().copied().cycle().take(count).collect();
    if let Some(seed) = knob::<u64>("FAULT_SEED") {
        fastrand::Rng::with_seed(seed).shuffle(&mut faults);
    }
    faults
}

/// What a workload's report on `backend` must show: no violation, and every one of `faults`
/// injected.
fn assert_clean(backend: Backend, violations: &[String], injected: usize, faults: &[Fault]) {
    assert!(violations.is_empty(), "{}: {violations:#?}", backend.name());
    assert_eq!(injected, faults.len(), "every fault injected");
}

/// The schedule workload (`leader cron`, its schedule and overlap policy changed under it,
/// the replicas' clocks apart) under the faults of `backend`: every scheduled instant
/// started, none twice, none of no schedule in force, no stale write accepted.
fn firings(backend: Backend) {
    let _turn = turn();
    let faults = workload_faults(&leader_tests::harness::firings::faults_for(backend));
    let programs = leader_tests::programs!();
    let Some(report) = run_or_skip(
        &format!("the {} schedule workload", backend.name()),
        leader_tests::harness::firings::run(
            backend,
            &faults,
            leader_tests::harness::firings::Variations::campaign(faults.len()),
            settings(),
            &programs,
            &database_url(),
        ),
    ) else {
        return;
    };
    eprintln!("{} firings under faults: {report:?}", backend.name());
    assert_clean(backend, &report.violations, report.faults, &faults);
    assert!(report.instants > 0 && report.writes > 0, "{report:?}");
    assert!(
        report.changes > 0 || faults.len() < 2,
        "a change rolled out: {report:?}"
    );
}

on_each_harness_backend!(firings:
    firings_under_faults_on_the_file_lock => File,
    firings_under_faults_on_postgres => Postgres,
    firings_under_faults_on_mysql => Mysql,
    firings_under_faults_on_nats => Nats,
    firings_under_faults_on_zookeeper => ZooKeeper,
    firings_under_faults_on_redis => Redis,
    firings_under_faults_on_etcd => Etcd,
    firings_under_faults_on_the_postgres_advisory_lock => Advisory,
    firings_under_faults_on_consul => Consul,
    firings_under_faults_on_kubernetes => Kubernetes,
    firings_under_faults_on_object_storage => ObjectStore,
    firings_under_faults_on_dynamodb => DynamoDb,
);

/// The shard workload (`leader run --shards 4 --static-membership`) under the faults of
/// `backend`, with rolling restarts and resizes beside them: per shard, no two terms at once,
/// tokens that grow, no stale write accepted.
fn shards(backend: Backend) {
    let _turn = turn();
    let faults = workload_faults(&leader_tests::harness::shards::faults_for(backend));
    let programs = leader_tests::programs!();
    let Some(report) = run_or_skip(
        &format!("the {} shard workload", backend.name()),
        leader_tests::harness::shards::run(
            backend,
            &faults,
            settings(),
            &programs,
            &database_url(),
        ),
    ) else {
        return;
    };
    eprintln!("{} shards under faults: {report:?}", backend.name());
    assert_clean(backend, &report.violations, report.faults, &faults);
    assert!(report.terms > 0 && report.writes > 0, "{report:?}");
    // The operators' part: a rolling restart after the second fault and every seventh, a
    // resize after the second and every tenth (one may fail while the server is down).
    assert_eq!(
        report.rolling_restarts,
        (faults.len() + 5) / 7,
        "{report:?}"
    );
    let resizes = (faults.len() + 8) / 10;
    assert_eq!(
        report.resizes + report.resize_failures.len(),
        resizes,
        "{report:?}"
    );
    assert!(
        resizes == 0 || report.resizes > 0,
        "no resize went through: {report:?}"
    );
}

on_each_harness_backend!(shards:
    shards_under_faults_on_the_file_lock => File,
    shards_under_faults_on_postgres => Postgres,
    shards_under_faults_on_mysql => Mysql,
    shards_under_faults_on_nats => Nats,
    shards_under_faults_on_zookeeper => ZooKeeper,
    shards_under_faults_on_redis => Redis,
    shards_under_faults_on_etcd => Etcd,
    shards_under_faults_on_consul => Consul,
    shards_under_faults_on_kubernetes => Kubernetes,
    shards_under_faults_on_object_storage => ObjectStore,
    /// The batched path: a member's records read with `BatchGetItem` and renewed with
    /// `TransactWriteItems`.
    shards_under_faults_on_dynamodb => DynamoDb,
);

/// A three-member etcd cluster: faults of the leader, and of one member (killed and restarted,
/// frozen, cut off from the replicas), which must cost the leader nothing. With the timings of
/// a production service (lease 8 s, renew deadline 6 s, retry period 500 ms; a member timeout of
/// a quarter of the renew deadline) unless `FAULT_LEASE_MS` says otherwise: when the raft
/// leader fails, etcd itself answers nothing until the others have elected a new one (an
/// election timeout, 1 to 2 s by default, and a round of votes; a second round when the two
/// followers campaign at once and split the vote, as etcd 3.4 without pre-vote does on a loaded
/// machine), and the renew deadline must leave room for two rounds beside the member timeout
/// and a retry period. A renew deadline of 4 s lost the term in about one run in ten under
/// load, to a split vote.
#[test]
fn faults_on_an_etcd_cluster() {
    let mut settings = settings();
    if knob::<u64>("FAULT_LEASE_MS").is_none() {
        settings.lease = Duration::from_secs(8);
        settings.renew = Duration::from_secs(6);
        settings.retry = Duration::from_millis(500);
        settings.outage = settings.lease * 3;
    }
    campaign_with(Backend::EtcdCluster, settings);
}

/// Our replicas beside kubert's on one Lease: neither overlaps the other, and each takes over
/// from the other. One kubert claimant beside two of ours: kubert counts the lease from the
/// holder's `renewTime` by its own clock, ours from when they saw the renewal (S2), so a
/// kubert follower wins a race for an expired Lease by up to a retry period.
#[test]
fn faults_on_a_mixed_kubernetes_fleet() {
    let mut settings = settings();
    // kubert writes whole seconds of lease; our timings follow the same lease.
    settings.lease = Duration::from_secs(settings.lease.as_secs().max(2));
    settings.renew = settings.lease * 3 / 4;
    settings.retry = settings.lease / 8;
    settings.replicas = 3;
    settings.peers = 1;
    let Some(report) = campaign_with(Backend::Kubernetes, settings) else {
        return;
    };
    assert!(
        report.handovers_to_peers > 0 && report.handovers_from_peers > 0,
        "each kind took over from the other: {report:?}"
    );
}
