//! S13 on tokio's paused clock: a leader never keeps a lease for work that is no longer running.
//! Work that returns or panics ends the term (or is restarted, when asked), and work can step
//! down.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::background::Candidate;
use leader_core::{
    CancellationToken, LeaderState, MemoryStore, ResourceLock, StepDownReason, WorkExit,
};
use tokio::sync::watch;
use tokio::time::{Instant, sleep};

use common::{LEASE, Logs, RETRY, builder};

/// Waits for the elector that `state` follows to lead; returns its term's fencing token.
async fn leading_token(state: &mut watch::Receiver<LeaderState>) -> u64 {
    let state = state.wait_for(LeaderState::is_leading).await.unwrap();
    state.leadership().unwrap().fencing_token()
}

/// `a` stepped down: it does not take the lease back while `b` leads, for two leases; then
/// both stop.
async fn only_b_leads_then_stop(a: Candidate, b: Candidate) {
    sleep(LEASE * 2).await;
    assert!(b.is_leading() && !a.is_leading());
    b.stop().await;
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn work_that_returns_ends_the_term_and_releases_the_lease() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")).on_started_leading(
        |leadership| async move {
            let _ = leadership.run(sleep(Duration::from_secs(5))).await;
        },
    ));
    let first = a.wait_leading(RETRY).await;
    let started = Instant::now();
    let mut b = Candidate::build(builder(store.lock("election", "b")));
    let next = b.wait_leading(Duration::from_secs(6)).await;
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "taken before the work ended"
    );
    assert!(next > first);
    let stopped = a.stopped();
    assert_eq!(stopped.len(), 1);
    assert_eq!(stopped[0].reason, StepDownReason::WorkEnded);
    assert!(
        stopped[0].released,
        "the lease is released for the next one"
    );
    // The one that stepped down does not take the lease back while the other leads.
    only_b_leads_then_stop(a, b).await;
}

#[tokio::test(start_paused = true)]
async fn run_while_leading_ends_the_term_when_its_work_returns() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let elector = builder(store.lock("election", "a")).build().unwrap();
    let mut state = elector.subscribe();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(elector.run_while_leading(shutdown.clone(), move |_| {
        let counted = counted.clone();
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            sleep(Duration::from_secs(1)).await;
        }
    }));
    let first = leading_token(&mut state).await;
    // Alone, it leads again after standing back, with a new token, and runs the work again.
    state.wait_for(|s| !s.is_leading()).await.unwrap();
    let stepped_down = Instant::now();
    let second = leading_token(&mut state).await;
    assert!(second > first);
    assert!(
        stepped_down.elapsed() >= RETRY,
        "it stood back for a retry period at least"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    shutdown.cancel();
    task.await.unwrap().expect("the elector ran");
}

#[tokio::test(start_paused = true)]
async fn work_that_panics_ends_the_term() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")).on_started_leading(
        |_| async move {
            sleep(Duration::from_secs(1)).await;
            panic!("the job broke");
        },
    ));
    a.wait_leading(RETRY).await;
    let mut b = Candidate::build(builder(store.lock("election", "b")));
    b.wait_leading(Duration::from_secs(2)).await;
    let stopped = a.stopped();
    assert_eq!(stopped[0].reason, StepDownReason::WorkPanicked);
    assert!(stopped[0].released);
    b.stop().await;
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn with_restart_the_work_starts_again_in_the_same_term() {
    let store = MemoryStore::new();
    let starts = Arc::new(Mutex::new(Vec::new()));
    let log = starts.clone();
    let mut a = Candidate::build(
        builder(store.lock("election", "a"))
            .work_exit(WorkExit::Restart)
            .on_started_leading(move |leadership| {
                let log = log.clone();
                async move {
                    log.lock()
                        .unwrap()
                        .push((leadership.fencing_token(), Instant::now()));
                    sleep(Duration::from_secs(1)).await;
                    panic!("the job broke");
                }
            }),
    );
    let term = a.leadership().await;
    sleep(Duration::from_secs(30)).await;
    assert!(!term.is_lost(), "the term goes on");
    let starts = starts.lock().unwrap().clone();
    assert!(starts.len() >= 5, "restarted: {starts:?}");
    assert!(
        starts
            .iter()
            .all(|(token, _)| *token == term.fencing_token()),
        "in the same term"
    );
    for pair in starts.windows(2) {
        assert!(
            pair[1].1 - pair[0].1 >= Duration::from_secs(1) + RETRY,
            "restarted a retry period after it ended: {starts:?}"
        );
    }
    drop(term);
    assert_eq!(a.stop().await[0].reason, StepDownReason::Shutdown);
}

#[tokio::test(start_paused = true)]
async fn work_can_step_down() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")));
    let leadership = a.leadership().await;
    let mut b = Candidate::build(builder(store.lock("election", "b")));
    sleep(RETRY).await;
    leadership.step_down().expect("leading");
    assert!(leadership.step_down().is_err(), "one request per term");
    leadership.lost().await;
    drop(leadership);
    b.wait_leading(RETRY).await;
    let stopped = a.stopped();
    assert_eq!(stopped[0].reason, StepDownReason::SteppedDown);
    assert!(stopped[0].released);
    only_b_leads_then_stop(a, b).await;
}

/// Work handed to a task of its own, with a clone of the leadership, keeps the term while
/// that task runs, though the callback returned at once.
#[tokio::test(start_paused = true)]
async fn work_that_keeps_a_clone_keeps_the_term() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")).on_started_leading(
        |leadership| async move {
            tokio::spawn(async move {
                let _ = leadership.run(sleep(Duration::from_secs(40))).await;
            });
        },
    ));
    let term = a.leadership().await;
    // The copy taken from the state channel does not count, nor does this clone of it once
    // dropped.
    drop(term);
    sleep(Duration::from_secs(39)).await;
    assert!(
        a.is_leading() && a.stopped().is_empty(),
        "the spawned work still runs"
    );
    sleep(Duration::from_secs(2)).await;
    let stopped = a.stopped();
    assert_eq!(stopped.len(), 1, "the work ended, and the term with it");
    assert_eq!(stopped[0].reason, StepDownReason::WorkEnded);
    a.stop().await;
}

/// Without callbacks the elector knows of no work: the term goes on, and a clone taken from
/// the state channel is waited for before the release (S6).
#[tokio::test(start_paused = true)]
async fn without_callbacks_the_term_is_not_ended_by_work() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")));
    let leadership = a.leadership().await;
    sleep(Duration::from_secs(60)).await;
    assert!(a.is_leading());
    let held = tokio::spawn(async move {
        leadership.lost().await;
        sleep(Duration::from_secs(1)).await;
        drop(leadership);
        Instant::now()
    });
    let stopping = tokio::spawn(a.stop());
    let reader = store.lock("election", "x");
    let freed = loop {
        let record = reader.get().await.unwrap().unwrap().record;
        if record.is_free() {
            break Instant::now();
        }
        sleep(Duration::from_millis(10)).await;
    };
    let dropped = held.await.unwrap();
    assert!(stopping.await.unwrap()[0].released);
    assert!(freed >= dropped, "released before the clone was gone");
}

/// A candidate that just handed its lease over does not stand back: a handover back to it
/// moves the lease at once (the request alone keeps it back from a lease named for another).
#[tokio::test(start_paused = true)]
async fn a_lease_handed_back_is_taken_at_once() {
    let store = MemoryStore::new();
    let mut a = Candidate::build(builder(store.lock("election", "a")));
    let first = a.leadership().await;
    let mut b = Candidate::build(builder(store.lock("election", "b")));
    sleep(RETRY).await;
    first.hand_over("b").expect("leading");
    drop(first);
    let second = b.leadership().await;
    let asked = Instant::now();
    second.hand_over("a").expect("leading");
    drop(second);
    a.wait_leading(LEASE).await;
    assert!(
        asked.elapsed() < RETRY,
        "handed back after {:?}",
        asked.elapsed()
    );
    b.stop().await;
    a.stop().await;
}

/// Terms that end at once, as `run_while_leading(.., |_| async {})` gives them: said at error
/// level with what to write instead, where work that ran a while ends its term with a warning.
#[tokio::test(start_paused = true)]
async fn work_that_returns_at_once_is_an_error_that_says_what_to_write() {
    let logs = Logs::default();
    let _guard = logs.capture();
    let store = MemoryStore::new();
    let elector = builder(store.lock("election", "a")).build().unwrap();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(elector.run_while_leading(shutdown.clone(), |_| async {}));
    // Its terms end as they begin (a watch of the state may never see one): a few of them.
    sleep(LEASE).await;
    shutdown.cancel();
    running.await.unwrap().expect("the elector ran");
    let text = logs.text();
    let flap = text
        .lines()
        .find(|l| l.contains("as soon as the term began"))
        .unwrap_or_else(|| panic!("not said: {text}"));
    assert!(flap.contains("ERROR"), "{flap}");
    assert!(flap.contains("flaps") && flap.contains("`run`"), "{flap}");

    // Work that ran longer than a retry period: a warning, no error.
    let logs = Logs::default();
    let _guard = logs.capture();
    let elector = builder(store.lock("election-2", "a")).build().unwrap();
    let mut state = elector.subscribe();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(elector.run_while_leading(shutdown.clone(), |_| async {
        sleep(RETRY * 3).await;
    }));
    state.wait_for(LeaderState::is_leading).await.unwrap();
    sleep(RETRY * 4).await;
    shutdown.cancel();
    running.await.unwrap().expect("the elector ran");
    let text = logs.text();
    assert!(
        text.contains("leader work returned: ending the term"),
        "{text}"
    );
    assert!(!text.contains("ERROR"), "{text}");
}

/// A task beside the work (the leader's Pod label) does not keep the term: when the work
/// returns the term ends, and the task's clean-up is done before the lease is released, so the
/// next leader begins after it.
#[tokio::test(start_paused = true)]
async fn a_task_beside_the_work_ends_with_the_term_and_is_waited_for() {
    let store = MemoryStore::new();
    let cleaned = Arc::new(Mutex::new(None::<Instant>));
    let seen = cleaned.clone();
    let mut a = Candidate::build(
        builder(store.lock("election", "a"))
            .on_started_leading(|leadership| async move {
                let _ = leadership.run(sleep(Duration::from_secs(5))).await;
            })
            .beside_work(move |leadership| {
                let seen = seen.clone();
                async move {
                    // Holds something for the term, undoes it when the term ends.
                    leadership.lost().await;
                    sleep(Duration::from_millis(800)).await;
                    *seen.lock().unwrap() = Some(Instant::now());
                }
            }),
    );
    let first = a.wait_leading(RETRY).await;
    let started = Instant::now();
    let mut b = Candidate::build(builder(store.lock("election", "b")));
    let next = b.wait_leading(Duration::from_secs(8)).await;
    let taken = Instant::now();
    assert!(next > first);
    // Ended by the work, not held for a lease by the task that never returns by itself.
    assert!(
        taken - started < Duration::from_secs(7),
        "taken after {:?}",
        taken - started
    );
    let stopped = a.stopped();
    assert_eq!(stopped.len(), 1);
    assert_eq!(stopped[0].reason, StepDownReason::WorkEnded);
    assert!(stopped[0].released);
    let cleaned = cleaned.lock().unwrap().expect("the task's clean-up ran");
    assert!(
        cleaned <= taken,
        "the next leader began before the clean-up"
    );
    b.stop().await;
    a.stop().await;
}

/// Without work (`run`), a task beside it leaves the term to the lease: it lasts.
#[tokio::test(start_paused = true)]
async fn a_task_beside_no_work_keeps_no_term_from_lasting() {
    let store = MemoryStore::new();
    let mut a =
        Candidate::build(builder(store.lock("election", "a")).beside_work(|_leadership| async {}));
    a.wait_leading(RETRY).await;
    sleep(LEASE * 3).await;
    assert!(a.is_leading(), "a task that returned ended the term");
    assert!(a.stopped().is_empty());
    a.stop().await;
}

/// With `graceful_stop`, the work of `run_while_leading` sees the term end and finishes what it
/// does within the stop grace (a reconcile half done is completed), and the lease is released
/// after it; without, the work is dropped at once. Work that ignores the end is dropped before
/// the grace runs out, and the lease is still released.
#[tokio::test(start_paused = true)]
async fn graceful_work_finishes_within_the_grace() {
    for (graceful, step, finishes) in [
        (true, Duration::from_secs(1), true),
        (false, Duration::from_secs(1), false),
        (true, Duration::from_secs(60), false),
    ] {
        let store = MemoryStore::new();
        let finished = Arc::new(Mutex::new(None::<Instant>));
        let done = finished.clone();
        let elector = builder(store.lock("election", "a"))
            .stop_grace(Duration::from_secs(4))
            .graceful_stop(graceful)
            .build()
            .unwrap();
        let mut state = elector.subscribe();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(
            elector.run_while_leading(shutdown.clone(), move |leadership| {
                let done = done.clone();
                async move {
                    leadership.lost().await;
                    // The rest of a reconcile, after the term ended.
                    sleep(step).await;
                    *done.lock().unwrap() = Some(Instant::now());
                }
            }),
        );
        state.wait_for(LeaderState::is_leading).await.unwrap();
        let stopped = Instant::now();
        shutdown.cancel();
        task.await.unwrap().expect("the elector ran");
        let released = store
            .lock("election", "reader")
            .get()
            .await
            .unwrap()
            .expect("the record")
            .record
            .is_free();
        assert!(released, "graceful {graceful}, step {step:?}: not released");
        let finished_at = *finished.lock().unwrap();
        assert_eq!(
            finished_at.is_some(),
            finishes,
            "graceful {graceful}, step {step:?}"
        );
        if let Some(at) = finished_at {
            assert!(at - stopped >= step, "finished before its step");
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(4),
            "{:?}",
            stopped.elapsed()
        );
    }
}
