//! The table lock behind PgBouncer in transaction pooling mode, as managed poolers offer it:
//! each transaction gets whichever server session is free. The lock's statements leave nothing
//! on a session (each is sent unnamed with its parameters' types), and followers, which hear
//! nothing through `LISTEN` there, read the record every retry period (`listen(false)`).
//! `PGBOUNCER_URL`, or the loopback PgBouncer that `scripts/setup` starts.

mod common;

use common::Factory;
use leader_core::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_table_lock_conforms_behind_pgbouncer() {
    let Some(store) = common::store_behind_pgbouncer().await else {
        return;
    };
    conformance::run_all(&Factory {
        store,
        advisory: false,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn electors_elect_exactly_one_behind_pgbouncer() {
    let Some(store) = common::store_behind_pgbouncer().await else {
        return;
    };
    let factory = Factory {
        store,
        advisory: false,
    };
    conformance::electors(&factory, false).await;
}
