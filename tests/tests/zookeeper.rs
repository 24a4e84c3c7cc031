//! The ZooKeeper lock on three-server ensembles of the tests' own, through what happens to
//! ZooKeeper in production: a connection lost for less than the renew deadline, a session the
//! ensemble expires, the ensemble's leader server and a follower server killed, frozen and
//! started again. Each test watches every candidate's state and fails the moment two lead.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use leader_core::background::Candidate;
use leader_core::{LeaderElector, LeaderState};
use leader_test_support::zookeeper_ensemble::ZooKeeperEnsemble;
use leader_tests::harness::proxy::{Mode, Proxy};
use leader_zookeeper::ZooKeeperStore;
use tokio::sync::watch;
use tokio::time::{Instant, sleep};

/// Client-go's timings: what a service beside ZooKeeper would run with.
const LEASE: Duration = Duration::from_secs(15);
const RENEW: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(2);

/// Fails (at the end, through [`Overlaps::assert_none`]) if two of `states` ever lead at once,
/// checked every 2 ms until dropped.
struct Overlaps {
    seen: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Overlaps {
    fn watch(states: Vec<watch::Receiver<LeaderState>>) -> Self {
        let seen = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            loop {
                let leading = states.iter().filter(|s| s.borrow().is_leading()).count();
                if leading > 1 {
                    flag.store(true, Ordering::SeqCst);
                }
                sleep(Duration::from_millis(2)).await;
            }
        });
        Self { seen, task }
    }

    fn assert_none(self) {
        self.task.abort();
        assert!(
            !self.seen.load(Ordering::SeqCst),
            "two candidates led at once"
        );
    }
}

async fn store(connect: &str, session: Duration) -> ZooKeeperStore {
    ZooKeeperStore::builder(connect)
        .session_timeout(session)
        .connect_timeout(Duration::from_secs(20))
        .build()
        .await
        .expect("store")
}

fn candidate(
    store: &ZooKeeperStore,
    name: &str,
    identity: &str,
    timings: [Duration; 3],
) -> Candidate {
    let [lease, renew, retry] = timings;
    Candidate::build(
        LeaderElector::builder(store.lock(name, identity))
            .lease_duration(lease)
            .renew_deadline(renew)
            .retry_period(retry),
    )
}

async fn proxy_to(ensemble: &ZooKeeperEnsemble, index: usize) -> Proxy {
    Proxy::start(([127, 0, 0, 1], ensemble.client_port(index)).into())
        .await
        .expect("proxy")
}

/// The holder's connection to its server is closed, and new ones refused, for 3 s, well
/// under its renew deadline (10 s) and its session timeout (30 s): its client connects again
/// on the same session, its record znode stays, and it leads on with the same token; the
/// follower never leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_lost_for_less_than_the_renew_deadline_keeps_the_leader() {
    let Some(ensemble) = ZooKeeperEnsemble::start() else {
        return;
    };
    let proxy = proxy_to(&ensemble, 0).await;
    let holder_store = store(
        &format!("127.0.0.1:{}", proxy.port()),
        Duration::from_secs(30),
    )
    .await;
    let session = holder_store.client().await.expect("session").session_id();
    let mut holder = candidate(&holder_store, "loss", "holder", [LEASE, RENEW, RETRY]);
    let token = holder.wait_leading(Duration::from_secs(20)).await;
    let term = holder.term().expect("leading");
    let follower_store = store(&ensemble.connect_string(), Duration::from_secs(30)).await;
    let follower = candidate(&follower_store, "loss", "follower", [LEASE, RENEW, RETRY]);
    let overlaps = Overlaps::watch(vec![holder.state.clone(), follower.state.clone()]);
    sleep(RETRY).await;

    proxy.set(Mode::Down);
    sleep(Duration::from_secs(3)).await;
    proxy.set(Mode::Open);
    // Two renewals after it came back.
    sleep(RETRY * 2 + Duration::from_millis(500)).await;
    assert!(
        !term.is_cancelled(),
        "the term ended over a 3 s connection loss"
    );
    assert_eq!(holder.leading_token(), Some(token));
    assert!(!follower.is_leading());
    assert_eq!(
        holder_store.client().await.expect("session").session_id(),
        session,
        "the session was replaced"
    );
    overlaps.assert_none();
    holder.stop().await;
    follower.stop().await;
}

/// The holder's only server stops carrying its bytes for longer than its session timeout
/// (4 s, the least the ensemble grants): the holder stops by its renew deadline, the ensemble
/// expires its session and deletes its record znode, and the follower leads with a larger
/// token. When the connection comes back, the holder's client learns that its session expired;
/// its store opens another, and it is a follower, never a second leader, and leads again with
/// a still larger token once the other steps down.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_the_ensemble_expires_ends_the_term_and_the_holder_follows_on_a_new_one() {
    let Some(ensemble) = ZooKeeperEnsemble::start() else {
        return;
    };
    // The longest lease a 4 s session takes: the session less the client's connection
    // timeout (2/5 of it).
    let timings = [
        Duration::from_millis(2400),
        Duration::from_millis(1600),
        Duration::from_millis(400),
    ];
    let proxy = proxy_to(&ensemble, 1).await;
    let holder_store = store(
        &format!("127.0.0.1:{}", proxy.port()),
        Duration::from_secs(4),
    )
    .await;
    let old = holder_store.client().await.expect("session");
    assert_eq!(old.session_timeout(), Duration::from_secs(4));
    let mut holder = candidate(&holder_store, "expiry", "holder", timings);
    let first = holder.wait_leading(Duration::from_secs(20)).await;
    let term = holder.term().expect("leading");
    let follower_store = store(&ensemble.connect_string(), Duration::from_secs(30)).await;
    let mut follower = candidate(&follower_store, "expiry", "follower", timings);
    let overlaps = Overlaps::watch(vec![holder.state.clone(), follower.state.clone()]);
    sleep(Duration::from_secs(1)).await;

    let cut = Instant::now();
    proxy.set(Mode::Cut);
    let second = follower.wait_leading(Duration::from_secs(20)).await;
    assert!(term.is_cancelled(), "the holder still leads");
    assert!(second > first, "fencing token {first} then {second}");
    eprintln!("the follower led {:?} after the cut", cut.elapsed());
    // Well past the session timeout: the ensemble expires a session in buckets of its tick
    // (2 s), so up to 6 s after it last heard from the client; until then the bytes the cut
    // holds back, delivered, would keep the session.
    sleep(Duration::from_secs(10).saturating_sub(cut.elapsed())).await;
    proxy.set(Mode::Open);
    let since = Instant::now();
    while !old.state().is_terminated() {
        assert!(
            since.elapsed() < Duration::from_secs(20),
            "the old session is {:?}",
            old.state()
        );
        sleep(Duration::from_millis(50)).await;
    }
    sleep(timings[2] * 4).await;
    assert!(
        !holder.is_leading(),
        "the holder leads again beside the follower"
    );
    let new = holder_store.client().await.expect("a new session");
    assert_ne!(new.session_id(), old.session_id());

    follower.stop().await;
    let third = holder.wait_leading(Duration::from_secs(10)).await;
    assert!(third > second, "fencing token {second} then {third}");
    overlaps.assert_none();
    holder.stop().await;
}

/// The ensemble's leader server is killed, then a follower server, each started again, then
/// the leader server and a follower server frozen for 15 s each and thawed. Two candidates
/// never lead at once, tokens only grow, and someone leads again within 30 s of each fault;
/// the holder keeps its term through all but the frozen leader server, which holds every write
/// for longer than the renew deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn servers_killed_frozen_and_restarted_never_give_two_leaders() {
    let Some(mut ensemble) = ZooKeeperEnsemble::start() else {
        return;
    };
    let connect = ensemble.connect_string();
    let stores = [
        store(&connect, Duration::from_secs(30)).await,
        store(&connect, Duration::from_secs(30)).await,
        store(&connect, Duration::from_secs(30)).await,
    ];
    let candidates: Vec<Candidate> = stores
        .iter()
        .enumerate()
        .map(|(i, store)| candidate(store, "servers", &format!("c{i}"), [LEASE, RENEW, RETRY]))
        .collect();
    let overlaps = Overlaps::watch(candidates.iter().map(|c| c.state.clone()).collect());
    let refs: Vec<&Candidate> = candidates.iter().collect();
    let mut token = leader_core::background::next_leader(&refs, Duration::from_secs(20)).await;

    for fault in [
        "kill the leader server",
        "kill a follower server",
        "freeze the leader server",
        "freeze a follower server",
    ] {
        let leader = ensemble.leader().expect("a leader server");
        let target = match fault {
            "kill a follower server" | "freeze a follower server" => (leader + 1) % 3,
            _ => leader,
        };
        eprintln!("{fault}: server {target}");
        match fault {
            "freeze the leader server" | "freeze a follower server" => {
                ensemble.freeze(target);
                sleep(Duration::from_secs(15)).await;
                ensemble.thaw(target);
                ensemble.wait_for_quorum(Duration::from_secs(60));
            }
            _ => {
                ensemble.kill(target);
                sleep(Duration::from_secs(5)).await;
                ensemble.restart(target);
            }
        }
        let next = leader_core::background::next_leader(&refs, Duration::from_secs(30)).await;
        assert!(
            next >= token,
            "fencing token {token} then {next} after {fault}"
        );
        let kept = if next == token { "kept" } else { "lost" };
        eprintln!("{fault}: the term with token {token} was {kept}");
        // A killed server's connections close, and the ensemble elects a new leader in about
        // a second; a frozen follower is left after the client's connection timeout (4 s):
        // each well within the renew deadline. A frozen leader server holds every write until
        // the followers give up on it (syncLimit: 5 ticks, 10 s) and elect another, which a
        // renew deadline of 10 s does not outlast.
        if fault != "freeze the leader server" {
            assert_eq!(next, token, "{fault} cost the holder its term");
        }
        token = next;
        sleep(RETRY * 2).await;
    }
    overlaps.assert_none();
    for candidate in candidates {
        candidate.stop().await;
    }
}
