//! A host whose wall clock is off by an hour, or steps an hour under a running term (S14: a
//! wall clock's step never changes who leads). DynamoDB refuses a request signed more than five
//! minutes from its own time (`InvalidSignatureException`, "Signature expired"); the test server
//! checks no signature's time, so a proxy in front of it refuses such requests as DynamoDB does
//! and dates its answers by this machine's clock. The store's SDK configuration reads a wall
//! clock the test steps.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use aws_smithy_async::time::TimeSource;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{NaiveDateTime, Utc};
use leader_test_support::{Candidate, RETRY, STEADY_RENEW, started_leading};

use common::proxy::{post, respond, store_through, upstream};

/// The wall clock of the host the store runs on: this machine's, off by `offset` seconds.
#[derive(Debug, Clone, Default)]
struct HostClock(Arc<AtomicI64>);

impl HostClock {
    fn step(&self, seconds: i64) {
        self.0.store(seconds, Ordering::SeqCst);
    }
}

impl TimeSource for HostClock {
    fn now(&self) -> SystemTime {
        let offset = self.0.load(Ordering::SeqCst);
        let by = Duration::from_secs(offset.unsigned_abs());
        if offset >= 0 {
            SystemTime::now() + by
        } else {
            SystemTime::now() - by
        }
    }
}

/// The proxy's state: the test server's `host:port`, and how many requests it refused.
struct Signatures {
    upstream: String,
    refused: AtomicUsize,
}

async fn forward(
    State(signatures): State<Arc<Signatures>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let now = Utc::now().naive_utc();
    let signed = headers
        .get("x-amz-date")
        .and_then(|date| date.to_str().ok())
        .and_then(|date| NaiveDateTime::parse_from_str(date, "%Y%m%dT%H%M%SZ").ok());
    let date = [(
        "date".to_owned(),
        Utc::now().format("%a, %d %b %Y %H:%M:%S GMT").to_string(),
    )];
    if signed.is_none_or(|signed| (signed - now).abs() > chrono::TimeDelta::minutes(5)) {
        signatures.refused.fetch_add(1, Ordering::SeqCst);
        let answer = serde_json::json!({
            "__type": "com.amazon.coral.service#InvalidSignatureException",
            "message": format!("Signature expired: {signed:?} is now earlier or later than {now} +/- 5 min."),
        });
        let mut headers = date.to_vec();
        headers.push((
            "content-type".to_owned(),
            "application/x-amz-json-1.0".to_owned(),
        ));
        return respond(
            400,
            &headers,
            serde_json::to_vec(&answer).expect("json").into(),
        );
    }
    let Some((status, mut answer_headers, bytes)) =
        post(&signatures.upstream, &headers, &body).await
    else {
        return StatusCode::BAD_GATEWAY.into_response();
    };
    answer_headers.retain(|(name, _)| !name.eq_ignore_ascii_case("date"));
    answer_headers.extend(date);
    respond(status, &answer_headers, bytes)
}

/// A store on a new table through the proxy, whose SDK reads `clock`, with its table created
/// and checked; `None` (a skip) without a test server.
async fn store_on_host(
    clock: &HostClock,
) -> Option<(leader_dynamodb::DynamoStore, Arc<Signatures>)> {
    let table = common::table_or_skip()?;
    let signatures = Arc::new(Signatures {
        upstream: upstream(),
        refused: AtomicUsize::new(0),
    });
    let app = axum::Router::new()
        .fallback(forward)
        .with_state(signatures.clone());
    let host = clock.clone();
    let store = store_through(
        app,
        table,
        |config| config.into_builder().time_source(host).build(),
        |store| store,
    )
    .await;
    store.check_table().await.expect("the test table");
    Some((store, signatures))
}

/// A host an hour ahead leads: the request whose answer told the skew is refused, and every
/// request after it is signed by the server's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_an_hour_ahead_leads() {
    let clock = HostClock::default();
    let Some((store, signatures)) = store_on_host(&clock).await else {
        return;
    };
    clock.step(3600);
    let (leader, _) = started_leading(store.lock("ahead", "a")).await;
    let refused = signatures.refused.load(Ordering::SeqCst);
    assert!(
        (1..=2).contains(&refused),
        "{refused} requests refused for a clock an hour ahead"
    );
    leader.stop().await;
}

/// A leader whose host's clock steps back an hour, then forward an hour, keeps its term: one
/// renewal is refused at each step, and the next is signed by the server's time. With the
/// steady timings: with the short ones (a 2 s renew deadline) a refused renewal beside a test
/// server slowed by the machine's load ended the term, which this test does not check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_keeps_its_term_across_steps_of_its_hosts_clock() {
    let clock = HostClock::default();
    let Some((store, signatures)) = store_on_host(&clock).await else {
        return;
    };
    let mut leader = Candidate::start_steady(store.lock("stepped", "a"), RETRY);
    let token = leader.wait_leading(Duration::from_secs(10)).await;
    for step in [-3600, 3600] {
        clock.step(step);
        keeps_leading(&leader, token).await;
    }
    let refused = signatures.refused.load(Ordering::SeqCst);
    assert!(
        (1..=4).contains(&refused),
        "{refused} requests refused across two steps"
    );
    leader.stop().await;
}

/// `leader` leads in term `token` throughout a few renew deadlines.
async fn keeps_leading(leader: &Candidate, token: u64) {
    let until = tokio::time::Instant::now() + STEADY_RENEW * 3;
    while tokio::time::Instant::now() < until {
        assert_eq!(leader.leading_token(), Some(token), "the term ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
