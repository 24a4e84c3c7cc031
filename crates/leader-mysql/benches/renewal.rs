//! Requests and statements per renewal of the table lock, and its latency against two raw
//! references on the same pooled connection: `SELECT 1` and a single-row `UPDATE` of a plain
//! table.
//!
//! ```text
//! MYSQL_URL=mysql://root@127.0.0.1:3306/test cargo bench -p leader-mysql --bench renewal
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use leader_core::ResourceLock;
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_test_support::bench;

// Short interleaved rounds, so that drift in the machine's speed hits all rows alike.
const ROUNDS: usize = 200;
const PER_ROUND: usize = 25;

/// The server's count of `name` (`SHOW GLOBAL STATUS`).
async fn status(store: &MysqlStore, name: &str) -> Result<u64, Box<dyn Error>> {
    let mut conn = store.pool().get_conn().await?;
    let row: Option<(String, u64)> = conn
        .query_first(format!("SHOW GLOBAL STATUS LIKE '{name}'"))
        .await?;
    Ok(row.map_or(0, |(_, n)| n))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = leader_test_support::mysql_url();
    // One pooled connection: the lock and the references share it.
    let store = MysqlStore::builder(&url)
        .max_connections(1)
        .create_table(true)
        .build()
        .await?;
    let name = format!("bench-{:08x}", fastrand::u32(..));

    // 1. Requests per renewal as the elector makes them: a real elector on a counting wrapper.
    let (renewals, requests_per_renewal) = bench::elector_requests_per_renewal(
        store.lock(&name, "bench"),
        Duration::from_millis(600),
        Duration::from_millis(400),
        Duration::from_millis(20),
        Duration::from_secs(3),
    )
    .await?;

    // 2. Statements per renewal on the server: executions and preparations, over N renewals.
    let lock = store.lock(&name, "bench");
    let mut observed = bench::acquire(&lock, "bench").await?;
    assert!(observed.record.is_held_by("bench"));
    let executed = status(&store, "Com_stmt_execute").await?;
    let prepared = status(&store, "Com_stmt_prepare").await?;
    const N: u32 = 1000;
    for _ in 0..N {
        observed = lock
            .update(&observed.version, &bench::renewed(&observed.record))
            .await?;
    }
    let executions = f64::from(u32::try_from(
        status(&store, "Com_stmt_execute").await? - executed,
    )?) / f64::from(N);
    let preparations = f64::from(u32::try_from(
        status(&store, "Com_stmt_prepare").await? - prepared,
    )?) / f64::from(N);

    // 3. Latency against the raw references on the same connection.
    let mut conn = store.pool().get_conn().await?;
    conn.query_drop(
        "CREATE TABLE IF NOT EXISTS leader_bench_plain (id int PRIMARY KEY, v bigint NOT NULL) ENGINE=InnoDB",
    )
    .await?;
    conn.query_drop("INSERT IGNORE INTO leader_bench_plain VALUES (1, 0)")
        .await?;
    drop(conn);
    let (mut t_select, mut t_update, mut t_renew) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let mut conn = store.pool().get_conn().await?;
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            let _: Option<i64> = conn.exec_first("SELECT 1", ()).await?;
            t_select.push(at.elapsed());
        }
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            conn.exec_drop("UPDATE leader_bench_plain SET v = v + 1 WHERE id = 1", ())
                .await?;
            t_update.push(at.elapsed());
        }
        drop(conn);
        for _ in 0..PER_ROUND {
            let at = Instant::now();
            observed = lock
                .update(&observed.version, &bench::renewed(&observed.record))
                .await?;
            t_renew.push(at.elapsed());
        }
    }
    let mut conn = store.pool().get_conn().await?;
    conn.exec_drop("DELETE FROM leader_election WHERE name = ?", (&name,))
        .await?;
    let version: Option<String> = conn.query_first("SELECT VERSION()").await?;

    println!(
        "table lock renewal on {} ({})",
        store.redacted_url(),
        version.unwrap_or_default()
    );
    println!(
        "requests per renewal (elector, {renewals} renewals in 3 s): {requests_per_renewal:.2}"
    );
    println!(
        "statements per renewal (server, {N} renewals): {executions:.2} executed, {preparations:.3} prepared"
    );
    println!();
    bench::print_latencies(
        "operation (same connection)",
        1,
        &mut [
            ("`SELECT 1`", t_select),
            ("single-row `UPDATE`", t_update),
            ("renewal (`TableLock::update`)", t_renew),
        ],
    );
    Ok(())
}
