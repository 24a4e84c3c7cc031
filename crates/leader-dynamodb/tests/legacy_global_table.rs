//! A global table of version 2017.11.29 shows no replicas in `DescribeTable`; only
//! `DescribeGlobalTable` tells it. Its regions reconcile concurrent writes by last writer wins,
//! so it is refused as a current global table is. A proxy in front of the test server (moto
//! has no `DescribeGlobalTable`) answers it as DynamoDB does for such a table, or says there is
//! no global table of that name.

mod common;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use common::proxy::{post, respond};

const DESCRIBE_GLOBAL_TABLE: &str = "DynamoDB_20120810.DescribeGlobalTable";

/// The proxy's state: where it forwards to, and the regions of the table's replication group
/// (none: not a global table).
struct Legacy {
    upstream: String,
    regions: Vec<&'static str>,
}

async fn forward(State(legacy): State<Arc<Legacy>>, headers: HeaderMap, body: Bytes) -> Response {
    let target = headers
        .get("x-amz-target")
        .and_then(|target| target.to_str().ok());
    if target == Some(DESCRIBE_GLOBAL_TABLE) {
        let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let name = request["GlobalTableName"].as_str().unwrap_or_default();
        let (status, answer) = if legacy.regions.is_empty() {
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

/// A store on a new table through the proxy, whose table has the replication group `regions`.
async fn store_with(regions: Vec<&'static str>) -> Option<leader_dynamodb::DynamoStore> {
    let table = common::table_or_skip()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port for the proxy");
    let url = format!("http://{}", listener.local_addr().expect("its address"));
    let legacy = Arc::new(Legacy {
        upstream: common::endpoint()
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned(),
        regions,
    });
    let app = axum::Router::new().fallback(forward).with_state(legacy);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let config = common::sdk_config()
        .await
        .into_builder()
        .endpoint_url(url)
        .build();
    Some(
        leader_dynamodb::DynamoStore::builder(table)
            .sdk_config(config)
            .create_table(true)
            .build()
            .await
            .expect("a store through the proxy"),
    )
}

#[tokio::test]
async fn a_legacy_global_table_is_refused_and_a_table_alone_is_not() {
    let Some(global) = store_with(vec!["eu-west-1", "us-east-1"]).await else {
        return;
    };
    leader_test_support::assert_misconfigured_saying(
        global.check_table().await,
        &["global table", "eu-west-1, us-east-1"],
    );
    // A replication group of its own region alone, and no global table at all.
    for regions in [vec!["us-east-1"], Vec::new()] {
        let alone = store_with(regions).await.expect("the server");
        alone.check_table().await.expect("a table alone");
    }
}
