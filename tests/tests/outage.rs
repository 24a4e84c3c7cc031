//! S9 end to end: a follower `leader run` whose store goes down (a proxy in front of a private
//! Postgres, MySQL, NATS, Redis, etcd, Kubernetes API, Consul or moto (S3, DynamoDB) server
//! closes every connection) or whose file lock record turns unreadable, after the holder was
//! killed. It must not retry faster than its retry period, must back off during the outage,
//! must log a summary rather than a line per attempt, and must lead soon after the store is
//! back.
//!
//! `OUTAGE_SECS` sets the outage (default 12 s); the benchmark `outage` runs 30 s and prints the
//! table BENCHMARKS.md quotes.

use std::time::Duration;

use leader_tests::harness::campaign::Backend;
use leader_tests::harness::outage::{self, Timings};
use leader_tests::harness::run_or_skip;
use leader_tests::on_each_harness_backend;

fn check(backend: Backend) {
    let seconds: u64 = std::env::var("OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let timings = Timings::default();
    let Some(report) = run_or_skip(
        &format!("the {} outage", backend.name()),
        outage::measure(
            backend,
            &leader_tests::programs!(),
            timings,
            Duration::from_secs(seconds),
            Duration::from_secs(1),
        ),
    ) else {
        return;
    };
    eprintln!("{}", outage::table(std::slice::from_ref(&report), timings));
    let name = backend.name();
    let outage = report.outage.as_secs_f64();
    // S9: never faster than one attempt per retry period (plus the one at the start).
    let hard = (outage / timings.retry.as_secs_f64()).floor() as u64 + 2;
    assert!(
        report.failures <= hard,
        "{name}: {} failed attempts in {outage:.1} s, more than {hard}",
        report.failures
    );
    assert!(
        report.failures >= 3,
        "{name}: it stopped trying: {report:?}"
    );
    // Backing off: in the second half, about one attempt per half a lease to a lease.
    let second_half: Vec<f64> = report
        .rates
        .iter()
        .filter(|(at, _)| at.as_secs_f64() > outage / 2.0)
        .map(|(_, rate)| *rate)
        .collect();
    let late = second_half.iter().sum::<f64>() / second_half.len().max(1) as f64;
    let bound = 2.0 / timings.lease.as_secs_f64() + 0.25;
    assert!(
        late <= bound,
        "{name}: {late:.2} failed attempts a second late in the outage, more than {bound:.2}: {:?}",
        report.rates
    );
    // Logs summarise the outage (a line when it starts or changes, one every 10 s) instead of
    // a line per attempt; a Kubernetes client's own error per request is filtered out.
    let lines = (outage / 10.0).ceil() as usize + 4;
    assert!(
        report.log_lines <= lines,
        "{name}: {} log lines in a {outage:.1} s outage, more than {lines}:\n{}",
        report.log_lines,
        report.logged.join("\n")
    );
    // Back soon: the next attempt by the end of the back-off (capped at a lease) and a jittered
    // retry; where the follower counts the holder's lease itself, a lease from its first read
    // of a version it had not seen (S2); a margin for the load.
    let own_clock = if backend.counts_leases_itself() {
        timings.lease
    } else {
        Duration::ZERO
    };
    let within = timings.lease + own_clock + timings.retry.mul_f64(2.2) + Duration::from_secs(2);
    let recovery = report
        .recovery
        .unwrap_or_else(|| panic!("{name}: no leader after the store came back"));
    assert!(
        recovery <= within,
        "{name}: leader {recovery:?} after the store came back, more than {within:?}"
    );
}

on_each_harness_backend!(check:
    a_waiting_follower_backs_off_during_an_outage_on_postgres => Postgres,
    a_waiting_follower_backs_off_during_an_outage_on_redis => Redis,
    a_waiting_follower_backs_off_during_an_outage_on_mysql => Mysql,
    a_waiting_follower_backs_off_during_an_outage_on_the_mysql_get_lock => MysqlNamed,
    a_waiting_follower_backs_off_during_an_outage_on_nats => Nats,
    a_waiting_follower_backs_off_during_an_outage_on_etcd => Etcd,
    a_waiting_follower_backs_off_during_an_outage_on_the_advisory_lock => Advisory,
    a_waiting_follower_backs_off_during_an_outage_on_kubernetes => Kubernetes,
    a_waiting_follower_backs_off_during_an_outage_on_consul => Consul,
    a_waiting_follower_backs_off_during_an_outage_on_object_storage => ObjectStore,
    a_waiting_follower_backs_off_during_an_outage_on_dynamodb => DynamoDb,
    a_waiting_follower_backs_off_on_an_unreadable_file_lock_record => File,
);
