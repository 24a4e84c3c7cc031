//! Failures a program can see, on tokio's paused clock: errors reach `on_error` and the status
//! handle, readiness fails for a replica that could not take over, a timeout names the lock,
//! and fencing tokens start at a floor.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::background::Candidate;
use leader_core::faults::{Fault, FaultyLock};
use leader_core::{ElectionError, LockError, MemoryStore, NotReady};
use tokio::time::{Instant, sleep};

use common::{LEASE, RETRY, builder};

#[tokio::test(start_paused = true)]
async fn errors_reach_the_program_and_readiness() {
    let store = MemoryStore::new();
    let lock = FaultyLock::new(store.lock("election", "a"));
    let faults = lock.faults();
    faults.fail_all(Some(Fault::Unavailable));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let seen = errors.clone();
    let elector = builder(lock)
        .on_error(move |err| seen.lock().unwrap().push(err.to_string()))
        .build()
        .unwrap();
    let health = elector.health_check(Duration::ZERO);
    let started = Instant::now();
    let a = Candidate::run(elector);
    sleep(Duration::from_secs(5)).await;
    let failing = a.status.last_error().expect("a failure going on");
    assert!(
        matches!(&failing.error, ElectionError::Lock { error, .. } if matches!(**error, LockError::Unavailable { .. })),
        "{:?}",
        failing.error
    );
    assert_eq!(failing.since, started, "since the first failure");
    assert!(failing.failures >= 2, "{failing:?}");
    assert!(a.status.last_contact().is_none());
    assert!(health.ready().is_ok(), "not yet a lease without an answer");
    sleep(LEASE).await;
    match health.ready() {
        Err(NotReady::StoreUnreachable {
            since, last_error, ..
        }) => {
            assert!(since > LEASE, "{since:?}");
            assert!(
                last_error.is_some_and(|e| e.contains("injected outage")),
                "the readiness error says why"
            );
        }
        other => panic!("a replica the store has not answered for a lease is not ready: {other:?}"),
    }
    assert!(health.check().is_ok(), "a follower is live");
    let reported = errors.lock().unwrap().clone();
    assert!(
        reported.len() >= 3 && reported.iter().all(|e| e.contains("injected outage")),
        "{reported:?}"
    );
    faults.fail_all(None);
    sleep(RETRY * 6).await;
    assert!(a.is_leading(), "leads once the store answers");
    assert!(a.status.last_error().is_none(), "the failure is over");
    assert!(a.status.last_contact().is_some());
    assert!(health.ready().is_ok());
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_timeout_names_the_lock() {
    let store = MemoryStore::new();
    let lock = FaultyLock::new(store.lock("election", "a"));
    let faults = lock.faults();
    faults.hang(true);
    let a = Candidate::build(builder(lock));
    sleep(Duration::from_secs(6)).await;
    let failing = a.status.last_error().expect("a failure going on");
    let message = failing.error.to_string();
    assert!(
        message.contains("memory:election") && message.contains("timed out"),
        "{message}"
    );
    faults.hang(false);
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn acquisitions_take_at_least_the_fencing_token_floor() {
    let store = MemoryStore::new();
    for (kind, store_clock) in [("record", false), ("store clock", true)] {
        let name = format!("floor-{kind}");
        let lock = store.lock(&name, "a").with_store_clock(store_clock);
        let mut a = Candidate::build(builder(lock).fencing_token_floor(1_000));
        let first = a.wait_leading(RETRY).await;
        assert_eq!(first, 1_000, "{kind}");
        a.stop().await;
        let lock = store.lock(&name, "b").with_store_clock(store_clock);
        let mut b = Candidate::build(builder(lock).fencing_token_floor(10));
        let next = b.wait_leading(RETRY * 2).await;
        assert_eq!(next, 1_001, "{kind}: a lower floor never lowers the token");
        b.stop().await;
    }
}
