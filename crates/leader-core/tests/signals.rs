//! SIGTERM, as Kubernetes and systemd send it, stops a leader that runs with
//! `shutdown_on_signals`: its work ends and it releases the lease at once. A test binary of its
//! own: the signal goes to the whole process.

use std::time::Duration;

use leader_core::{LeaderElector, LeaderState, MemoryStore, ResourceLock};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_leader_and_releases_the_lease() {
    let store = MemoryStore::new();
    let elector = LeaderElector::builder(store.lock("signals", "a"))
        .build()
        .expect("an elector");
    let mut state = elector.subscribe();
    let shutdown = leader_core::shutdown_on_signals();
    let task = tokio::spawn(
        elector.run_while_leading(shutdown.clone(), |leadership| async move {
            leadership.lost().await;
        }),
    );
    tokio::time::timeout(
        Duration::from_secs(10),
        state.wait_for(LeaderState::is_leading),
    )
    .await
    .expect("leads within 10 s")
    .expect("the elector runs");
    let sent = tokio::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .await
        .expect("kill");
    assert!(sent.success());
    tokio::time::timeout(Duration::from_secs(5), shutdown.cancelled())
        .await
        .expect("SIGTERM fires the shutdown");
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the elector returns")
        .expect("no panic")
        .expect("the elector ran");
    let record = store
        .lock("signals", "reader")
        .get()
        .await
        .expect("get")
        .expect("a record");
    assert!(record.record.is_free(), "released: {:?}", record.record);
}
