//! Property test: under random schedules of faults, crashes, restarts and handover requests, two
//! electors on one lock never lead at the same instant, and fencing tokens grow with every term.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::faults::{Fault, Faults, FaultyLock};
use leader_core::{CancellationToken, LeaderElector, MemoryStore};
use proptest::prelude::*;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until};

#[derive(Clone, Debug)]
enum Action {
    Hang(Duration),
    DelayRequests(Duration),
    DelayResponses(Duration),
    FailNext(Fault),
    FailFor(Fault, Duration),
    Clear,
    /// Graceful shutdown (with or without release), then a new elector of the same identity.
    Restart {
        release: bool,
    },
    /// The elector's task is aborted, as in a crash; a new one starts after a pause.
    Crash(Duration),
    /// A handover request, written from outside, to this elector (or, `false`, to a candidate
    /// that never comes).
    Handover {
        to_this: bool,
    },
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        Just(Fault::Conflict),
        Just(Fault::Unavailable),
        Just(Fault::InvalidRecord),
        Just(Fault::Forbidden)
    ]
}

fn secs(max_ms: u64) -> impl Strategy<Value = Duration> {
    (0..max_ms).prop_map(Duration::from_millis)
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        secs(30_000).prop_map(Action::Hang),
        secs(9_000).prop_map(Action::DelayRequests),
        secs(9_000).prop_map(Action::DelayResponses),
        fault().prop_map(Action::FailNext),
        (fault(), secs(20_000)).prop_map(|(f, d)| Action::FailFor(f, d)),
        Just(Action::Clear),
        any::<bool>().prop_map(|release| Action::Restart { release }),
        secs(20_000).prop_map(Action::Crash),
        any::<bool>().prop_map(|to_this| Action::Handover { to_this }),
    ]
}

/// (time since start, elector index, action), sorted by time.
fn schedule() -> impl Strategy<Value = Vec<(Duration, usize, Action)>> {
    prop::collection::vec((secs(90_000), 0..2usize, action()), 0..16).prop_map(|mut steps| {
        steps.sort_by_key(|s| s.0);
        steps
    })
}

#[derive(Clone, Copy, Debug)]
struct Term {
    #[allow(dead_code, reason = "shown in failure messages")]
    elector: usize,
    fencing_token: u64,
    start: Instant,
    end: Option<Instant>,
}

struct Candidate {
    faults: Faults,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), leader_core::ElectionError>>,
}

fn start(
    store: &MemoryStore,
    index: usize,
    store_clock: bool,
    release: bool,
    terms: &Arc<Mutex<Vec<Term>>>,
) -> Candidate {
    let lock = FaultyLock::new(
        store
            .lock("election", format!("e{index}"))
            .with_store_clock(store_clock),
    );
    let faults = lock.faults();
    let terms = terms.clone();
    let elector = LeaderElector::builder(lock)
        .lease_duration(Duration::from_secs(15))
        .renew_deadline(Duration::from_secs(10))
        .retry_period(Duration::from_secs(2))
        .release_on_cancel(release)
        .on_started_leading(move |leadership| {
            let terms = terms.clone();
            async move {
                let at = {
                    let mut terms = terms.lock().unwrap();
                    terms.push(Term {
                        elector: index,
                        fencing_token: leadership.fencing_token(),
                        start: Instant::now(),
                        end: None,
                    });
                    terms.len() - 1
                };
                leadership.lost().await;
                terms.lock().unwrap()[at].end = Some(Instant::now());
            }
        })
        .build()
        .expect("valid timings");
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(elector.run(shutdown.clone()));
    Candidate {
        faults,
        shutdown,
        task,
    }
}

async fn simulate(steps: Vec<(Duration, usize, Action)>, store_clock: bool) -> Vec<Term> {
    let store = MemoryStore::new();
    let terms = Arc::new(Mutex::new(Vec::new()));
    let began = Instant::now();
    let mut candidates: Vec<Candidate> = (0..2)
        .map(|i| start(&store, i, store_clock, true, &terms))
        .collect();
    for (at, index, action) in steps {
        sleep_until(began + at).await;
        let candidate = &mut candidates[index];
        match action {
            Action::Hang(d) => {
                candidate.faults.hang(true);
                let faults = candidate.faults.clone();
                tokio::spawn(async move {
                    sleep(d).await;
                    faults.hang(false);
                });
            }
            Action::DelayRequests(d) => candidate.faults.delay_requests(d),
            Action::DelayResponses(d) => candidate.faults.delay_responses(d),
            Action::FailNext(f) => candidate.faults.fail_next(f),
            Action::FailFor(f, d) => {
                candidate.faults.fail_all(Some(f));
                let faults = candidate.faults.clone();
                tokio::spawn(async move {
                    sleep(d).await;
                    faults.fail_all(None);
                });
            }
            Action::Clear => candidate.faults.clear(),
            Action::Restart { release } => {
                candidate.faults.clear();
                candidate.shutdown.cancel();
                (&mut candidate.task)
                    .await
                    .expect("elector task")
                    .expect("the elector ran");
                *candidate = start(&store, index, store_clock, release, &terms);
            }
            Action::Crash(pause) => {
                candidate.task.abort();
                let _ = (&mut candidate.task).await;
                sleep(pause).await;
                *candidate = start(&store, index, store_clock, true, &terms);
            }
            Action::Handover { to_this } => {
                let to = if to_this {
                    format!("e{index}")
                } else {
                    "gone".to_owned()
                };
                // Refused when nobody ran yet, or the record is unreadable: that is fine here.
                let _ =
                    leader_core::request_handover(&store.lock("election", "operator"), &to).await;
            }
        }
    }
    sleep_until(began + Duration::from_secs(150)).await;
    for candidate in candidates {
        candidate.faults.clear();
        candidate.shutdown.cancel();
        candidate
            .task
            .await
            .expect("elector task")
            .expect("the elector ran");
    }
    terms.lock().unwrap().clone()
}

fn check(terms: &[Term]) -> Result<(), TestCaseError> {
    for (i, a) in terms.iter().enumerate() {
        let a_end = a
            .end
            .ok_or_else(|| TestCaseError::fail(format!("term never ended: {a:?}")))?;
        for b in &terms[i + 1..] {
            let b_end = b.end.unwrap_or(b.start);
            prop_assert!(
                !(b.start < a_end && a.start < b_end),
                "two terms overlap: {a:?} and {b:?}"
            );
        }
    }
    let mut by_start = terms.to_vec();
    by_start.sort_by_key(|t| t.start);
    for pair in by_start.windows(2) {
        prop_assert!(
            pair[1].fencing_token > pair[0].fencing_token,
            "fencing tokens must grow: {:?} then {:?}",
            pair[0],
            pair[1]
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn two_electors_never_lead_at_once(steps in schedule(), store_clock in any::<bool>(), seed in any::<u64>()) {
        fastrand::seed(seed);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        let terms = runtime.block_on(simulate(steps, store_clock));
        check(&terms)?;
    }
}

/// The checker itself finds an overlap.
#[test]
fn the_checker_rejects_overlapping_terms() {
    let now = Instant::now();
    let term = |elector, token, start: u64, end: u64| Term {
        elector,
        fencing_token: token,
        start: now + Duration::from_secs(start),
        end: Some(now + Duration::from_secs(end)),
    };
    assert!(check(&[term(0, 1, 0, 10), term(1, 2, 10, 20)]).is_ok());
    assert!(check(&[term(0, 1, 0, 10), term(1, 2, 9, 20)]).is_err());
    assert!(check(&[term(0, 2, 0, 10), term(1, 1, 11, 20)]).is_err());
}
