//! One member of a three-member cluster failing costs the leader nothing: killed and restarted,
//! or frozen past the renew deadline, whichever member it is (the one the leader talks to, the
//! raft leader, another), the leader keeps its term. Requests and keep-alive streams stuck on
//! the failed member are given up after the member timeout and sent to the next member.
//!
//! Timings as users run them: lease 8 s, renew deadline 6 s, retry period 500 ms, the default
//! member timeout (1 s). The renew deadline leaves room for two rounds of a raft election when
//! the raft leader fails (a split vote, which etcd 3.4 without pre-vote has on a loaded
//! machine). A cluster of the test's own (Debian's `etcd`), three replicas each with a store of
//! its own on all three members.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use leader_core::LeaderElector;
use leader_etcd::EtcdStore;
use leader_test_support::etcd_cluster::EtcdCluster;
use tokio::sync::Mutex;
use tokio::time::{Instant, sleep};

use common::{Running, unique};

const LEASE: Duration = Duration::from_secs(8);
const RENEW: Duration = Duration::from_secs(6);
const RETRY: Duration = Duration::from_millis(500);

/// What the monitor saw: the most leaders at once, and the longest time the leader went
/// without a successful request to etcd.
#[derive(Debug, Default)]
struct Seen {
    most_leaders: usize,
    longest_silence: Duration,
}

async fn on_cluster<T: Send + 'static>(
    cluster: &Arc<std::sync::Mutex<EtcdCluster>>,
    f: impl FnOnce(&mut EtcdCluster) -> T + Send + 'static,
) -> T {
    let cluster = cluster.clone();
    tokio::task::spawn_blocking(move || f(&mut cluster.lock().unwrap_or_else(|p| p.into_inner())))
        .await
        .expect("cluster task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_leadership_is_lost_to_one_member_failing() {
    let Some(cluster) = EtcdCluster::start(3) else {
        return;
    };
    let endpoints = cluster.endpoints();
    let cluster = Arc::new(std::sync::Mutex::new(cluster));
    let name = unique("members");
    let mut candidates = Vec::new();
    for replica in 0..3 {
        let store = EtcdStore::builder(&endpoints)
            .build()
            .await
            .expect("a store on the cluster");
        let lock = store.lock(&name, format!("replica-{replica}"));
        candidates.push(Running::build(
            LeaderElector::builder(lock)
                .lease_duration(LEASE)
                .renew_deadline(RENEW)
                .retry_period(RETRY),
        ));
    }
    let leader = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Some(i) = candidates.iter().position(Running::is_leading) {
                return i;
            }
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a leader");
    let token = candidates[leader].leading_token().expect("leads");
    sleep(Duration::from_secs(1)).await;

    let candidates = Arc::new(candidates);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let done = Arc::new(AtomicBool::new(false));
    let monitor = tokio::spawn({
        let (candidates, seen, done) = (candidates.clone(), seen.clone(), done.clone());
        async move {
            while !done.load(Ordering::Acquire) {
                let leaders = candidates.iter().filter(|c| c.is_leading()).count();
                let silence = candidates[leader]
                    .status
                    .last_contact()
                    .map_or(Duration::ZERO, |at| at.elapsed());
                let mut seen = seen.lock().await;
                seen.most_leaders = seen.most_leaders.max(leaders);
                seen.longest_silence = seen.longest_silence.max(silence);
                drop(seen);
                sleep(Duration::from_millis(20)).await;
            }
        }
    });

    let mut faults = Vec::new();
    for member in 0..3 {
        faults.push(("killed for 3 s", Some(member)));
        faults.push(("frozen for 5 s", Some(member)));
    }
    // The raft leader, whichever member it is by then.
    faults.push(("killed for 3 s", None));
    for (fault, member) in faults {
        let member = match member {
            Some(member) => member,
            None => on_cluster(&cluster, |c| c.wait_for_a_leader(Duration::from_secs(10))).await,
        };
        let began = Instant::now();
        if fault.starts_with("killed") {
            on_cluster(&cluster, move |c| c.kill(member)).await;
            sleep(Duration::from_secs(3)).await;
            on_cluster(&cluster, move |c| c.restart(member)).await;
        } else {
            on_cluster(&cluster, move |c| c.freeze(member)).await;
            sleep(Duration::from_secs(5)).await;
            on_cluster(&cluster, move |c| c.thaw(member)).await;
        }
        // Seconds after a member is back count too.
        sleep(Duration::from_secs(3)).await;
        assert_eq!(
            candidates[leader].leading_token(),
            Some(token),
            "member {member} {fault}: the leader lost its term (after {:?}; {:?})",
            began.elapsed(),
            candidates[leader].stopped()
        );
        on_cluster(&cluster, |c| c.wait_for_a_leader(Duration::from_secs(10))).await;
    }
    done.store(true, Ordering::Release);
    monitor.await.expect("monitor");
    let seen = seen.lock().await;
    eprintln!(
        "7 member faults: longest time the leader went without a successful request: {:?} (renew deadline {RENEW:?})",
        seen.longest_silence
    );
    assert_eq!(seen.most_leaders, 1, "never two leaders: {seen:?}");
    assert!(
        candidates.iter().all(|c| c.stopped().is_empty()),
        "no term ended"
    );
    assert!(
        seen.longest_silence < RENEW,
        "the leader went {:?} without a successful request",
        seen.longest_silence
    );
}
