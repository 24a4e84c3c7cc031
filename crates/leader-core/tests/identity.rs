//! S13 on tokio's paused clock: two processes given one identity never lead at once, the second
//! says so, and a process of the same identity that died holding the lease is waited out.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::background::Candidate;
use leader_core::{ElectionError, MemoryLock, MemoryStore};
use tokio::time::{Instant, sleep};

use common::{LEASE, RETRY, builder, lose_a_term};

/// The kinds of lock the elector meets: a record renewed by writing it (file, Postgres,
/// Kubernetes), a store-clock acquisition, and a lease the store keeps alive (etcd, Redis,
/// Consul).
fn locks(store: &MemoryStore, identity: &str) -> Vec<(&'static str, MemoryLock)> {
    vec![
        ("record", store.lock("record", identity)),
        (
            "store clock",
            store.lock("store-clock", identity).with_store_clock(true),
        ),
        (
            "kept in store",
            store.lock("in-store", identity).with_renewal_in_store(true),
        ),
    ]
}

#[tokio::test(start_paused = true)]
async fn two_processes_of_one_identity_never_lead_at_once() {
    let store = MemoryStore::new();
    for ((kind, first), (_, second)) in locks(&store, "same").into_iter().zip(locks(&store, "same"))
    {
        let mut a = Candidate::build(builder(first));
        let term = a.leadership().await;
        let errors = Arc::new(Mutex::new(Vec::new()));
        let seen = errors.clone();
        let mut b = Candidate::build(builder(second).on_error(move |err| {
            seen.lock().unwrap().push(err.clone());
        }));
        let started = Instant::now();
        let mut reported = None;
        while started.elapsed() < LEASE * 4 {
            sleep(Duration::from_millis(100)).await;
            assert!(
                !b.is_leading(),
                "{kind}: two processes of one identity lead"
            );
            if reported.is_none() && b.status.identity_conflict().is_some() {
                reported = Some(started.elapsed());
            }
        }
        assert!(!term.is_lost(), "{kind}: the first process keeps its term");
        let reported = reported.unwrap_or_else(|| panic!("{kind}: no conflict reported"));
        assert!(
            reported <= LEASE * 2 + RETRY * 2,
            "{kind}: the conflict was reported {reported:?} after the second process started"
        );
        let conflict = b.status.identity_conflict().expect("reported");
        assert_eq!(conflict.identity, "same");
        assert_eq!(conflict.fencing_token, term.fencing_token());
        let conflicts = errors
            .lock()
            .unwrap()
            .iter()
            .filter(|e| matches!(e, ElectionError::IdentityConflict(_)))
            .count();
        assert_eq!(conflicts, 1, "{kind}: on_error hears of the conflict once");
        assert!(
            a.status.identity_conflict().is_none(),
            "{kind}: the leader sees no conflict of its own term"
        );
        // Once the leader is gone (it releases), the other process takes over.
        drop(term);
        a.stop().await;
        b.wait_leading(RETRY * 3).await;
        assert!(
            b.status.identity_conflict().is_none(),
            "{kind}: the conflict ends with the other term"
        );
        b.stop().await;
    }
}

/// A process of this identity that died holding the lease (a restarted container that keeps
/// its pod name) is not a conflict: its lease runs out and the new process takes over.
#[tokio::test(start_paused = true)]
async fn a_process_of_the_same_identity_that_died_holding_the_lease_is_waited_out() {
    let store = MemoryStore::new();
    for ((kind, first), (_, second)) in locks(&store, "same").into_iter().zip(locks(&store, "same"))
    {
        let mut a = Candidate::build(builder(first).release_on_cancel(false));
        let token = a.wait_leading(RETRY).await;
        // Crashed: its task is gone, its lease left behind.
        a.task.abort();
        let died = Instant::now();
        let mut b = Candidate::build(builder(second));
        let next = b.wait_leading(LEASE * 2).await;
        let took = died.elapsed();
        assert!(
            took >= LEASE - RETRY,
            "{kind}: took over a lease of another process before it ran out ({took:?})"
        );
        assert!(next > token, "{kind}: fencing token {token} then {next}");
        assert!(
            b.status.identity_conflict().is_none(),
            "{kind}: a dead process is no conflict"
        );
        b.stop().await;
    }
}

/// A process takes its own term again at once when it stepped down at its renew deadline with
/// the lease still its own: that term is its own, not another process's.
#[tokio::test(start_paused = true)]
async fn a_process_takes_its_own_term_again() {
    use leader_core::faults::FaultyLock;
    let store = MemoryStore::new();
    for (kind, lock) in locks(&store, "a") {
        let lock = FaultyLock::new(lock);
        let faults = lock.faults();
        let mut a = Candidate::build(builder(lock));
        lose_a_term(&mut a, &faults).await;
        let lost = Instant::now();
        let second = a.wait_leading(LEASE).await;
        assert!(
            lost.elapsed() < LEASE / 2,
            "{kind}: its own term was waited out as another's"
        );
        assert!(second > 1, "{kind}: a new token");
        assert!(a.status.identity_conflict().is_none(), "{kind}");
        a.stop().await;
    }
}
