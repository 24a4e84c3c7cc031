//! Metrics with client-go's names, and the health check, on tokio's paused clock.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Waker};
use std::time::Duration;

use leader_core::faults::{Fault, FaultyLock};
use leader_core::metrics::{MASTER_STATUS, SLOWPATH_TOTAL};
use leader_core::{CancellationToken, LeaderElector, LeaderState, MemoryStore};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::time::{advance, sleep};

fn value(snapshotter: &Snapshotter, name: &str) -> Option<DebugValue> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(key, ..)| key.key().name() == name)
        .map(|(.., value)| value)
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn metrics_follow_leadership_with_client_go_names() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);

    let lock = FaultyLock::new(MemoryStore::new().lock("jobs", "a"));
    let faults = lock.faults();
    let elector = LeaderElector::builder(lock)
        .name("jobs")
        .jitter(0.0)
        .build()
        .expect("valid");
    let mut state = elector.subscribe();
    let shutdown = CancellationToken::new();
    // Polled on this thread, so the thread-local recorder sees its metrics.
    let run = elector.run(shutdown.clone());
    let mut run = pin!(run);
    let drive = async {
        state
            .wait_for(LeaderState::is_leading)
            .await
            .expect("alive");
        assert_eq!(
            value(&snapshotter, MASTER_STATUS),
            Some(DebugValue::Gauge(1.0.into()))
        );
        faults.fail_next(Fault::Conflict);
        sleep(Duration::from_secs(5)).await;
        assert_eq!(
            value(&snapshotter, SLOWPATH_TOTAL),
            Some(DebugValue::Counter(1))
        );
        shutdown.cancel();
    };
    let (ran, ()) = tokio::join!(&mut run, drive);
    ran.expect("the elector ran");
    assert_eq!(
        value(&snapshotter, MASTER_STATUS),
        Some(DebugValue::Gauge(0.0.into()))
    );
    let key = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(key, ..)| key.key().name() == MASTER_STATUS)
        .map(|(key, ..)| key)
        .expect("gauge");
    assert!(
        key.key()
            .labels()
            .any(|l| l.key() == "name" && l.value() == "jobs")
    );
}

/// Like client-go's HealthzAdaptor: healthy while following or renewing; unhealthy when the
/// elector believes it leads but its loop has stopped making progress past the lease.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_health_check_reports_a_stuck_leader() {
    let elector = LeaderElector::builder(MemoryStore::new().lock("jobs", "a"))
        .jitter(0.0)
        .build()
        .expect("valid");
    let health = elector.health_check(Duration::from_secs(5));
    let state = elector.subscribe();
    assert!(health.check().is_ok(), "a candidate is healthy");
    let mut run = Box::pin(elector.run(CancellationToken::new()));
    let mut cx = Context::from_waker(Waker::noop());
    // Poll the elector by hand until it leads, then stop polling it: a stuck loop.
    while !state.borrow().is_leading() {
        assert!(run.as_mut().poll(&mut cx).is_pending());
        tokio::task::yield_now().await;
    }
    advance(Duration::from_secs(15)).await;
    assert!(health.check().is_ok(), "within lease + tolerance");
    advance(Duration::from_secs(6)).await;
    let err = health.check().expect_err("stuck past lease + tolerance");
    assert!(err.to_string().contains("still leading"), "{err}");
}
