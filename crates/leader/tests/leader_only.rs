//! `LeaderOnlyLayer` in a real axum `Router`, asked by a real HTTP client (reqwest), through a
//! leadership change on a memory lock: the leader answers, the others answer 503 with
//! `Retry-After` and name the leader, a request cut short by the end of the term gets the 503
//! too, and never runs beside the next leader's term.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::{get, post};
use axum::{Extension, Router};
use leader::{
    CancellationToken, LeaderElector, LeaderOnlyLayer, LeaderState, LeaderView, Leadership,
    MemoryStore,
};
use leader_test_support::Candidate;
use tokio::sync::watch;
use tokio::time::{Instant, sleep, timeout};

const RETRY: Duration = Duration::from_millis(300);

/// When each request to `/slow` ended (its future dropped).
#[derive(Clone, Default)]
struct Times(Arc<Mutex<Vec<Instant>>>);

impl Times {
    fn push(&self) {
        self.0.lock().unwrap().push(Instant::now());
    }

    fn all(&self) -> Vec<Instant> {
        self.0.lock().unwrap().clone()
    }
}

/// Sets the time when dropped: the end of a request's handler, however it ends.
struct EndOfRequest(Times);

impl Drop for EndOfRequest {
    fn drop(&mut self) {
        self.0.push();
    }
}

struct Replica {
    url: String,
    state: watch::Receiver<LeaderState>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), leader::ElectionError>>,
    slow_ended: Times,
}

impl Replica {
    async fn start(store: &MemoryStore, identity: &str) -> Self {
        let elector = LeaderElector::builder(store.lock("webhooks", identity))
            .name("webhooks")
            .lease_duration(RETRY * 10)
            .renew_deadline(RETRY * 5)
            .retry_period(RETRY)
            .build()
            .expect("valid timings");
        let slow_ended = Times::default();
        let ended = slow_ended.clone();
        let app = Router::new()
            .route(
                "/hook",
                post(|Extension(term): Extension<Leadership>| async move {
                    term.fencing_token().to_string()
                }),
            )
            .route(
                "/slow",
                get(move || {
                    let guard = EndOfRequest(ended.clone());
                    async move {
                        let _guard = guard;
                        std::future::pending::<String>().await
                    }
                }),
            )
            .route_layer(LeaderOnlyLayer::new(&elector))
            .route("/open", get(|| async { "open to every replica" }));
        let url = common::serve(app).await;
        let Candidate {
            state,
            shutdown,
            task,
            ..
        } = Candidate::run(elector);
        Self {
            url,
            state,
            shutdown,
            task,
            slow_ended,
        }
    }

    fn leadership(&self) -> Option<Leadership> {
        self.state.borrow().leadership().cloned()
    }

    async fn wait_leading(&mut self) -> Leadership {
        timeout(RETRY * 10, self.state.wait_for(LeaderState::is_leading))
            .await
            .expect("leads in time")
            .expect("elector alive");
        self.leadership().expect("leading")
    }
}

/// A 503 as the layer answers it: `Retry-After` and the view, as JSON.
async fn refused(response: reqwest::Response) -> (String, LeaderView) {
    assert_eq!(response.status(), 503);
    let retry_after = response
        .headers()
        .get("retry-after")
        .expect("Retry-After on a 503")
        .to_str()
        .expect("text")
        .to_owned();
    assert_eq!(
        response.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/json"[..])
    );
    let view: LeaderView =
        serde_json::from_str(&response.text().await.expect("body")).expect("the JSON view");
    (retry_after, view)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_answers_through_a_leadership_change() {
    let http = common::client();
    let store = MemoryStore::new();
    let mut a = Replica::start(&store, "a").await;
    let first = a.wait_leading().await.fencing_token();
    let mut b = Replica::start(&store, "b").await;
    sleep(RETRY * 2).await;

    let hook = |replica: &Replica| http.post(format!("{}/hook", replica.url)).send();
    let answer = hook(&a).await.expect("a answers");
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.text().await.expect("body"), first.to_string());
    let (retry_after, view) = refused(hook(&b).await.expect("b answers")).await;
    assert_eq!(retry_after, "1", "the retry period, in whole seconds");
    assert!(!view.leading);
    assert_eq!(view.identity, "b");
    assert_eq!(view.leader.as_deref(), Some("a"));
    assert_eq!(view.fencing_token, Some(first));
    let open = http
        .get(format!("{}/open", b.url))
        .send()
        .await
        .expect("open route");
    assert_eq!(open.status(), 200, "routes outside the layer answer anyway");

    // A request in flight on the leader when its term ends: cut short with the 503, before the
    // lease is released, so it never runs beside the next leader's term.
    let slow = tokio::spawn(http.get(format!("{}/slow", a.url)).send());
    sleep(RETRY).await;
    assert!(a.slow_ended.all().is_empty(), "the request runs");
    a.leadership()
        .expect("a leads")
        .step_down()
        .expect("a step-down");
    let cut = timeout(RETRY * 5, slow)
        .await
        .expect("answered when the term ends")
        .expect("task")
        .expect("a answer");
    let (_, view) = refused(cut).await;
    assert!(!view.leading);
    let next = b.wait_leading().await;
    let second = next.fencing_token();
    assert!(second > first);
    let ended = a.slow_ended.all();
    assert_eq!(ended.len(), 1);
    assert!(
        ended[0] < next.acquired_at(),
        "the old leader's request ended before the next term began"
    );
    drop(next);

    let answer = hook(&b).await.expect("b answers");
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.text().await.expect("body"), second.to_string());
    // a stands back for its longest retry wait after its step-down, then sees b's term.
    sleep(RETRY * 3).await;
    let (_, view) = refused(hook(&a).await.expect("a answers")).await;
    assert_eq!(view.identity, "a");
    assert_eq!(view.leader.as_deref(), Some("b"));
    assert_eq!(view.fencing_token, Some(second));

    // Nobody leads once both stopped: 503 naming no one, Retry-After still there.
    for replica in [&a, &b] {
        replica.shutdown.cancel();
    }
    let (a_url, b_url) = (a.url.clone(), b.url.clone());
    a.task.await.expect("a stops").expect("a ran");
    b.task.await.expect("b stops").expect("b ran");
    for url in [a_url, b_url] {
        let response = http
            .post(format!("{url}/hook"))
            .send()
            .await
            .expect("answer");
        let (retry_after, view) = refused(response).await;
        assert_eq!(retry_after, "1");
        assert_eq!(view.leader, None);
    }
}

#[tokio::test]
async fn retry_after_is_in_whole_seconds_rounded_up() {
    let http = common::client();
    let elector = LeaderElector::builder(MemoryStore::new().lock("webhooks", "a"))
        .build()
        .expect("defaults");
    let app = Router::new()
        .route("/hook", post(|| async { "leading" }))
        .route_layer(LeaderOnlyLayer::new(&elector).retry_after(Duration::from_millis(2500)));
    let url = format!("{}/hook", common::serve(app).await);
    // The elector is not running: nobody leads.
    let (retry_after, view) = refused(http.post(&url).send().await.expect("answer")).await;
    assert_eq!(retry_after, "3");
    assert_eq!((view.leading, view.leader), (false, None));
}
