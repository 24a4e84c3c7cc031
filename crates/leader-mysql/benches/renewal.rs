//! Requests and statements per renewal of the table lock and of the `GET_LOCK` lock, and their
//! latency against two raw references: `SELECT 1` and a single-row `UPDATE` of a plain table on
//! the pooled connection the table lock uses (the `GET_LOCK` lock renews on a session of its
//! own).
//!
//! ```text
//! MYSQL_URL=mysql://root@127.0.0.1:3306/test cargo bench -p leader-mysql --bench renewal
//! ```

use std::error::Error;

use leader_core::{Observed, ResourceLock};
use leader_mysql::MysqlStore;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_test_support::bench::{self, ElectorRequests, Rewrite};

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

/// What one lock's part of the benchmark found.
struct Measured {
    elector: ElectorRequests,
    executions: f64,
    preparations: f64,
}

/// Requests per renewal as an elector makes them, then statements per renewal on the server,
/// of the lock `make` builds (called for a fresh lock each time). Leaves the lease held by
/// "bench" and returns it.
async fn measure<L: ResourceLock + 'static>(
    store: &MysqlStore,
    make: impl Fn() -> L,
) -> Result<(Measured, L, Observed), Box<dyn Error>> {
    // 1. A real elector on a counting wrapper.
    let lock = make();
    let (elector, mut observed) = bench::elected_then_held(make(), bench::SHORT, &lock).await?;

    // 2. Executions and preparations on the server over N renewals (every session counts:
    //    the GET_LOCK lock writes on a session of its own).
    let executed = status(store, "Com_stmt_execute").await?;
    let prepared = status(store, "Com_stmt_prepare").await?;
    const N: u32 = 1000;
    bench::rewrites(&lock, &mut observed, N as usize, Rewrite::Update).await?;
    let per =
        |n: u64| -> Result<f64, Box<dyn Error>> { Ok(f64::from(u32::try_from(n)?) / f64::from(N)) };
    let executions = per(status(store, "Com_stmt_execute").await? - executed)?;
    let preparations = per(status(store, "Com_stmt_prepare").await? - prepared)?;
    let measured = Measured {
        elector,
        executions,
        preparations,
    };
    Ok((measured, lock, observed))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = leader_test_support::mysql_url();
    // One pooled connection: the table lock and the references share it.
    let store = MysqlStore::builder(&url)
        .max_connections(1)
        .create_table(true)
        .build()
        .await?;
    let name = leader_test_support::unique("bench");
    let named_name = format!("{name}-named");

    let (table, lock, mut observed) = measure(&store, || store.lock(&name, "bench")).await?;
    let (named, named_lock, mut named_observed) =
        measure(&store, || store.named_lock(&named_name, "bench")).await?;

    // 3. Latency against the raw references on the pooled connection. The GET_LOCK lock's
    //    renewals run on its own session, another connection to the same server.
    let mut conn = store.pool().get_conn().await?;
    conn.query_drop(
        "CREATE TABLE IF NOT EXISTS leader_bench_plain (id int PRIMARY KEY, v bigint NOT NULL) ENGINE=InnoDB",
    )
    .await?;
    conn.query_drop("INSERT IGNORE INTO leader_bench_plain VALUES (1, 0)")
        .await?;
    drop(conn);
    let (mut t_select, mut t_update) = (Vec::new(), Vec::new());
    let (mut t_renew, mut t_named) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let mut conn = store.pool().get_conn().await?;
        bench::time_each(PER_ROUND, &mut t_select, async || {
            conn.exec_first::<i64, _, _>("SELECT 1", ()).await
        })
        .await?;
        bench::time_each(PER_ROUND, &mut t_update, async || {
            conn.exec_drop("UPDATE leader_bench_plain SET v = v + 1 WHERE id = 1", ())
                .await
        })
        .await?;
        drop(conn);
        t_renew.extend(bench::rewrites(&lock, &mut observed, PER_ROUND, Rewrite::Update).await?);
        t_named.extend(
            bench::rewrites(&named_lock, &mut named_observed, PER_ROUND, Rewrite::Update).await?,
        );
    }
    named_lock.close().await;
    let mut conn = store.pool().get_conn().await?;
    conn.exec_drop(
        "DELETE FROM leader_election WHERE name IN (?, ?)",
        (&name, &named_name),
    )
    .await?;
    let version: Option<String> = conn.query_first("SELECT VERSION()").await?;

    println!(
        "renewals on {} ({})",
        store.redacted_url(),
        version.unwrap_or_default()
    );
    for (label, m) in [("table lock", &table), ("GET_LOCK lock", &named)] {
        println!(
            "{label}: {}; statements per renewal (server, 1000 renewals): {:.2} executed, \
             {:.3} prepared",
            m.elector, m.executions, m.preparations
        );
    }
    println!();
    bench::print_latencies(
        "operation",
        1,
        &mut [
            ("`SELECT 1`", t_select),
            ("single-row `UPDATE`", t_update),
            ("renewal (`TableLock::update`)", t_renew),
            ("renewal (`NamedLock::update`)", t_named),
        ],
    );
    Ok(())
}
