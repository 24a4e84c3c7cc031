//! What the workspace benchmarks share: the backends on the servers of `DATABASE_URL`,
//! `REDIS_URL` and `ETCD_ENDPOINTS` (loopback by default) and on a test Consul server in this
//! process (no Consul agent runs here), on moto's S3 server (`S3_ENDPOINT`, `S3_BUCKET`) and its
//! DynamoDB (`DYNAMODB_ENDPOINT`, a table of the run's own), and a few numbers read off the
//! servers and this process. `BENCH_BACKENDS=redis,consul` keeps only the backends named.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::sync::Arc;
use std::time::Duration;

use leader_consul::ConsulStore;
use leader_core::{FileLock, ResourceLock};
use leader_etcd::EtcdStore;
use leader_mysql::MysqlStore;
use leader_nats::NatsStore;
use leader_object_store::BucketStore;
use leader_postgres::PostgresStore;
use leader_redis::RedisStore;
use leader_test_support::object_store_counting::Counting;

use leader_test_support::consul_api::ConsulApiServer;
use leader_test_support::kube_api::KubeApiServer;
pub use leader_test_support::{database_url, etcd_endpoints, redis_url};

/// A backend with everything needed to make locks on it.
pub enum Backend {
    File(tempfile::TempDir),
    Postgres(PostgresStore),
    PostgresAdvisory(PostgresStore),
    /// The MySQL / MariaDB table lock (`MYSQL_URL`).
    Mysql(MysqlStore),
    /// The MySQL / MariaDB `GET_LOCK` lock (`MYSQL_URL`).
    MysqlNamed(MysqlStore),
    /// The NATS key-value lock (`NATS_URL`, bucket `NATS_BUCKET`).
    Nats(NatsStore),
    Redis(RedisStore),
    Etcd(EtcdStore),
    Consul(ConsulApiServer, ConsulStore),
    /// Leases in namespace `default` of a test API server in this process.
    Kubernetes(KubeApiServer, leader::kubernetes::kube::Client),
    /// Requests counted at the client (object_store's retries off: one call, one request).
    ObjectStore(Arc<Counting>, BucketStore),
    /// A table of the run's own on moto's DynamoDB, created for it.
    DynamoDb(leader::dynamodb::DynamoStore),
}

impl Backend {
    /// Every backend whose server answers (the ones that do not are named on stderr), or of
    /// those the ones `BENCH_BACKENDS` names.
    pub async fn available() -> Vec<Self> {
        let mut backends = Self::answering().await;
        backends.retain(|b| wanted(b.name()));
        backends
    }

    async fn answering() -> Vec<Self> {
        let mut backends = vec![Self::File(tempfile::tempdir().expect("tempdir"))];
        match PostgresStore::builder(database_url())
            .create_table(true)
            .max_connections(16)
            .build()
            .await
        {
            Ok(store) => {
                backends.push(Self::Postgres(store.clone()));
                backends.push(Self::PostgresAdvisory(store));
            }
            Err(err) => eprintln!("no Postgres: {err}"),
        }
        match MysqlStore::builder(leader_test_support::mysql_url())
            .create_table(true)
            .max_connections(16)
            .build()
            .await
        {
            Ok(store) => {
                backends.push(Self::Mysql(store.clone()));
                backends.push(Self::MysqlNamed(store));
            }
            Err(err) => eprintln!("no MySQL: {err}"),
        }
        match NatsStore::builder(leader_test_support::nats_url())
            .bucket(leader_test_support::nats_bucket())
            .create_bucket(true)
            .build()
            .await
        {
            Ok(store) => match store.kv().await {
                Ok(_) => backends.push(Self::Nats(store)),
                Err(err) => eprintln!("no NATS: {err}"),
            },
            Err(err) => eprintln!("no NATS: {err}"),
        }
        match RedisStore::connect(redis_url()).await {
            Ok(store) => backends.push(Self::Redis(store)),
            Err(err) => eprintln!("no Redis: {err}"),
        }
        match EtcdStore::builder(etcd_endpoints())
            .timeout(Duration::from_secs(2))
            .build()
            .await
        {
            Ok(store) => backends.push(Self::Etcd(store)),
            Err(err) => eprintln!("no etcd: {err}"),
        }
        match object_store() {
            Ok((counting, store)) => backends.push(Self::ObjectStore(counting, store)),
            Err(err) => eprintln!("no S3 server: {err}"),
        }
        match dynamodb().await {
            Ok(store) => backends.push(Self::DynamoDb(store)),
            Err(err) => eprintln!("no DynamoDB server: {err}"),
        }
        let api = ConsulApiServer::start().await;
        match ConsulStore::builder(api.url()).build() {
            Ok(store) => backends.push(Self::Consul(api, store)),
            Err(err) => eprintln!("no Consul store: {err}"),
        }
        let api = KubeApiServer::start().await;
        let config = leader::kubernetes::kube::Config::new(api.url().parse().expect("a URL"));
        match leader::kubernetes::kube::Client::try_from(config) {
            Ok(client) => backends.push(Self::Kubernetes(api, client)),
            Err(err) => eprintln!("no Kubernetes client: {err}"),
        }
        backends
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::File(_) => "file",
            Self::Postgres(_) => "postgres (table)",
            Self::PostgresAdvisory(_) => "postgres (advisory)",
            Self::Mysql(_) => "mysql (table, MariaDB)",
            Self::MysqlNamed(_) => "mysql (GET_LOCK, MariaDB)",
            Self::Nats(_) => "nats (key-value)",
            Self::Redis(_) => "redis",
            Self::Etcd(_) => "etcd",
            Self::Consul(..) => "consul (test server)",
            Self::Kubernetes(..) => "kubernetes (test API server)",
            Self::ObjectStore(..) => "object store (moto s3)",
            Self::DynamoDb(_) => "dynamodb (moto)",
        }
    }

    pub fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock> {
        match self {
            Self::File(dir) => Arc::new(FileLock::new(dir.path().join(name), identity)),
            Self::Postgres(store) => Arc::new(store.lock(name, identity)),
            Self::PostgresAdvisory(store) => Arc::new(store.advisory_lock(name, identity)),
            Self::Mysql(store) => Arc::new(store.lock(name, identity)),
            Self::MysqlNamed(store) => Arc::new(store.named_lock(name, identity)),
            Self::Nats(store) => Arc::new(store.lock(name, identity)),
            Self::Redis(store) => Arc::new(store.lock(name, identity)),
            Self::Etcd(store) => Arc::new(store.lock(name, identity)),
            Self::Consul(_, store) => Arc::new(store.lock(name, identity).expect("a valid name")),
            Self::Kubernetes(_, client) => Arc::new(
                leader::kubernetes::LeaseLock::new(client.clone(), "default", name, identity)
                    .expect("a valid name"),
            ),
            Self::ObjectStore(_, store) => Arc::new(store.lock(name, identity)),
            Self::DynamoDb(store) => Arc::new(store.lock(name, identity)),
        }
    }

    /// The records of a shard set for member `identity`: the backend's own batched set where
    /// it has one, else a lock per record.
    pub fn lock_set(self: &Arc<Self>, name: &str, identity: &str) -> Box<dyn leader_core::LockSet> {
        match &**self {
            Self::Postgres(store) => Box::new(store.lock_set(identity)),
            Self::Mysql(store) => Box::new(store.lock_set(identity)),
            Self::Redis(store) => Box::new(store.lock_set(identity)),
            Self::Etcd(store) => Box::new(store.lock_set(name, identity)),
            Self::DynamoDb(store) => Box::new(store.lock_set(identity)),
            Self::Consul(_, store) => {
                Box::new(store.lock_set(name, identity).expect("a valid name"))
            }
            Self::Kubernetes(_, client) => Box::new(
                leader::kubernetes::LeaseLock::new(client.clone(), "default", name, identity)
                    .and_then(|lock| lock.lock_set(name, identity))
                    .expect("valid names"),
            ),
            _ => {
                let this = self.clone();
                Box::new(leader_core::backend::KeyedLocks::new(
                    identity,
                    self.name(),
                    move |key, identity| this.lock(key, identity),
                ))
            }
        }
    }

    /// Requests this process sent so far, where its client counts them on the wire: etcd's
    /// requests and keep-alive messages, the test Consul server's requests, object storage's
    /// requests.
    pub fn wire_requests(&self) -> Option<usize> {
        match self {
            Self::Etcd(store) => usize::try_from(store.requests_sent()).ok(),
            Self::Consul(api, _) => Some(api.requests().values().sum()),
            Self::ObjectStore(counting, _) => Some(counting.total()),
            // Messages this client published: requests, key-value writes, watches' set-up.
            Self::Nats(store) => usize::try_from(
                store
                    .client()
                    .statistics()
                    .out_messages
                    .load(std::sync::atomic::Ordering::Relaxed),
            )
            .ok(),
            _ => None,
        }
    }

    /// Requests the server has handled so far, by its own count: Postgres transactions
    /// committed in this database, Redis commands processed, etcd gRPC messages received (by
    /// every member), HTTP requests to the test Consul server, S3 requests counted at the client.
    pub async fn server_requests(&self) -> Option<u64> {
        match self {
            // The test API server and moto keep no count of their requests.
            Self::File(_) | Self::Kubernetes(..) | Self::DynamoDb(_) => None,
            Self::Mysql(store) | Self::MysqlNamed(store) => {
                use leader_mysql::mysql_async::prelude::Queryable;
                let mut conn = store.pool().get_conn().await.ok()?;
                // Statements the server ran, from every client (this one's included).
                let row: Option<(String, u64)> = conn
                    .query_first("SHOW GLOBAL STATUS LIKE 'Questions'")
                    .await
                    .ok()?;
                row.map(|(_, n)| n)
            }
            Self::ObjectStore(counting, _) => u64::try_from(counting.total()).ok(),
            // Messages this process's client published (every lock of the store shares it).
            Self::Nats(store) => Some(
                store
                    .client()
                    .statistics()
                    .out_messages
                    .load(std::sync::atomic::Ordering::Relaxed),
            ),
            Self::Consul(api, _) => u64::try_from(api.requests().values().sum::<usize>()).ok(),
            Self::Postgres(store) | Self::PostgresAdvisory(store) => {
                let client = store.pool().get().await.ok()?;
                client
                    .batch_execute("SELECT pg_stat_clear_snapshot()")
                    .await
                    .ok()?;
                // Statistics reach the view at most once a second.
                tokio::time::sleep(Duration::from_millis(1100)).await;
                client
                    .batch_execute("SELECT pg_stat_clear_snapshot()")
                    .await
                    .ok()?;
                let row = client
                    .query_one(
                        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
                        &[],
                    )
                    .await
                    .ok()?;
                u64::try_from(row.get::<_, i64>(0)).ok()
            }
            Self::Redis(store) => {
                let mut connection = store.connection();
                let info: String = redis::cmd("INFO")
                    .arg("stats")
                    .query_async(&mut connection)
                    .await
                    .ok()?;
                info.lines()
                    .find_map(|l| l.strip_prefix("total_commands_processed:"))
                    .and_then(|n| n.trim().parse().ok())
            }
            Self::Etcd(_) => {
                // Every member's count: requests go to whichever member answers.
                let mut total = 0.0;
                for endpoint in etcd_endpoints() {
                    let address = endpoint.trim_start_matches("http://").to_owned();
                    let metrics =
                        tokio::task::spawn_blocking(move || http_get(&address, "/metrics"))
                            .await
                            .ok()??;
                    total += metrics
                        .lines()
                        .filter(|l| l.starts_with("grpc_server_msg_received_total{"))
                        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                        .sum::<f64>();
                }
                Some(total as u64)
            }
        }
    }
}

/// Whether `BENCH_BACKENDS` (names or their beginnings, comma-separated) keeps the backend
/// named `name`; every backend when it is not set.
pub fn wanted(name: &str) -> bool {
    std::env::var("BENCH_BACKENDS").map_or(true, |wanted| {
        wanted.split(',').any(|n| name.starts_with(n.trim()))
    })
}

/// The fault harness's backends that `BENCH_BACKENDS` keeps.
pub fn harness_backends() -> impl Iterator<Item = leader_tests::harness::campaign::Backend> {
    leader_tests::harness::campaign::Backend::ALL
        .into_iter()
        .filter(|backend| wanted(backend.name()))
}

/// A store on the test S3 server's bucket, its requests counted.
fn object_store() -> Result<(Arc<Counting>, BucketStore), Box<dyn std::error::Error>> {
    leader_object_store::ensure_crypto_provider();
    let bucket = leader_test_support::s3_bucket()?;
    let mut builder = BucketStore::from_url(&format!("s3://{bucket}/"));
    for (key, value) in leader_test_support::s3_options() {
        builder = builder.option(key, value);
    }
    let counting = Counting::new(builder.build()?.object_store().clone());
    let store = BucketStore::builder(counting.clone(), format!("s3://{bucket}"))
        .prefix(format!("leader-bench-{:08x}/", fastrand::u32(..)))
        .build()?;
    Ok((counting, store))
}

/// A store on a new table of the test DynamoDB server, created and checked.
async fn dynamodb() -> Result<leader::dynamodb::DynamoStore, Box<dyn std::error::Error>> {
    use leader::dynamodb::{DynamoStore, aws_config, aws_sdk_dynamodb};
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(leader_test_support::dynamodb_endpoint())
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "test", "test", None, None, "bench",
        ))
        .load()
        .await;
    let store = DynamoStore::builder(format!("leader-bench-{:08x}", fastrand::u32(..)))
        .sdk_config(config)
        .create_table(true)
        .build()
        .await?;
    store.check_table().await?;
    Ok(store)
}

fn http_get(address: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

/// CPU time of this process so far (user + system).
pub fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(") ")
        .map(|(_, rest)| rest.split(' ').collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the command name.
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i)?.parse::<u64>().ok())
        .sum();
    Duration::from_millis(ticks * 10) // USER_HZ is 100 on Linux
}

/// A line of `/proc/self/status` in kB (`VmRSS`, `VmHWM`).
pub fn memory_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

pub use leader_test_support::bench::{knob, percentile};

pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// A shard set's member run with `work` for each shard it takes (work that runs until its
/// shard is taken away): its shutdown, its task and its state.
pub fn run_member<F, Fut>(
    shards: leader_core::Shards,
    work: F,
) -> (
    leader_core::CancellationToken,
    tokio::task::JoinHandle<()>,
    tokio::sync::watch::Receiver<leader_core::ShardsState>,
)
where
    F: Fn(u32, leader_core::Leadership) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let state = shards.subscribe();
    let shutdown = leader_core::CancellationToken::new();
    let task = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            let _ = shards.run_per_shard(shutdown, work).await;
        }
    });
    (shutdown, task, state)
}

/// How long until `states` are balanced (every shard of `count` owned, within one of each
/// other), or `None` after `within`.
pub async fn until_balanced(
    states: &[&tokio::sync::watch::Receiver<leader_core::ShardsState>],
    count: u32,
    within: Duration,
) -> Option<Duration> {
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        if leader_core::conformance::balanced(states, count) {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}
