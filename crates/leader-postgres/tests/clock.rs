//! The server's clock as the locks read it. Postgres has no setting that moves `now()`, but a
//! session can put another function of that name before `pg_catalog` in its `search_path`, and
//! `now()` is the start of the transaction: a connection another user of the pool changed so, or
//! returned inside a transaction, must not decide a lease. A session's time zone moves no
//! instant.

mod common;

use common::unique;
use leader_core::ResourceLock;
use leader_postgres::PostgresStore;
use leader_test_support::held_lease::{
    assert_held, assert_renewal_in_an_open_transaction_commits_nothing, hold, lease, take,
};

/// A store whose pool holds one connection: the connection another user of the pool changes is
/// the one the lock gets next.
async fn one_connection_store() -> PostgresStore {
    PostgresStore::builder(common::database_url())
        .max_connections(1)
        .create_table(true)
        .build()
        .await
        .expect("store")
}

/// Runs `sql` on `store`'s pooled connection and returns it to the pool.
async fn on_pooled_connection(store: &PostgresStore, sql: &str) {
    let client = store.pool().get().await.expect("pooled");
    client.batch_execute(sql).await.expect(sql);
}

/// A schema with a `now()` of its own, `offset` away from the server's; dropped on drop.
struct ShiftedNow {
    schema: String,
}

impl ShiftedNow {
    async fn create(offset: &str) -> Option<Self> {
        let admin = common::admin().await?;
        let schema = unique("leader_clock").replace('-', "_");
        admin
            .batch_execute(&format!(
                "CREATE SCHEMA {schema};
                 CREATE FUNCTION {schema}.now() RETURNS timestamptz LANGUAGE sql STABLE
                   AS $$ SELECT pg_catalog.now() + interval '{offset}' $$"
            ))
            .await
            .expect("a schema with its own now()");
        Some(Self { schema })
    }

    /// What a session runs to call this `now()` for its unqualified `now()`.
    fn search_path(&self) -> String {
        format!("SET search_path = {}, pg_catalog, public", self.schema)
    }
}

impl Drop for ShiftedNow {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        tokio::spawn(async move {
            if let Some(admin) = common::admin().await {
                let _ = admin
                    .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
                    .await;
            }
        });
    }
}

/// A candidate whose pooled connection's `search_path` finds a `now()` an hour ahead before
/// `pg_catalog`'s does not take a lease its holder acquired and renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_now_an_hour_ahead_on_the_search_path_takes_no_held_lease() {
    let Some(holder_store) = common::store().await else {
        return;
    };
    let ahead = ShiftedNow::create("1 hour").await.expect("server");
    let name = unique("clock-ahead");
    hold(&holder_store.lock(&name, "holder")).await;
    let candidate_store = one_connection_store().await;
    on_pooled_connection(&candidate_store, &ahead.search_path()).await;
    assert_held(&candidate_store.lock(&name, "candidate")).await;
}

/// A holder whose pooled connection's `search_path` finds a `now()` an hour behind renews for its
/// full lease: a candidate on another store still finds the lease held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_now_an_hour_behind_on_the_search_path_renews_no_lease_into_the_past() {
    let Some(candidate_store) = common::store().await else {
        return;
    };
    let behind = ShiftedNow::create("-1 hour").await.expect("server");
    let holder_store = one_connection_store().await;
    on_pooled_connection(&holder_store, &behind.search_path()).await;
    let name = unique("clock-behind");
    hold(&holder_store.lock(&name, "holder")).await;
    assert_held(&candidate_store.lock(&name, "candidate")).await;
}

/// A session's time zone changes how times are shown, not the instants the lock compares: a
/// holder renewing in one far time zone and a candidate reading in another agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_time_zone_moves_no_lease() {
    if common::admin().await.is_none() {
        return;
    }
    let holder_store = one_connection_store().await;
    on_pooled_connection(&holder_store, "SET TIME ZONE 'Etc/GMT+12'").await;
    let name = unique("clock-zone");
    hold(&holder_store.lock(&name, "holder")).await;
    let candidate_store = one_connection_store().await;
    on_pooled_connection(&candidate_store, "SET TIME ZONE 'Pacific/Kiritimati'").await;
    assert_held(&candidate_store.lock(&name, "candidate")).await;
}

/// A pooled connection that another user of the pool returned inside a transaction (whose
/// `now()` is when that transaction began, and whose writes nobody sees until it commits) is
/// not written through: the renewal fails, nothing is stored, the connection is closed (which
/// rolls the transaction back), and the next renewal, on a new connection, is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_left_inside_a_transaction_decides_nothing() {
    let Some(reader) = common::store().await else {
        return;
    };
    let store = one_connection_store().await;
    let name = unique("left-open");
    let lock = store.lock(&name, "holder");
    let held = take(&lock).await;
    on_pooled_connection(&store, "BEGIN").await;
    assert_renewal_in_an_open_transaction_commits_nothing(
        &lock,
        &held,
        &reader.lock(&name, "reader"),
    )
    .await;

    // A candidate's attempt is refused the same way.
    let candidate_store = one_connection_store().await;
    on_pooled_connection(&candidate_store, "BEGIN").await;
    let candidate = candidate_store.lock(&name, "candidate");
    let err = candidate
        .try_acquire(&lease("candidate"))
        .await
        .expect_err("an attempt inside a transaction left open");
    assert!(err.to_string().contains("transaction"), "{err}");
    assert_held(&candidate_store.lock(&name, "candidate")).await;
}
