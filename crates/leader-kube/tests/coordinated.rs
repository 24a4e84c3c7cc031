//! Coordinated leader election (KEP-4355) on the test API server, with and without the
//! coordinator kube-apiserver runs under the `CoordinatedLeaderElection` feature gate
//! (`leader_test_support::kube_api::coordinator`, which cites its source).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{KubeApiServer, client, granted};
use k8s_openapi::api::coordination::v1beta1::LeaseCandidate;
use kube::api::{Api, PostParams};
use leader_core::backend::HolderCheck;
use leader_core::{LockError, ResourceLock};
use leader_kube::{Coordination, LeaseLock};
use leader_test_support::Candidate;
use tokio::time::{Instant, sleep, timeout};

/// How long an election by the coordinator may take: a ping, the wait for answers and a
/// requeue (5 s each), with a generous margin.
const ELECTION: Duration = Duration::from_secs(30);

fn coordinated(api: &KubeApiServer, lease: &str, identity: &str, version: &str) -> LeaseLock {
    LeaseLock::new(client(api), "default", lease, identity)
        .expect("valid names")
        .coordinated(Coordination::oldest_emulation_version(version, version))
        .expect("valid coordination")
}

fn plain(api: &KubeApiServer, lease: &str, identity: &str) -> LeaseLock {
    LeaseLock::new(client(api), "default", lease, identity).expect("valid names")
}

fn time(value: &serde_json::Value) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(value.as_str().expect("a time"))
        .expect("RFC 3339")
        .with_timezone(&Utc)
}

type State = tokio::sync::watch::Receiver<leader_core::LeaderState>;
/// The candidates leading at one moment, with their tokens.
type Leading = Vec<(String, u64)>;

/// Who led, with which token, as seen every few milliseconds, and any moment two led at once.
#[derive(Clone, Default)]
struct Terms {
    candidates: Arc<Mutex<Vec<(String, State)>>>,
    seen: Arc<Mutex<Vec<(String, u64)>>>,
    overlaps: Arc<Mutex<Vec<Leading>>>,
}

impl Terms {
    /// Starts watching, until the runtime stops.
    fn start() -> Self {
        let terms = Self::default();
        let watched = terms.clone();
        tokio::spawn(async move {
            loop {
                let leading: Vec<(String, u64)> = watched
                    .candidates
                    .lock()
                    .unwrap()
                    .iter()
                    .filter_map(|(name, state)| {
                        let token = state.borrow().leadership().map(|l| l.fencing_token())?;
                        Some((name.clone(), token))
                    })
                    .collect();
                if leading.len() > 1 {
                    watched.overlaps.lock().unwrap().push(leading.clone());
                }
                for term in leading {
                    let mut seen = watched.seen.lock().unwrap();
                    if !seen.contains(&term) {
                        seen.push(term);
                    }
                }
                sleep(Duration::from_millis(5)).await;
            }
        });
        terms
    }

    fn add(&self, name: &str, candidate: &Candidate) {
        let state = candidate.state.clone();
        self.candidates
            .lock()
            .unwrap()
            .push((name.to_owned(), state));
    }

    /// The terms seen, in order; panics if two leaders were ever seen at once.
    fn seen(&self) -> Vec<(String, u64)> {
        let overlaps = self.overlaps.lock().unwrap();
        assert!(overlaps.is_empty(), "two leaders at once: {overlaps:?}");
        self.seen.lock().unwrap().clone()
    }
}

/// Denies on the server every verb the Roles in `deploy/kubernetes` do not grant, so that the
/// tests run with exactly the rights a deployment has.
fn deny_what_the_roles_do_not_grant(api: &KubeApiServer) {
    let verbs = [
        "get", "list", "watch", "create", "update", "patch", "delete",
    ];
    for (file, resource) in [
        ("rbac.yaml", "leases"),
        ("rbac-coordinated.yaml", "leasecandidates"),
    ] {
        let granted = granted(file, resource);
        for verb in verbs {
            if !granted.iter().any(|g| g == verb) {
                api.deny_on(resource, verb);
            }
        }
    }
}

/// Waits until `candidate` leads within [`ELECTION`].
async fn leads(candidate: &mut Candidate) -> u64 {
    candidate.wait_leading(ELECTION).await
}

/// Without a coordinator, a coordinated candidate announces itself, answers pings at once and
/// never takes the Lease; stopping withdraws it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_announces_itself_answers_pings_and_never_takes_the_lease() {
    let api = KubeApiServer::start().await;
    api.serve_lease_candidates();
    let lock = LeaseLock::new(client(&api), "default", "jobs", "pod-a")
        .expect("valid names")
        .coordinated(Coordination::oldest_emulation_version("1.5.0", "1.4.0"))
        .expect("valid");
    // The coordinator's to give: candidates ask at every attempt, never read a Lease found
    // gone as one to wait out and create.
    assert_eq!(lock.holder_check(), HolderCheck::Assigned);
    assert_eq!(
        plain(&api, "jobs", "pod-a").holder_check(),
        HolderCheck::Record
    );
    let candidate = Candidate::start(lock);

    let announced = timeout(Duration::from_secs(5), async {
        loop {
            if let Some(found) = api.lease_candidate("default", "pod-a") {
                return found;
            }
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the candidate is announced");
    assert_eq!(announced["apiVersion"], "coordination.k8s.io/v1beta1");
    let spec = &announced["spec"];
    assert_eq!(spec["leaseName"], "jobs");
    assert_eq!(spec["binaryVersion"], "1.5.0");
    assert_eq!(spec["emulationVersion"], "1.4.0");
    assert_eq!(spec["strategy"], Coordination::OLDEST_EMULATION_VERSION);
    let renewed = time(&spec["renewTime"]);
    assert!(
        Utc::now() - renewed < chrono::Duration::seconds(5),
        "{spec}"
    );

    // A ping (pingTime after renewTime) is answered within a second.
    let candidates: Api<LeaseCandidate> = Api::namespaced(client(&api), "default");
    let mut pinged = candidates.get("pod-a").await.expect("get");
    let ping = Utc::now();
    let ping_spec = pinged.spec.as_mut().expect("spec");
    ping_spec.ping_time = Some(
        serde_json::from_value(serde_json::json!(
            ping.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
        ))
        .expect("a MicroTime"),
    );
    pinged.metadata.managed_fields = None;
    candidates
        .replace("pod-a", &PostParams::default(), &pinged)
        .await
        .expect("ping");
    let asked = Instant::now();
    timeout(Duration::from_secs(1), async {
        loop {
            let spec = &api.lease_candidate("default", "pod-a").expect("kept")["spec"];
            if time(&spec["renewTime"]) > time(&spec["pingTime"]) {
                return;
            }
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the ping is answered");
    eprintln!("ping answered after {:?}", asked.elapsed());

    // Nobody gives it the Lease: it neither creates nor takes it.
    candidate
        .stays_alive_without_leading(Duration::from_secs(3))
        .await;
    assert!(
        api.lease("default", "jobs").is_none(),
        "the Lease was created"
    );

    candidate.stop().await;
    assert!(
        api.lease_candidate("default", "pod-a").is_none(),
        "the candidate was not withdrawn"
    );
}

/// The coordinator gives the Lease to the oldest version; a candidate with an older version
/// joining makes the holder step down and takes over; plain candidates share the Lease and
/// are asked to step down like any holder. Never two leaders; every term has a larger token.
/// Every candidate has only the rights `deploy/kubernetes` grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_coordinator_elects_the_oldest_version_in_a_mixed_fleet() {
    let api = KubeApiServer::start().await;
    deny_what_the_roles_do_not_grant(&api);
    api.start_coordinator();
    let terms = Terms::start();

    let mut newer = Candidate::start(coordinated(&api, "jobs", "newer", "1.3.0"));
    terms.add("newer", &newer);
    let first = leads(&mut newer).await;
    let lease = api
        .lease("default", "jobs")
        .expect("the coordinator created the Lease");
    assert_eq!(lease["spec"]["holderIdentity"], "newer");
    assert_eq!(
        lease["spec"]["strategy"],
        Coordination::OLDEST_EMULATION_VERSION
    );

    // A plain candidate waits behind the live holder; the older version takes over.
    let plain = Candidate::start(plain(&api, "jobs", "plain"));
    let mut older = Candidate::start(coordinated(&api, "jobs", "older", "1.2.0"));
    terms.add("older", &older);
    terms.add("plain", &plain);
    let second = leads(&mut older).await;
    assert!(second > first, "tokens {first} then {second}");
    assert!(newer.leading_token().is_none());
    let lease = api.lease("default", "jobs").expect("lease");
    assert!(lease["spec"]["preferredHolder"].is_null(), "{lease}");
    sleep(Duration::from_millis(500)).await;

    // The older leaves: whoever takes the Lease first, the coordinator ends with "newer"
    // (the plain candidate is asked to step down for it).
    older.stop().await;
    let started = Instant::now();
    timeout(ELECTION, async {
        loop {
            if newer.leading_token().is_some() {
                return;
            }
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the coordinated candidate leads again");
    let took = started.elapsed();
    eprintln!("re-elected after {took:?}");
    // The leaving candidate withdrew before its release, so the coordinator did not give the
    // Lease back to it (which would cost the coordinator's 5 s lease).
    assert!(took < Duration::from_secs(4), "re-election took {took:?}");
    sleep(Duration::from_millis(500)).await;

    let seen = terms.seen();
    eprintln!("terms: {seen:?}");
    let tokens: Vec<u64> = seen.iter().map(|(_, token)| *token).collect();
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens must grow: {seen:?}"
    );
    assert_eq!(seen.first().map(|(name, _)| name.as_str()), Some("newer"));
    assert_eq!(seen.get(1).map(|(name, _)| name.as_str()), Some("older"));
    assert_eq!(seen.last().map(|(name, _)| name.as_str()), Some("newer"));

    // Once the coordinated candidates have left, the plain one leads on its own.
    let last = seen.last().map(|(_, token)| *token).unwrap_or_default();
    newer.stop().await;
    let mut plain = plain;
    let token = plain.wait_leading(Duration::from_secs(5)).await;
    assert!(token > last, "tokens {last} then {token}");
    assert!(api.lease_candidate("default", "newer").is_none());
    assert!(api.lease_candidate("default", "older").is_none());
    let _ = terms.seen();
    plain.stop().await;
}

/// S13 in coordinated election: the coordinator gives the Lease to an identity (holder, no
/// `acquireTime`), and of two processes given that identity only the one whose take-up wrote
/// first leads; the other never takes up a Lease already taken up, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_of_one_identity_never_both_take_up_the_lease() {
    let api = KubeApiServer::start().await;
    api.start_coordinator();
    let terms = Terms::start();
    let mut first = Candidate::start(coordinated(&api, "jobs", "same", "1.2.0"));
    terms.add("first", &first);
    let token = leads(&mut first).await;
    let second = Candidate::start(coordinated(&api, "jobs", "same", "1.2.0"));
    terms.add("second", &second);
    sleep(ELECTION / 3).await;
    assert!(
        second.leading_token().is_none(),
        "two processes of one identity lead"
    );
    assert_eq!(
        first.leading_token(),
        Some(token),
        "the first keeps its term"
    );
    let _ = terms.seen();
    first.stop().await;
    second.stop().await;
}

/// A plain holder keeps the Lease until a coordinated candidate appears; then the coordinator
/// asks it to step down (preferredHolder) and it hands over through the planned handover.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plain_holder_hands_over_to_the_coordinated_candidate() {
    let api = KubeApiServer::start().await;
    api.start_coordinator();
    let terms = Terms::start();
    let mut plain = Candidate::start(plain(&api, "jobs", "plain"));
    terms.add("plain", &plain);
    let first = plain.wait_leading(Duration::from_secs(5)).await;
    sleep(Duration::from_millis(100)).await;
    let mut coordinated = Candidate::start(coordinated(&api, "jobs", "coordinated", "2.0.0"));
    terms.add("coordinated", &coordinated);
    let second = leads(&mut coordinated).await;
    assert!(second > first, "tokens {first} then {second}");
    assert!(plain.leading_token().is_none());
    // The plain candidate stays a follower behind the coordinated holder.
    sleep(Duration::from_secs(2)).await;
    assert!(coordinated.leading_token() == Some(second));
    assert_eq!(
        terms
            .seen()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["plain", "coordinated"]
    );
    plain.stop().await;
    coordinated.stop().await;
}

/// A Role without the verbs on leasecandidates is reported through the elector's attempts,
/// naming the resource and the verb; versions the API server would refuse fail at build time.
#[tokio::test]
async fn denied_candidates_and_bad_settings_are_clear_errors() {
    let api = KubeApiServer::start().await;
    let record = leader_core::conformance::record("pod-a", 1);
    let reported = async |lock: &LeaseLock| {
        for _ in 0..50 {
            match lock.try_acquire(&record).await {
                Err(err) => return err,
                Ok(_) => sleep(Duration::from_millis(100)).await,
            }
        }
        panic!("nothing reported");
    };
    // A stock cluster serves no coordination.k8s.io/v1beta1: the error says what to turn on.
    let lock = coordinated(&api, "jobs", "pod-a", "1.0.0");
    let err = reported(&lock).await;
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("--runtime-config=coordination.k8s.io/v1beta1=true")
            && message.contains("CoordinatedLeaderElection"),
        "{message}"
    );
    lock.close().await;

    api.serve_lease_candidates();
    api.deny_on("leasecandidates", "get");
    let lock = coordinated(&api, "jobs", "pod-a", "1.0.0");
    let err = reported(&lock).await;
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("leasecandidates.coordination.k8s.io") && message.contains(r#""get""#),
        "{message}"
    );
    lock.close().await;

    for (binary, emulation) in [
        ("1.2", "1.2"),
        ("1.2.0", "1.3.0"),
        ("v1.2.0", "1.2.0"),
        ("1.2.0", "0.0.0"),
        ("", "1.2.0"),
        ("1.2.0-rc.2", "1.2.0-rc.10"),
    ] {
        let built = LeaseLock::new(client(&api), "default", "jobs", "pod-a")
            .expect("valid names")
            .coordinated(Coordination::oldest_emulation_version(binary, emulation));
        assert!(
            matches!(built, Err(LockError::Misconfigured { .. })),
            "{binary} {emulation}"
        );
    }
    let built = LeaseLock::new(client(&api), "default", "jobs", "pod/a")
        .expect("valid names")
        .coordinated(Coordination::oldest_emulation_version("1.0.0", "1.0.0"));
    assert!(matches!(built, Err(LockError::Misconfigured { .. })));
    for strategy in ["by-zone", "example.com/-by-zone", "a/b/c"] {
        let built = LeaseLock::new(client(&api), "default", "jobs", "pod-a")
            .expect("valid names")
            .coordinated(Coordination::with_strategy(strategy, "1.0.0", ""));
        assert!(
            matches!(built, Err(LockError::Misconfigured { .. })),
            "{strategy}"
        );
    }
    let built = LeaseLock::new(client(&api), "default", "jobs", "pod-a")
        .expect("valid names")
        .coordinated(Coordination::with_strategy("example.com/by-zone", "", ""));
    assert!(
        matches!(built, Err(LockError::Misconfigured { .. })),
        "binaryVersion is required"
    );
    LeaseLock::new(client(&api), "default", "jobs", "pod-a")
        .expect("valid names")
        .coordinated(Coordination::oldest_emulation_version(
            "1.2.0+build-1",
            "1.2.0-rc.1",
        ))
        .expect("build metadata and pre-releases as semantic versions");
    LeaseLock::new(client(&api), "default", "jobs", "pod-a")
        .expect("valid names")
        .coordinated(Coordination::with_strategy(
            "example.com/by-zone",
            "1.0.0",
            "",
        ))
        .expect("a qualified strategy without emulation version");
}

/// A coordinated leader that crashes (no release) and starts again under its Pod name, the
/// oldest version still: the coordinator elects the same identity again and writes nothing
/// (an expired Lease is rewritten only for *another* holder), so the new process takes the
/// Lease back itself, once it stayed unrenewed for a lease, with a higher token; and a
/// second process of another identity never leads beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_leader_takes_back_the_lease_the_coordinator_leaves_it() {
    let api = KubeApiServer::start().await;
    api.start_coordinator();
    let terms = Terms::start();
    let mut first = Candidate::start(coordinated(&api, "jobs", "pod-a", "1.2.0"));
    terms.add("first", &first);
    let token = leads(&mut first).await;
    let other = Candidate::start(coordinated(&api, "jobs", "pod-b", "1.3.0"));
    terms.add("other", &other);
    first.task.abort();
    let crashed = Instant::now();
    let mut again = Candidate::start(coordinated(&api, "jobs", "pod-a", "1.2.0"));
    terms.add("again", &again);
    let taken = leads(&mut again).await;
    assert!(taken > token, "tokens {token} then {taken}");
    assert!(
        crashed.elapsed() >= leader_core::background::LEASE,
        "the restarted process took the crashed one's term {:?} after the crash",
        crashed.elapsed()
    );
    assert!(other.leading_token().is_none());
    let _ = terms.seen();
    again.stop().await;
    other.stop().await;
}
