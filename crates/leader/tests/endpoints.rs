//! `LeaderEndpointsLayer` on a real axum `Router`, asked by a real HTTP client (reqwest): the
//! leader answers `/leader` with 200 and its view, a follower 503 naming the leader; `/readyz`
//! and `/healthz` answer on both, `/readyz` fails on a follower when asked to and on a replica
//! the store no longer answers; every other request reaches the application.

mod common;

use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use leader::faults::{Fault, FaultyLock};
use leader::{
    CancellationToken, LeaderElector, LeaderEndpointsLayer, LeaderState, LeaderView, MemoryStore,
};
use leader_test_support::Candidate;
use tokio::time::timeout;

const RETRY: Duration = Duration::from_millis(100);

struct Replica {
    url: String,
    state: tokio::sync::watch::Receiver<LeaderState>,
    shutdown: CancellationToken,
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn start<L: leader::ResourceLock + 'static>(lock: L, only_leading: bool) -> Replica {
    let elector = LeaderElector::builder(lock)
        .name("reports")
        .lease_duration(RETRY * 5)
        .renew_deadline(RETRY * 3)
        .retry_period(RETRY)
        .build()
        .expect("valid timings");
    let endpoints = LeaderEndpointsLayer::with_health(&elector, elector.health_check(RETRY))
        .ready_only_while_leading(only_leading);
    let app = Router::new()
        .route("/", get(|| async { "the application" }))
        .route("/leader/history", get(|| async { "the application's own" }))
        .route("/submit", post(|| async { "submitted" }))
        .layer(endpoints);
    let url = common::serve(app).await;
    let Candidate {
        state, shutdown, ..
    } = Candidate::run(elector);
    Replica {
        url,
        state,
        shutdown,
    }
}

async fn get_text(http: &reqwest::Client, url: &str) -> (u16, String) {
    let response = http.get(url).send().await.expect("request");
    let code = response.status().as_u16();
    (code, response.text().await.expect("body"))
}

async fn view(http: &reqwest::Client, replica: &Replica) -> (u16, LeaderView) {
    let response = http
        .get(format!("{}/leader", replica.url))
        .send()
        .await
        .expect("request");
    let code = response.status().as_u16();
    assert_eq!(
        response.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/json"[..])
    );
    assert_eq!(
        response
            .headers()
            .get("cache-control")
            .map(|v| v.as_bytes()),
        Some(&b"no-store"[..])
    );
    let text = response.text().await.expect("body");
    (code, serde_json::from_str(&text).expect("the JSON view"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoints_answer_in_front_of_the_application() {
    let http = common::client();
    let store = MemoryStore::new();
    let mut a = start(store.lock("reports", "a"), false).await;
    timeout(RETRY * 20, a.state.wait_for(LeaderState::is_leading))
        .await
        .expect("a leads in time")
        .expect("elector alive");
    let mut b = start(store.lock("reports", "b"), true).await;
    timeout(
        RETRY * 20,
        b.state
            .wait_for(|s| matches!(s, LeaderState::Following { .. })),
    )
    .await
    .expect("b follows in time")
    .expect("elector alive");

    // Who leads: 200 on the leader, 503 on the follower, both naming a.
    let (code, seen) = view(&http, &a).await;
    assert_eq!(code, 200);
    assert!(seen.leading);
    assert_eq!(seen.leader.as_deref(), Some("a"));
    assert_eq!(seen.name, "reports");
    let (code, seen) = view(&http, &b).await;
    assert_eq!(code, 503);
    assert!(!seen.leading);
    assert_eq!(seen.leader.as_deref(), Some("a"));

    // The probes: both live; a ready, b not ready only because it was asked to be ready only
    // while leading.
    assert_eq!(
        get_text(&http, &format!("{}/healthz", a.url)).await,
        (200, "ok".into())
    );
    assert_eq!(
        get_text(&http, &format!("{}/healthz", b.url)).await,
        (200, "ok".into())
    );
    assert_eq!(
        get_text(&http, &format!("{}/readyz", a.url)).await,
        (200, "ok".into())
    );
    let (code, text) = get_text(&http, &format!("{}/readyz", b.url)).await;
    assert_eq!(code, 503);
    assert!(
        text.contains("not leading") && text.contains("the leader: a"),
        "{text}"
    );

    // Everything else is the application's: its routes, other methods, other paths.
    assert_eq!(
        get_text(&http, &format!("{}/", b.url)).await,
        (200, "the application".into())
    );
    assert_eq!(
        get_text(&http, &format!("{}/leader/history", a.url)).await,
        (200, "the application's own".into())
    );
    let posted = http
        .post(format!("{}/submit", a.url))
        .send()
        .await
        .expect("request");
    assert_eq!(posted.status(), 200);
    let posted = http
        .post(format!("{}/leader", a.url))
        .send()
        .await
        .expect("request");
    assert_eq!(
        posted.status(),
        404,
        "a POST to /leader is the application's"
    );
    assert_eq!(get_text(&http, &format!("{}/nowhere", a.url)).await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_fails_on_a_replica_the_store_no_longer_answers() {
    let http = common::client();
    let store = MemoryStore::new();
    let lock = FaultyLock::new(store.lock("reports", "a"));
    let faults = lock.faults();
    let mut a = start(lock, false).await;
    timeout(RETRY * 20, a.state.wait_for(LeaderState::is_leading))
        .await
        .expect("a leads in time")
        .expect("elector alive");
    assert_eq!(get_text(&http, &format!("{}/readyz", a.url)).await.0, 200);

    // The store stops answering: the term ends by its renew deadline, and once a lease and the
    // tolerance have passed without an answer, the replica is not ready, saying why.
    faults.fail_all(Some(Fault::Unavailable));
    let mut text = String::new();
    for _ in 0..50 {
        let (code, body) = get_text(&http, &format!("{}/readyz", a.url)).await;
        if code == 503 {
            text = body;
            break;
        }
        tokio::time::sleep(RETRY).await;
    }
    assert!(text.contains("has not answered"), "never unready: {text:?}");
    assert_eq!(
        get_text(&http, &format!("{}/healthz", a.url)).await.0,
        200,
        "a replica that stepped down is live"
    );
    let (code, seen) = view(&http, &a).await;
    assert_eq!(code, 503);
    assert!(!seen.leading);

    // The store answers again: ready again.
    faults.fail_all(None);
    let mut code = 0;
    for _ in 0..50 {
        code = get_text(&http, &format!("{}/readyz", a.url)).await.0;
        if code == 200 {
            break;
        }
        tokio::time::sleep(RETRY).await;
    }
    assert_eq!(code, 200, "ready again once the store answers");
}

/// The paths are the application's: moved, or turned off so that the application's own
/// `/healthz` answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_application_chooses_the_paths() {
    let elector = LeaderElector::builder(MemoryStore::new().lock("paths", "a"))
        .name("paths")
        .lease_duration(RETRY * 5)
        .renew_deadline(RETRY * 3)
        .retry_period(RETRY)
        .build()
        .expect("valid timings");
    let endpoints = LeaderEndpointsLayer::new(&elector)
        .leader_path(Some("/-/leader"))
        .ready_path(Some("/-/ready"))
        .health_path(None);
    let app = Router::new()
        .route("/healthz", get(|| async { "the application's own health" }))
        .route("/leader", get(|| async { "the application's leader page" }))
        .layer(endpoints);
    let url = common::serve(app).await;
    let Candidate {
        mut state,
        shutdown,
        ..
    } = Candidate::run(elector);
    timeout(
        Duration::from_secs(5),
        state.wait_for(LeaderState::is_leading),
    )
    .await
    .expect("leads in time")
    .expect("running");
    let http = common::client();
    assert_eq!(
        get_text(&http, &format!("{url}/healthz")).await,
        (200, "the application's own health".to_owned())
    );
    assert_eq!(
        get_text(&http, &format!("{url}/leader")).await,
        (200, "the application's leader page".to_owned())
    );
    let (code, body) = get_text(&http, &format!("{url}/-/leader")).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"leading\":true"), "{body}");
    assert_eq!(
        get_text(&http, &format!("{url}/-/ready")).await,
        (200, "ok".to_owned())
    );
    shutdown.cancel();
}
