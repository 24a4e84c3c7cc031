//! A global table of version 2017.11.29 shows no replicas in `DescribeTable`; only
//! `DescribeGlobalTable` tells it. Its regions reconcile concurrent writes by last writer wins,
//! so it is refused as a current global table is. A proxy in front of the test server (moto
//! has no `DescribeGlobalTable`) answers it as DynamoDB does for such a table, or says there is
//! no global table of that name.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use common::proxy::{post, respond};

const DESCRIBE_GLOBAL_TABLE: &str = "DynamoDB_20120810.DescribeGlobalTable";

/// The proxy's state: where it forwards to, the regions of the table's replication group
/// (none: not a global table), and how many `DescribeGlobalTable` requests it still fails as a
/// server error.
struct Legacy {
    upstream: String,
    regions: Vec<&'static str>,
    failures: AtomicUsize,
}

async fn forward(State(legacy): State<Arc<Legacy>>, headers: HeaderMap, body: Bytes) -> Response {
    let target = headers
        .get("x-amz-target")
        .and_then(|target| target.to_str().ok());
    if target == Some(DESCRIBE_GLOBAL_TABLE) {
        let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let name = request["GlobalTableName"].as_str().unwrap_or_default();
        let failing = legacy
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let (status, answer) = if failing {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                serde_json::json!({
                    "__type": "com.amazonaws.dynamodb.v20120810#InternalServerError",
                    "message": "Internal server error",
                }),
            )
        } else if legacy.regions.is_empty() {
            (
                StatusCode::BAD_REQUEST,
                serde_json::json!({
                    "__type": "com.amazonaws.dynamodb.v20120810#GlobalTableNotFoundException",
                    "message": "Global table not found",
                }),
            )
        } else {
            let group: Vec<_> = legacy
                .regions
                .iter()
                .map(|region| serde_json::json!({ "RegionName": region }))
                .collect();
            (
                StatusCode::OK,
                serde_json::json!({ "GlobalTableDescription": {
                    "GlobalTableName": name,
                    "GlobalTableStatus": "ACTIVE",
                    "ReplicationGroup": group,
                }}),
            )
        };
        return (
            status,
            [("content-type", "application/x-amz-json-1.0")],
            answer.to_string(),
        )
            .into_response();
    }
    match post(&legacy.upstream, &headers, &body).await {
        Some((status, headers, bytes)) => respond(status, &headers, bytes),
        None => StatusCode::BAD_GATEWAY.into_response(),
    }
}

/// A store on a new table through the proxy, whose table has the replication group `regions`,
/// and which fails the first `failures` requests for it.
async fn store_with(
    regions: Vec<&'static str>,
    failures: usize,
) -> Option<leader_dynamodb::DynamoStore> {
    let table = common::table_or_skip()?;
    let legacy = Arc::new(Legacy {
        upstream: common::proxy::upstream(),
        regions,
        failures: AtomicUsize::new(failures),
    });
    let app = axum::Router::new().fallback(forward).with_state(legacy);
    Some(common::proxy::store_through(app, table, |config| config, |store| store).await)
}

#[tokio::test]
async fn a_legacy_global_table_is_refused_and_a_table_alone_is_not() {
    let Some(global) = store_with(vec!["eu-west-1", "us-east-1"], 0).await else {
        return;
    };
    leader_test_support::assert_misconfigured_saying(
        global.check_table().await,
        &["global table", "eu-west-1, us-east-1"],
    );
    // A replication group of its own region alone, and no global table at all.
    for regions in [vec!["us-east-1"], Vec::new()] {
        let alone = store_with(regions, 0).await.expect("the server");
        alone.check_table().await.expect("a table alone");
    }

    // A server error is no answer: the next check asks again, and refuses.
    let global = store_with(vec!["eu-west-1", "us-east-1"], 1)
        .await
        .expect("the server");
    global.check_table().await.expect("not known yet");
    leader_test_support::assert_misconfigured_saying(
        global.check_table_now().await,
        &["global table", "eu-west-1, us-east-1"],
    );
}
