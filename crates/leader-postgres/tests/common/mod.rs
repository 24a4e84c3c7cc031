//! Test support: the server from `DATABASE_URL` (default: loopback), required under `CI=true`.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::sync::Arc;
use std::time::Duration;

use leader_core::conformance::LockFactory;
use leader_core::{ResourceLock, async_trait};
use leader_postgres::PostgresStore;

pub use leader_test_support::database_url;

pub use leader_test_support::in_ci;

/// A raw client for setting up and breaking things.
pub async fn admin() -> Option<tokio_postgres::Client> {
    let connected = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await;
    let at = leader_postgres::redact_url(&database_url());
    let (client, connection) =
        leader_test_support::connected_or_skip(connected, "Postgres", &at, "DATABASE_URL")?;
    tokio::spawn(connection);
    Some(client)
}

/// A store on the default table, created if missing; `None` (outside CI) without a server.
pub async fn store() -> Option<PostgresStore> {
    admin().await?;
    Some(
        PostgresStore::builder(database_url())
            .create_table(true)
            .build()
            .await
            .expect("store"),
    )
}

/// Where PgBouncer, in transaction pooling mode, serves the test database: `PGBOUNCER_URL`;
/// else, when `DATABASE_URL` is the loopback default too, the PgBouncer that `scripts/setup`
/// starts in front of it (port 6432); else none.
pub fn pgbouncer_url() -> Option<String> {
    match std::env::var("PGBOUNCER_URL") {
        Ok(url) => Some(url),
        Err(_) if std::env::var("DATABASE_URL").is_err() => {
            Some("postgres://postgres:postgres@127.0.0.1:6432/postgres".to_owned())
        }
        Err(_) => None,
    }
}

/// A store on the default table through PgBouncer, created if missing, whose followers read
/// the record every retry period (`listen(false)`); `None` (outside CI) without PgBouncer.
pub async fn store_behind_pgbouncer() -> Option<PostgresStore> {
    let Some(url) = pgbouncer_url() else {
        assert!(
            !in_ci(),
            "CI=true, but DATABASE_URL is set and PGBOUNCER_URL is not: point it at a PgBouncer in transaction mode in front of DATABASE_URL's server"
        );
        eprintln!("skipping: PGBOUNCER_URL is not set (DATABASE_URL is)");
        return None;
    };
    let connected = tokio_postgres::connect(&url, tokio_postgres::NoTls).await;
    let at = leader_postgres::redact_url(&url);
    let (client, connection) =
        leader_test_support::connected_or_skip(connected, "PgBouncer", &at, "PGBOUNCER_URL")?;
    drop((client, connection));
    Some(
        PostgresStore::builder(url)
            .listen(false)
            .create_table(true)
            .build()
            .await
            .expect("store"),
    )
}

/// The one value of the one row `sql` gives, run with `params` on `client` (a connection or a
/// transaction); panics, naming `sql`, unless it gives one row.
pub async fn query_value<T>(
    client: &impl tokio_postgres::GenericClient,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> T
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
{
    client.query_one(sql, params).await.expect(sql).get(0)
}

/// A key-value connection string for the test server as `user`.
pub fn conn_as(user: &str, password: &str) -> String {
    let config: tokio_postgres::Config = database_url().parse().expect("DATABASE_URL");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config.get_dbname().unwrap_or("postgres");
    format!("host={host} port={port} dbname={db} user={user} password={password}")
}

pub use leader_test_support::unique;

pub use leader_test_support::{Candidate as Running, LEASE, RENEW, RETRY};

/// Locks for the conformance suite: table or advisory locks of one store.
pub struct Factory {
    pub store: PostgresStore,
    pub advisory: bool,
}

#[async_trait]
impl LockFactory for Factory {
    /// A later release's field is a column (an annotation) this release leaves alone.
    fn keeps_unknown_fields(&self) -> bool {
        false
    }
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        if self.advisory {
            Arc::new(self.store.advisory_lock(name, identity))
        } else {
            Arc::new(self.store.lock(name, identity))
        }
    }

    async fn lock_set(&self, identity: &str) -> Option<Box<dyn leader_core::LockSet>> {
        (!self.advisory).then(|| Box::new(self.store.lock_set(identity)) as Box<_>)
    }

    /// Written through the store's own pool, so that it reaches the store's database however
    /// the store connects (through a pooler in transaction mode too: an unnamed statement).
    async fn corrupt(&self, name: &str) -> bool {
        let client = self.store.pool().get().await.expect("a pooled connection");
        client
            .query_typed(
                "INSERT INTO public.leader_election (name, holder_identity, lease_duration_ms, acquire_time, \
                 renew_time, leader_transitions, version, expires_at) \
                 VALUES ($1, 'x', -5, now(), now() - interval '1 day', -1, 1, now())",
                &[(&name, tokio_postgres::types::Type::TEXT)],
            )
            .await
            .expect("write a garbage row");
        true
    }
}
