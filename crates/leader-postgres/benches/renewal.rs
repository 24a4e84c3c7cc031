//! Statements per renewal and renewal latency of the table lock, against two raw references on
//! the same connection, `SELECT 1` and a single-row `UPDATE` of a plain table, and against its
//! own statement run raw, prepared once or unnamed (as the lock sends it).
//!
//! ```text
//! DATABASE_URL=postgres://postgres:postgres@127.0.0.1:5432/postgres \
//!   cargo bench -p leader-postgres --bench renewal
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use leader_postgres::PostgresStore;
use leader_test_support::bench::{self, Rewrite};

// Short interleaved rounds, so that drift in the machine's speed hits all three alike.
const ROUNDS: usize = 200;
const PER_ROUND: usize = 25;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = leader_test_support::database_url();
    // One pooled connection: the lock and the references share it.
    let store = PostgresStore::builder(&url)
        .max_connections(1)
        .create_table(true)
        .build()
        .await?;
    let name = leader_test_support::unique("bench");

    // 1. Requests per renewal as the elector makes them: a real elector on a counting wrapper.
    // It released the lease on shutdown: taken again, what follows are renewals by the holder
    // (a write of a free record would be a release, which also NOTIFYs).
    let lock = store.lock(&name, "bench");
    let (elector, mut observed) =
        bench::elected_then_held(store.lock(&name, "bench"), bench::SHORT, &lock).await?;

    // 2. Statements per renewal on the server: committed transactions of this database.
    let client = store.pool().get().await?;
    let xacts = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()";
    let stats = async |client: &tokio_postgres::Client| -> Result<i64, Box<dyn Error>> {
        client
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await?;
        tokio::time::sleep(Duration::from_millis(1100)).await; // stats are flushed at most every second
        client
            .batch_execute("SELECT pg_stat_clear_snapshot()")
            .await?;
        Ok(client.query_one(xacts, &[]).await?.get(0))
    };
    let start = stats(&client).await?;
    drop(client);
    const N: usize = 1000;
    bench::rewrites(&lock, &mut observed, N, Rewrite::Update).await?;
    let client = store.pool().get().await?;
    let end = stats(&client).await?;
    // Each stats read itself commits a few transactions (snapshot clears and the query).
    let statements_per_renewal = (end - start - 3) as f64 / N as f64;

    // 3. Latency against the raw references on the same connection.
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS leader_bench_plain (id int PRIMARY KEY, v bigint NOT NULL); \
             INSERT INTO leader_bench_plain VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
        )
        .await?;
    let select = client.prepare_cached("SELECT 1").await?;
    let update = client
        .prepare_cached("UPDATE leader_bench_plain SET v = v + 1 WHERE id = 1")
        .await?;
    // The lock's own renewal statement, to run it raw: the last statement of the pooled
    // connection (the pool's one), idle since a renewal, as the server shows it to another
    // session.
    let pid: i32 = client
        .query_typed_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    drop(client);
    bench::rewrites(&lock, &mut observed, 1, Rewrite::Update).await?;
    let (observer, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let renewal_sql: String = observer
        .query_one(
            "SELECT query FROM pg_stat_activity WHERE pid = $1 AND state = 'idle'",
            &[&pid],
        )
        .await?
        .get(0);
    assert!(
        renewal_sql.starts_with("UPDATE"),
        "not the renewal: {renewal_sql}"
    );
    drop(observer);
    let client = store.pool().get().await?;
    let raw = client.prepare_cached(&renewal_sql).await?;
    drop(client);
    let (mut t_select, mut t_update, mut t_renew, mut t_raw, mut t_unnamed) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let client = store.pool().get().await?;
        bench::time_each(PER_ROUND, &mut t_select, async || {
            client.query_one(&select, &[]).await
        })
        .await?;
        bench::time_each(PER_ROUND, &mut t_update, async || {
            client.execute(&update, &[]).await
        })
        .await?;
        // The renewal statement prepared once, then sent unnamed with its parameters' types,
        // as the lock sends it.
        for unnamed in [false, true] {
            for _ in 0..PER_ROUND {
                use tokio_postgres::types::{ToSql, Type};
                let record = bench::renewed(&observed.record);
                let version: i64 = observed.version.as_str().parse()?;
                let lease = i64::try_from(record.lease_duration.as_millis())?;
                let transitions = i64::try_from(record.leader_transitions)?;
                let none = None::<String>;
                let params: [(&(dyn ToSql + Sync), Type); 10] = [
                    (&name, Type::TEXT),
                    (&record.holder_identity, Type::TEXT),
                    (&lease, Type::INT8),
                    (&record.acquire_time, Type::TIMESTAMPTZ),
                    (&record.renew_time, Type::TIMESTAMPTZ),
                    (&transitions, Type::INT8),
                    (&record.strategy, Type::TEXT),
                    (&record.preferred_holder, Type::TEXT),
                    (&none, Type::TEXT),
                    (&version, Type::INT8),
                ];
                let at = Instant::now();
                let row = if unnamed {
                    client.query_typed_one(&renewal_sql, &params).await?
                } else {
                    let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p.0).collect();
                    client.query_one(&raw, &values).await?
                };
                let took = at.elapsed();
                if unnamed { &mut t_unnamed } else { &mut t_raw }.push(took);
                observed.version = leader_core::Version::from(row.get::<_, i64>(0));
            }
        }
        drop(client);
        t_renew.extend(bench::rewrites(&lock, &mut observed, PER_ROUND, Rewrite::Update).await?);
    }
    let client = store.pool().get().await?;
    client
        .execute(
            "DELETE FROM public.leader_election WHERE name = $1",
            &[&name],
        )
        .await?;

    println!("table lock renewal on {}", store.redacted_url());
    elector.print();
    println!("statements per renewal (server, {N} renewals):         {statements_per_renewal:.2}");
    println!();
    bench::print_latencies(
        "operation (same connection)",
        1,
        &mut [
            ("`SELECT 1`", t_select),
            ("single-row `UPDATE`", t_update),
            ("renewal statement, raw, prepared once", t_raw),
            ("renewal statement, raw, unnamed", t_unnamed),
            ("renewal (`TableLock::update`)", t_renew),
        ],
    );
    Ok(())
}
