//! Who leads, as each replica sees it ([`LeaderView`]), through a leadership change, on tokio's
//! paused clock.

use std::time::Duration;

use leader_core::background::Candidate;
use leader_core::faults::FaultyLock;
use leader_core::{
    FileLock, FileUrl, LeaderElector, LeaderView, LockTarget, MemoryStore, ResourceLock,
};
use tokio::time::sleep;

const RETRY: Duration = Duration::from_secs(2);

fn candidate(store: &MemoryStore, identity: &str) -> Candidate {
    Candidate::build(
        LeaderElector::builder(store.lock("billing", identity))
            .name("billing")
            .jitter(0.0),
    )
}

#[tokio::test(start_paused = true)]
async fn every_replica_names_the_leader_its_token_and_since_when() {
    let store = MemoryStore::new();
    let mut a = candidate(&store, "a");
    let first = a.wait_leading(RETRY).await;
    let b = candidate(&store, "b");
    sleep(RETRY * 2).await;

    let leader = a.status.view();
    assert!(leader.leading);
    assert_eq!(
        (leader.name.as_str(), leader.identity.as_str()),
        ("billing", "a")
    );
    assert_eq!(leader.leader.as_deref(), Some("a"));
    assert_eq!(leader.fencing_token, Some(first));
    let elapsed = leader.elapsed.expect("the leader knows since when");
    assert!(
        elapsed >= RETRY * 2 && elapsed < RETRY * 3,
        "the leader's own monotonic time: {elapsed:?}"
    );
    let follower = b.status.view();
    assert!(!follower.leading);
    assert_eq!(follower.identity, "b");
    assert_eq!(follower.leader.as_deref(), Some("a"));
    assert_eq!(follower.fencing_token, Some(first));
    assert_eq!(
        follower.since, leader.since,
        "one time on every replica: the record's"
    );

    // The leader steps down; the follower takes over, and each names the other.
    a.leadership()
        .await
        .step_down()
        .expect("a step-down asked for");
    let mut b = b;
    let second = b.wait_leading(RETRY * 3).await;
    assert!(second > first);
    assert_ne!(
        a.status.view().leader.as_deref(),
        Some("a"),
        "a replica that released names no longer itself"
    );
    sleep(RETRY * 3).await;
    let leader = b.status.view();
    assert!(leader.leading);
    assert_eq!(leader.leader.as_deref(), Some("b"));
    assert_eq!(leader.fencing_token, Some(second));
    let follower = a.status.view();
    assert!(!follower.leading);
    assert_eq!(follower.leader.as_deref(), Some("b"));
    assert_eq!(follower.fencing_token, Some(second));
    assert_eq!(follower.since, leader.since);

    // A stopped replica names no one.
    a.stop().await;
    let b_status = b.status.clone();
    b.stop().await;
    let stopped = b_status.view();
    assert!(!stopped.leading);
    assert_eq!(
        (stopped.leader, stopped.fencing_token, stopped.since),
        (None, None, None)
    );
}

/// An elector built without a name of its own reports the election's name, the one its lock
/// was made for, everywhere it shows one: not the lock's description (`memory:billing`).
#[tokio::test(start_paused = true)]
async fn the_election_is_named_as_its_lock_was_made() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(LeaderElector::builder(store.lock("billing", "a")).jitter(0.0));
    a.wait_leading(RETRY).await;
    assert_eq!(a.status.view().name, "billing");
    assert_eq!(a.leadership().await.name(), "billing");
    a.stop().await;

    let named = |lock: Box<dyn ResourceLock>| {
        let elector = LeaderElector::builder(lock).build().expect("valid");
        elector.config().name.clone()
    };
    assert_eq!(
        named(Box::new(FaultyLock::new(store.lock("billing", "b")))),
        "billing"
    );
    // A file lock is named after its directory, or as the URL was opened.
    let dir = tempfile::tempdir().expect("temporary directory");
    assert_eq!(
        named(Box::new(FileLock::new(dir.path().join("nightly"), "c"))),
        "nightly"
    );
    let opened = FileUrl::new(dir.path().join("lock"))
        .open("billing", "d")
        .await
        .expect("opens");
    assert_eq!(named(opened), "billing");
    // A name of the elector's own wins.
    let elector = LeaderElector::builder(store.lock("billing", "e"))
        .name("invoices")
        .build();
    assert_eq!(elector.expect("valid").config().name, "invoices");
}

#[tokio::test(start_paused = true)]
async fn the_json_is_the_documented_one() {
    let store = MemoryStore::new();
    let mut a = candidate(&store, "a");
    let token = a.wait_leading(RETRY).await;
    sleep(Duration::from_millis(1500)).await;
    let view = a.status.view();
    let json = serde_json::to_value(&view).expect("serialises");
    assert_eq!(json["name"], "billing");
    assert_eq!(json["identity"], "a");
    assert_eq!(json["leading"], true);
    assert_eq!(json["leader"], "a");
    assert_eq!(json["fencingToken"], token);
    assert!(
        json["since"]
            .as_str()
            .is_some_and(|s| chrono::DateTime::parse_from_rfc3339(s).is_ok()),
        "{json}"
    );
    let elapsed = json["elapsedSeconds"].as_f64().expect("seconds");
    assert!((1.5..2.0).contains(&elapsed), "{json}");
    let back: LeaderView = serde_json::from_value(json).expect("reads back");
    assert_eq!(back, view);

    // Before anything is known: leader, token and times are null.
    let lonely = Candidate::build(
        LeaderElector::builder(MemoryStore::new().lock("billing", "z"))
            .name("billing")
            .retry_period(Duration::from_secs(1))
            .renew_deadline(Duration::from_secs(2))
            .lease_duration(Duration::from_secs(3)),
    );
    let json = serde_json::to_value(lonely.status.view()).expect("serialises");
    for field in ["leader", "fencingToken", "since", "elapsedSeconds"] {
        assert!(json[field].is_null(), "{field}: {json}");
    }
    assert_eq!(json["leading"], false);
    lonely.stop().await;
    a.stop().await;
}

/// A term's start as a time to print: by the elector's wall clock, which a test steps.
#[tokio::test(start_paused = true)]
async fn a_term_says_when_it_began_by_the_elector_wall_clock() {
    let (clock, step) = leader_core::WallClock::stepped();
    step.step(chrono::TimeDelta::hours(-1));
    let before = chrono::Utc::now();
    let store = MemoryStore::new();
    let elector = LeaderElector::builder(store.lock("billing", "a"))
        .wall_clock(clock)
        .jitter(0.0)
        .build()
        .expect("valid");
    let mut state = elector.subscribe();
    let shutdown = leader_core::CancellationToken::new();
    let running = tokio::spawn(elector.run(shutdown.clone()));
    state
        .wait_for(leader_core::LeaderState::is_leading)
        .await
        .expect("leads");
    let leadership = state.borrow().leadership().cloned().expect("leading");
    let began = leadership.began_at();
    let behind = before - began;
    assert!(
        behind > chrono::TimeDelta::minutes(59) && behind < chrono::TimeDelta::minutes(61),
        "began {began}, an hour behind {before} expected"
    );
    drop(leadership);
    shutdown.cancel();
    running.await.expect("stops").expect("the elector ran");
}
