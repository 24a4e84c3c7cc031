//! A shard set's reads of a throttled table. DynamoDB answers a `BatchGetItem` it cannot serve
//! in full with the items it read and the keys it did not (`UnprocessedKeys`); when it read none
//! it fails the request instead (`ProvisionedThroughputExceededException`). Its reference asks
//! the client to send the unprocessed keys again after an exponential back-off: asked again at
//! once, the table stays throttled. A proxy in front of the test server answers as a throttled
//! table does: of each `BatchGetItem` it passes on the first key alone and returns the others
//! unprocessed, for as many answers as the test says.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use leader_core::{LeaderElectionRecord, LockError, LockSet};
use serde_json::Value;

use common::proxy::{post, respond};

const BATCH_GET: &str = "DynamoDB_20120810.BatchGetItem";

/// The proxy's state: where it forwards to, how many `BatchGetItem` answers it still throttles,
/// and how many it received.
struct Throttle {
    /// The test server's `host:port`.
    upstream: String,
    throttled_answers: AtomicUsize,
    batch_gets: AtomicUsize,
}

/// Starts the proxy in front of the test server; its URL.
async fn start(throttle: Arc<Throttle>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port for the proxy");
    let url = format!("http://{}", listener.local_addr().expect("its address"));
    let app = axum::Router::new().fallback(forward).with_state(throttle);
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// The request's keys of its one table, when the proxy throttles it: the request narrowed to
/// the first key, and the table with the keys left unprocessed.
fn narrow(body: &Bytes) -> Option<(Bytes, String, Value)> {
    let mut request: Value = serde_json::from_slice(body).ok()?;
    let items = request.get_mut("RequestItems")?.as_object_mut()?;
    let (table, wanted) = items.iter_mut().next()?;
    let keys = wanted.get_mut("Keys")?.as_array_mut()?;
    if keys.len() < 2 {
        return None;
    }
    let left = keys.split_off(1);
    let mut unprocessed = wanted.clone();
    unprocessed["Keys"] = Value::Array(left);
    let table = table.clone();
    Some((
        Bytes::from(serde_json::to_vec(&request).ok()?),
        table,
        unprocessed,
    ))
}

async fn forward(
    State(throttle): State<Arc<Throttle>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let batch_get = headers
        .get("x-amz-target")
        .is_some_and(|target| target.as_bytes() == BATCH_GET.as_bytes());
    let mut unread = None;
    let mut body = body;
    if batch_get {
        throttle.batch_gets.fetch_add(1, Ordering::SeqCst);
        let throttled = throttle
            .throttled_answers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if throttled && let Some((narrowed, table, unprocessed)) = narrow(&body) {
            body = narrowed;
            unread = Some((table, unprocessed));
        }
    }
    let Some((status, answer_headers, mut bytes)) = post(&throttle.upstream, &headers, &body).await
    else {
        return StatusCode::BAD_GATEWAY.into_response();
    };
    if let Some((table, unprocessed)) = unread
        && let Ok(mut read) = serde_json::from_slice::<Value>(&bytes)
    {
        read["UnprocessedKeys"] = serde_json::json!({ table: unprocessed });
        bytes = serde_json::to_vec(&read).expect("json").into();
    }
    respond(status, &answer_headers, bytes)
}

/// A store on a new table through a proxy that throttles `throttled_answers` `BatchGetItem`
/// answers, with the request timeout `timeout`; `None` (a skip) without a test server.
async fn throttled_store(
    throttled_answers: usize,
    timeout: Duration,
) -> Option<(leader_dynamodb::DynamoStore, Arc<Throttle>)> {
    let table = common::table_or_skip()?;
    let throttle = Arc::new(Throttle {
        upstream: common::endpoint()
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned(),
        throttled_answers: AtomicUsize::new(throttled_answers),
        batch_gets: AtomicUsize::new(0),
    });
    let url = start(throttle.clone()).await;
    let config = common::sdk_config()
        .await
        .into_builder()
        .endpoint_url(url)
        .build();
    let store = leader_dynamodb::DynamoStore::builder(table)
        .sdk_config(config)
        .create_table(true)
        .timeout(timeout)
        .build()
        .await
        .expect("a store through the proxy");
    store.check_table().await.expect("the test table");
    Some((store, throttle))
}

/// A read of a table that stays throttled asks again after waits that double, and fails within
/// its timeout as unavailable: seven requests at most in two seconds, where asking again every 50 ms
/// sent thirty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_read_asks_again_after_waits_that_double() {
    let Some((store, throttle)) = throttled_store(usize::MAX, Duration::from_secs(2)).await else {
        return;
    };
    let set = store.lock_set("reader");
    let keys: Vec<String> = (0..60).map(|i| format!("shard-{i}")).collect();
    let read = set.get_many(&keys).await;
    let sent = throttle.batch_gets.load(Ordering::SeqCst);
    assert_eq!(read.len(), keys.len());
    for answer in &read {
        match answer {
            Err(err @ LockError::Unavailable { .. }) => {
                assert!(
                    err.to_string().contains("unprocessed"),
                    "the error names the keys left unprocessed: {err}"
                );
            }
            other => panic!("a read that stayed throttled ends unavailable, not {other:?}"),
        }
    }
    // Waits of 50, 100, 200 and 400 ms, then 500 ms each (a fifth longer at most): seven
    // requests at most fit in 2 s, fewer when each takes longer on a loaded machine.
    assert!(
        (3..=7).contains(&sent),
        "{sent} BatchGetItem requests within the 2 s timeout of a throttled read"
    );
}

/// A read throttled once asks again for the keys left unprocessed and returns every record, as
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_throttled_once_returns_every_record() {
    let Some((store, throttle)) = throttled_store(1, Duration::from_secs(2)).await else {
        return;
    };
    let set = store.lock_set("reader");
    let keys: Vec<String> = (0..5).map(|i| format!("shard-{i}")).collect();
    for (token, key) in (1..).zip(keys.iter().skip(1)) {
        let record =
            LeaderElectionRecord::new("reader", Duration::from_secs(30), Utc::now(), token);
        set.lock(key)
            .create(&record)
            .await
            .expect("a record written");
    }
    let read = set.get_many(&keys).await;
    assert_eq!(throttle.batch_gets.load(Ordering::SeqCst), 2);
    let tokens: Vec<Option<u64>> = read
        .into_iter()
        .map(|answer| answer.expect("read").map(|o| o.record.leader_transitions))
        .collect();
    assert_eq!(tokens, [None, Some(1), Some(2), Some(3), Some(4)]);
}
