//! Electors on one real MySQL or MariaDB: exactly one leads, a killed connection is ridden out.

mod common;

use leader_test_support::started_leading;

use common::{Factory, RENEW, unique};
use leader_core::conformance;
use leader_mysql::mysql_async::prelude::Queryable;
use tokio::time::sleep;

/// Two and ten electors on the table lock each elect exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_lock_electors_conform() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::electors(
        &Factory {
            store,
            named: false,
        },
        false,
    )
    .await;
}

/// The lease lives in the row: when the server kills every connection of the leader's pool, the
/// next renewal runs on a new one and the leader keeps its term (same fencing token).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_rides_out_its_connections_killed() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("killed");
    let (leader, token) = started_leading(store.lock(&name, "first")).await;
    let mut admin = common::admin().await.expect("server");
    for _ in 0..3 {
        // Every connection of the store's pool (4): held at once, so each is a different one.
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(store.pool().get_conn().await.expect("pooled connection"));
        }
        let mut ids = Vec::new();
        for conn in &mut held {
            let id: u64 = conn
                .query_first("SELECT CONNECTION_ID()")
                .await
                .expect("id")
                .expect("a row");
            ids.push(id);
        }
        drop(held);
        for id in ids {
            admin
                .query_drop(format!("KILL CONNECTION {id}"))
                .await
                .expect("kill");
        }
        sleep(RENEW / 2).await;
    }
    sleep(RENEW).await;
    assert_eq!(
        leader.leading_token(),
        Some(token),
        "the leader lost its term to killed connections"
    );
    leader.stop().await;
}
