//! The Lease lock against the test API server: client-go's field layout, odd Leases, retries,
//! RBAC denials, events, watch handover, several electors. (`fidelity.rs` holds the tests that
//! also run against a real cluster.)

mod common;

use std::time::Duration;

use common::{Factory, KubeApiServer, client};
use leader_core::background::Candidate;
use leader_core::conformance::{self, record};
use leader_core::faults::{Faults, FaultyLock};
use leader_core::{LeaderElector, LockError, ResourceLock};
use leader_kube::LeaseLock;
use serde_json::json;
use tokio::time::{Instant, sleep};

/// Writes Lease `name` in namespace `default` with `spec`, as another client would.
fn put_lease(api: &KubeApiServer, name: &str, spec: serde_json::Value) {
    api.put_raw(
        "default",
        name,
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": name, "namespace": "default"}, "spec": spec}),
    );
}

/// A lock on Lease `name` in namespace `default` for `identity`.
fn lease_lock(api: &KubeApiServer, name: &str, identity: &str) -> LeaseLock {
    LeaseLock::new(client(api), "default", name, identity).expect("valid names")
}

/// `rust-1` leading on Lease `name` with a 6 s lease, through a client the lock builds
/// itself, which leaves retries to the elector (a client of kube-rs's defaults retries a 429
/// or a 503 itself), and the handle of the lock's requests.
async fn leading_on_own_client(api: &KubeApiServer, name: &str) -> (Candidate, Faults) {
    let lock = LeaseLock::from_config(
        kube::Config::new(api.url().parse().expect("url")),
        "default",
        name,
        "rust-1",
        Duration::from_secs(3),
    )
    .expect("client");
    let lock = FaultyLock::new(lock);
    let faults = lock.faults();
    let mut elector = Candidate::build(
        LeaderElector::builder(lock)
            .lease_duration(Duration::from_secs(6))
            .renew_deadline(Duration::from_secs(4))
            .retry_period(Duration::from_millis(500)),
    );
    elector.wait_leading(Duration::from_secs(5)).await;
    (elector, faults)
}

/// Two and ten electors each elect exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_conform() {
    let api = KubeApiServer::start().await;
    conformance::electors(&Factory { api }, false).await;
}

/// A Lease as client-go's LeaseLock writes it reads back field for field, and ours is written in
/// the same layout (whole seconds rounded up, microsecond times), so both can contend.
#[tokio::test]
async fn leases_use_client_gos_field_layout() {
    let api = KubeApiServer::start().await;
    for (name, spec) in [
        (
            "cg",
            json!({
            "holderIdentity": "client-go-7f9c", "leaseDurationSeconds": 15,
            "acquireTime": "2026-11-21T10:00:00.000000Z", "renewTime": "2026-11-21T10:00:05.123456Z",
            "leaseTransitions": 3}),
        ),
        // client-go's release: an empty holder and a 1 s lease.
        (
            "released",
            json!({
            "holderIdentity": "", "leaseDurationSeconds": 1,
            "acquireTime": "2026-11-21T10:00:00.000000Z", "renewTime": "2026-11-21T10:00:00.000000Z",
            "leaseTransitions": 4}),
        ),
    ] {
        put_lease(&api, name, spec);
    }
    let lock = lease_lock(&api, "cg", "rust-1");
    let observed = lock.get().await.expect("get").expect("lease");
    assert_eq!(observed.record.holder_identity, "client-go-7f9c");
    assert_eq!(observed.record.lease_duration, Duration::from_secs(15));
    assert_eq!(observed.record.leader_transitions, 3);
    assert_eq!(
        observed.record.acquire_time.to_rfc3339(),
        "2026-11-21T10:00:00+00:00"
    );
    assert_eq!(
        observed.record.renew_time.timestamp_subsec_micros(),
        123_456
    );

    let released = lease_lock(&api, "released", "rust-1");
    assert!(
        released
            .get()
            .await
            .expect("get")
            .expect("lease")
            .record
            .is_free()
    );

    // Ours: 1.5 s is written as 2 s, never 1; times with microseconds; transitions counted as
    // client-go counts them (0 on create), our fencing token in the annotation.
    let mut ours = record("rust-1", 5);
    ours.lease_duration = Duration::from_millis(1500);
    let fresh = lease_lock(&api, "ours", "rust-1");
    let created = fresh.create(&ours).await.expect("create");
    assert_eq!(created.record.leader_transitions, 5);
    let stored = api.lease("default", "ours").expect("stored");
    let spec = &stored["spec"];
    assert_eq!(spec["holderIdentity"], "rust-1");
    assert_eq!(spec["leaseDurationSeconds"], 2);
    assert_eq!(spec["leaseTransitions"], 0);
    assert_eq!(
        stored["metadata"]["annotations"][leader_kube::FENCING_TOKEN_ANNOTATION],
        "5"
    );
    let renew = spec["renewTime"].as_str().expect("renewTime");
    assert!(
        renew.ends_with('Z') && renew.split('.').nth(1).is_some_and(|f| f.len() == 7),
        "{renew}"
    );
}

/// S8: Leases the real API accepts and other clients write, with a holder but no
/// `leaseDurationSeconds`, or a `renewTime` before the `acquireTime` (a holder whose clock
/// stepped back), are read as client-go reads them, and an elector takes them over: at once for
/// the missing duration, after the lease for the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_with_odd_values_are_read_and_taken_over() {
    let api = KubeApiServer::start().await;
    for (name, spec, within) in [
        (
            "no-duration",
            json!({"holderIdentity": "gone", "leaseTransitions": 2}),
            Duration::from_secs(3),
        ),
        (
            "stepped-back",
            json!({"holderIdentity": "gone", "leaseDurationSeconds": 1,
                "acquireTime": "2026-11-21T10:00:05.000000Z", "renewTime": "2026-11-21T10:00:00.000000Z",
                "leaseTransitions": 2}),
            Duration::from_secs(4),
        ),
    ] {
        put_lease(&api, name, spec);
        let lock = lease_lock(&api, name, "rust-1");
        let observed = lock
            .get()
            .await
            .expect("an odd Lease is readable")
            .expect("lease");
        assert_eq!(observed.record.holder_identity, "gone", "{name}");
        let mut elector = Candidate::start(lock);
        let token = elector.wait_leading(within).await;
        assert!(token > 2, "{name}: token {token}");
        elector.stop().await;
    }
}

/// 429, 500, 503 and 504 each fail one renewal, in one request: the client retries nothing
/// itself (kube-rs's default would send up to fifteen from 5 ms apart, a burst at a server
/// shedding load); the elector renews again a retry period later, and the leader keeps its
/// lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_and_failed_renewals_are_retried_by_the_elector_alone() {
    let api = KubeApiServer::start().await;
    let (elector, calls) = leading_on_own_client(&api, "busy").await;
    let token = elector.leading_token();
    let failed_renewals = || {
        calls
            .calls()
            .iter()
            .filter(|c| c.operation == "renew" && c.ok == Some(false))
            .count()
    };
    for (round, code) in [429, 500, 503, 504].into_iter().enumerate() {
        api.reject_writes(&[code, code]);
        sleep(Duration::from_millis(1500)).await;
        assert_eq!(api.rejections_left(), 0, "{code}: both met");
        assert_eq!(
            failed_renewals(),
            2 * (round + 1),
            "{code}: each rejection fails one renewal: {:?}",
            calls.calls()
        );
    }
    assert_eq!(elector.leading_token(), token, "the leader kept its term");
    elector.shutdown.cancel();
}

/// A release at shutdown that the API server throttles (a 429 from priority and fairness, or a
/// 503) is sent again, so the Lease is left free for the others rather than to expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_release_is_sent_again() {
    let api = KubeApiServer::start().await;
    for (round, code) in [429, 503].into_iter().enumerate() {
        let name = format!("throttled-release-{round}");
        let (elector, calls) = leading_on_own_client(&api, &name).await;
        api.reject_writes(&[code]);
        let stopped = elector.stop().await;
        assert_eq!(api.rejections_left(), 0, "{code}: the release met it");
        assert!(stopped[0].released, "{code}: {stopped:?}");
        let lease = lease_lock(&api, &name, "reader")
            .get()
            .await
            .expect("read the Lease")
            .expect("the Lease exists");
        assert!(lease.record.is_free(), "{code}: {:?}", lease.record);
        // The release met the rejection, not a renewal: refused, then sent again.
        let writes: Vec<_> = calls
            .calls()
            .into_iter()
            .filter(|c| c.operation != "get")
            .map(|c| (c.operation, c.ok))
            .collect();
        assert_eq!(
            writes[writes.len() - 2..],
            [("update", Some(false)), ("update", Some(true))],
            "{code}: {writes:?}"
        );
    }
}

/// A Role without a verb yields a Forbidden error that names the verb to add.
#[tokio::test]
async fn a_denied_verb_is_a_clear_error_naming_it() {
    let api = KubeApiServer::start().await;
    let lock = lease_lock(&api, "rbac", "a");
    api.deny("create");
    let err = lock
        .create(&record("a", 1))
        .await
        .expect_err("create is denied");
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains(r#"verb "create""#) && message.contains("leases.coordination.k8s.io"),
        "{message}"
    );
    api.allow("create");
    let created = lock.create(&record("a", 1)).await.expect("create");
    api.deny("update");
    let err = lock
        .update(&created.version, &record("a", 1))
        .await
        .expect_err("update is denied");
    assert!(err.to_string().contains(r#"verb "update""#), "{err}");

    // The elector keeps running on a denied verb and leads once the Role allows it.
    api.deny("get");
    let mut elector = Candidate::build(
        LeaderElector::builder(lease_lock(&api, "rbac-elector", "a"))
            .lease_duration(Duration::from_secs(3))
            .renew_deadline(Duration::from_secs(2))
            .retry_period(Duration::from_millis(300)),
    );
    elector
        .stays_alive_without_leading(Duration::from_secs(1))
        .await;
    api.allow("get");
    api.allow("update");
    elector.wait_leading(Duration::from_secs(5)).await;
    elector.stop().await;
}

/// "became leader" and "stopped leading" are recorded as Events on the Lease; followers take over
/// a released Lease at once through their watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_recorded_and_a_release_is_taken_over_at_once() {
    let api = KubeApiServer::start().await;
    let start = |id: &str| {
        Candidate::build(
            LeaderElector::builder(lease_lock(&api, "handover", id))
                .lease_duration(Duration::from_secs(8))
                .renew_deadline(Duration::from_secs(6))
                .retry_period(Duration::from_secs(2)),
        )
    };
    let mut first = start("first");
    first.wait_leading(Duration::from_secs(5)).await;
    let mut second = start("second");
    sleep(Duration::from_millis(500)).await;
    let released = Instant::now();
    first.stop().await;
    second.wait_leading(Duration::from_secs(2)).await;
    let took = released.elapsed();
    eprintln!("handover after release took {took:?}");
    assert!(took < Duration::from_millis(500), "handover took {took:?}");
    second.stop().await;
    sleep(Duration::from_millis(200)).await; // events are sent in the background
    let events = api.events();
    let messages: Vec<&str> = events
        .iter()
        .filter_map(|e| e["message"].as_str())
        .collect();
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("first became leader")),
        "{messages:?}"
    );
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("first stopped leading")),
        "{messages:?}"
    );
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("second became leader")),
        "{messages:?}"
    );
    assert!(events.iter().all(
        |e| e["involvedObject"]["kind"] == "Lease" && e["involvedObject"]["name"] == "handover"
    ));
}
