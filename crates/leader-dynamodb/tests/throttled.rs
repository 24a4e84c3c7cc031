//! A throttled table and control plane. DynamoDB answers a `BatchGetItem` it cannot serve in
//! full with the items it read and the keys it did not (`UnprocessedKeys`); when it read none
//! it fails the request instead (`ProvisionedThroughputExceededException`). Its reference asks
//! the client to send the unprocessed keys again after an exponential back-off: asked again at
//! once, the table stays throttled. A `TransactWriteItems` cancelled for one throttled item
//! names the others `None`: sent again at once, they meet the same throttle. And the control
//! plane (`DescribeTable`, which the lock asks at each term's start) has a throttle of its own,
//! which asks clients not to query it excessively. A proxy in front of the test server answers
//! as a throttled table does: of each `BatchGetItem` it passes on the first key alone and
//! returns the others unprocessed, and it cancels `TransactWriteItems` for a throttled first
//! item, for as many answers as the test says; it counts the requests of each kind.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use leader_core::backend::Renewal;
use leader_core::{LeaderElectionRecord, LockError, LockSet, ResourceLock};
use serde_json::Value;

use common::proxy::{post, respond, store_through, upstream};

const BATCH_GET: &str = "DynamoDB_20120810.BatchGetItem";
const TRANSACT_WRITE: &str = "DynamoDB_20120810.TransactWriteItems";
const DESCRIBE_TABLE: &str = "DynamoDB_20120810.DescribeTable";

/// The proxy's state: where it forwards to, how many `BatchGetItem` and `TransactWriteItems`
/// answers it still throttles, and how many requests of each kind it received.
#[derive(Default)]
struct Throttle {
    /// The test server's `host:port`.
    upstream: String,
    throttled_answers: AtomicUsize,
    batch_gets: AtomicUsize,
    cancelled_transactions: AtomicUsize,
    transactions: AtomicUsize,
    describe_tables: AtomicUsize,
}

/// A `TransactWriteItems` of `body` cancelled as DynamoDB cancels one whose first item met a
/// throttle: a reason per item, in order, `None` for the items that met nothing.
fn cancelled(body: &Bytes) -> Response {
    let request: Value = serde_json::from_slice(body).unwrap_or_default();
    let items = request["TransactItems"].as_array().map_or(1, Vec::len);
    let reasons: Vec<Value> = (0..items)
        .map(|i| match i {
            0 => serde_json::json!({
                "Code": "ThrottlingError",
                "Message": "Throughput exceeds the current capacity of your table or index."
            }),
            _ => serde_json::json!({ "Code": "None" }),
        })
        .collect();
    let answer = serde_json::json!({
        "__type": "com.amazonaws.dynamodb.v20120810#TransactionCanceledException",
        "Message": "Transaction cancelled, please refer cancellation reasons for specific reasons",
        "CancellationReasons": reasons,
    });
    let headers = [(
        "content-type".to_owned(),
        "application/x-amz-json-1.0".to_owned(),
    )];
    respond(
        400,
        &headers,
        serde_json::to_vec(&answer).expect("json").into(),
    )
}

/// Takes one of the answers `left` still holds; whether there was one.
fn take_one(left: &AtomicUsize) -> bool {
    left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
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
    let target = headers
        .get("x-amz-target")
        .and_then(|target| target.to_str().ok())
        .unwrap_or_default();
    let mut unread = None;
    let mut body = body;
    if target == DESCRIBE_TABLE {
        throttle.describe_tables.fetch_add(1, Ordering::SeqCst);
    }
    if target == TRANSACT_WRITE {
        throttle.transactions.fetch_add(1, Ordering::SeqCst);
        if take_one(&throttle.cancelled_transactions) {
            return cancelled(&body);
        }
    }
    if target == BATCH_GET {
        throttle.batch_gets.fetch_add(1, Ordering::SeqCst);
        if take_one(&throttle.throttled_answers)
            && let Some((narrowed, table, unprocessed)) = narrow(&body)
        {
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
        upstream: upstream(),
        throttled_answers: AtomicUsize::new(throttled_answers),
        ..Throttle::default()
    });
    let app = axum::Router::new()
        .fallback(forward)
        .with_state(throttle.clone());
    let store = store_through(app, table, |config| config, |store| store.timeout(timeout)).await;
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

/// A renewal of many records whose transaction was cancelled for one throttled item is not sent
/// again at once without it: the others would meet the same throttle. Every renewal of it is
/// unavailable, and the shard set's back-off sends the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_cancelled_by_a_throttled_item_are_not_sent_again_at_once() {
    let Some((store, throttle)) = throttled_store(0, Duration::from_secs(5)).await else {
        return;
    };
    let set = store.lock_set("member");
    let mut renewals = Vec::new();
    for i in 0..50 {
        let key = leader_test_support::unique(&format!("shard-{i}"));
        let record = LeaderElectionRecord::new("member", Duration::from_secs(30), Utc::now(), 1);
        let stored = set.lock(&key).create(&record).await.expect("a record");
        renewals.push(Renewal {
            key,
            version: stored.version,
            record,
        });
    }
    let before = throttle.transactions.load(Ordering::SeqCst);
    throttle.cancelled_transactions.store(1, Ordering::SeqCst);
    let renewed = set.renew_many(&renewals).await;
    assert_eq!(
        throttle.transactions.load(Ordering::SeqCst) - before,
        1,
        "one transaction, not one per item left"
    );
    assert_eq!(renewed.len(), renewals.len());
    for answer in &renewed {
        match answer {
            Err(err @ LockError::Unavailable { .. }) => {
                assert!(err.to_string().contains("ThrottlingError"), "{err}");
            }
            other => panic!("a renewal cancelled by a throttle is unavailable, not {other:?}"),
        }
    }
    // The next round renews them all.
    let renewed = set.renew_many(&renewals).await;
    assert!(renewed.iter().all(Result::is_ok), "{renewed:?}");
}

/// Terms that start at once on many records ask `DescribeTable` once, not once each: a member
/// that takes many shards at once does not flood the control plane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terms_started_at_once_ask_the_control_plane_once() {
    let Some((store, throttle)) = throttled_store(0, Duration::from_secs(5)).await else {
        return;
    };
    let before = throttle.describe_tables.load(Ordering::SeqCst);
    let record = LeaderElectionRecord::new("member", Duration::from_secs(30), Utc::now(), 1);
    let locks: Vec<_> = (0..64)
        .map(|i| store.lock(leader_test_support::unique(&format!("term-{i}")), "member"))
        .collect();
    let started =
        futures_util::future::join_all(locks.iter().map(|lock| lock.create(&record))).await;
    assert!(started.iter().all(Result::is_ok), "{started:?}");
    let asked = throttle.describe_tables.load(Ordering::SeqCst) - before;
    assert!(
        (1..=2).contains(&asked),
        "{asked} DescribeTable requests for 64 terms started at once"
    );
}
