//! What a campaign runs on and with: the backends, the faults, the settings.

use std::path::Path;
use std::time::Duration;

use super::{HarnessError, connect_sink, proxy_to};
use crate::harness::Programs;
use crate::harness::proxy::Proxy;
use crate::harness::servers::{PrivateServer, ServerKind};

/// The backend the replicas elect on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Backend {
    /// `file://`: a lock file in a temporary directory (process faults only).
    File,
    /// `postgres://`: the table lock on a private Postgres.
    Postgres,
    /// `postgres://...?advisory=true`: the advisory lock on a private Postgres, with an idle
    /// session timeout of [`Settings::advisory_idle`].
    Advisory,
    /// `mysql://`: the table lock on a private MariaDB.
    Mysql,
    /// `mysql://...?lock=named`: the `GET_LOCK` lock on a private MariaDB.
    MysqlNamed,
    /// `nats://`: a key-value bucket on a private NATS server with JetStream.
    Nats,
    /// `zk://`: a standalone ZooKeeper server of the run's own, with sessions of the least
    /// length it grants (4 s) or a lease, whichever is longer.
    ZooKeeper,
    /// `redis://`: a private Redis.
    Redis,
    /// `etcd://`: a private etcd.
    Etcd,
    /// `etcd://` with three members: a private three-member etcd cluster, each member behind a
    /// proxy of its own that every replica goes through, so that one member can be killed,
    /// frozen or cut off from the replicas while the others serve.
    EtcdCluster,
    /// `kubernetes://`: a Lease on a private test API server (`kube-api-server`), each replica
    /// with a kubeconfig of its own that points at its proxy.
    Kubernetes,
    /// `consul://`: a key locked by a session on a private test Consul server
    /// (`consul-api-server`).
    Consul,
    /// `s3://`: an object written with preconditions on a private S3 API server (moto's).
    ObjectStore,
    /// `dynamodb://`: an item written with conditions in a table of its own
    /// ([`FAULT_TABLE`], which the lock creates) on a private moto server, the one
    /// [`Backend::ObjectStore`] runs (moto answers DynamoDB on the same port).
    DynamoDb,
}

impl Backend {
    /// Every backend, in the order reports list them.
    pub const ALL: [Self; 14] = [
        Self::File,
        Self::Postgres,
        Self::Advisory,
        Self::Mysql,
        Self::MysqlNamed,
        Self::Nats,
        Self::ZooKeeper,
        Self::Redis,
        Self::Etcd,
        Self::EtcdCluster,
        Self::Kubernetes,
        Self::Consul,
        Self::ObjectStore,
        Self::DynamoDb,
    ];

    /// The faults that apply: the network and server faults need a server.
    #[must_use]
    pub fn faults(self) -> &'static [Fault] {
        match self {
            Self::File => &[Fault::Kill, Fault::Freeze, Fault::FreezeInOperation],
            // Faults of one member, and of the leader (which must still fail over).
            Self::EtcdCluster => &[
                Fault::Kill,
                Fault::Freeze,
                Fault::MemberKill,
                Fault::MemberFreeze,
                Fault::MemberCut,
            ],
            // An object store or DynamoDB does not lose what it acknowledged when it restarts,
            // and moto keeps nothing on disk to play that with: no server restart.
            Self::ObjectStore | Self::DynamoDb => &[
                Fault::Kill,
                Fault::Freeze,
                Fault::Cut,
                Fault::Latency,
                Fault::ServerFreeze,
                Fault::Outage,
            ],
            _ => &[
                Fault::Kill,
                Fault::Freeze,
                Fault::Cut,
                Fault::Latency,
                Fault::Restart,
                Fault::ServerFreeze,
                Fault::Outage,
            ],
        }
    }

    /// A private server of this backend's kind, started off the runtime; none for the file lock.
    pub(crate) async fn start_server(
        self,
        programs: &Programs,
    ) -> Result<Option<PrivateServer>, HarnessError> {
        let Some(kind) = self.server() else {
            return Ok(None);
        };
        let program = match kind {
            ServerKind::Consul => programs.consul_api_server.clone(),
            _ => programs.kube_api_server.clone(),
        };
        let server =
            tokio::task::spawn_blocking(move || PrivateServer::start(kind, Some(&program)))
                .await
                .expect("server task")?;
        Ok(Some(server))
    }

    /// The `--lock` URL of a replica that reaches the server at `port` (a proxy, usually), and
    /// the environment it needs: for Kubernetes a `KUBECONFIG` for that port, written into
    /// `dir`; for object storage and DynamoDB the endpoint and credentials. The file lock's
    /// directory is `dir/lock`.
    fn replica_url(
        self,
        dir: &Path,
        port: u16,
        settings: &Settings,
    ) -> Result<(String, Vec<(String, String)>), HarnessError> {
        let url = match self {
            Self::File => crate::file_lock_in(dir),
            Self::Postgres => format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            Self::Advisory => format!(
                "postgres://postgres@127.0.0.1:{port}/postgres?advisory=true&idle_session_timeout={}ms",
                settings.advisory_idle().as_millis()
            ),
            Self::Mysql => format!("mysql://root@127.0.0.1:{port}/leader"),
            Self::MysqlNamed => format!(
                "mysql://root@127.0.0.1:{port}/leader?lock=named&idle_session_timeout={}s",
                whole_seconds(settings.advisory_idle()).max(1)
            ),
            Self::Nats => format!("nats://127.0.0.1:{port}/fault"),
            // A session that takes the lease: it must outlast the lease by the client's
            // connection timeout (2/5 of a session under 10 s, else 4 s).
            Self::ZooKeeper => format!(
                "zk://127.0.0.1:{port}?session_timeout={}ms",
                (settings.lease * 5 / 3)
                    .max(settings.lease + Duration::from_secs(4))
                    .as_millis()
            ),
            Self::Redis => format!("redis://127.0.0.1:{port}"),
            Self::Etcd => format!("etcd://127.0.0.1:{port}"),
            // `port` is the first member's proxy; the others' follow (see `run`). A member
            // that does not answer is given up after a quarter of the renew deadline.
            Self::EtcdCluster => {
                let hosts: Vec<String> =
                    (0..3).map(|i| format!("127.0.0.1:{}", port + i)).collect();
                format!(
                    "etcd://{}/?member_timeout={}ms",
                    hosts.join(","),
                    (settings.renew / 4).as_millis()
                )
            }
            Self::Consul => format!("consul://127.0.0.1:{port}/fault/"),
            Self::ObjectStore => {
                let env = leader_test_support::s3_env_at(&format!("http://127.0.0.1:{port}"));
                return Ok((format!("s3://{FAULT_BUCKET}/fault/"), env));
            }
            // Every replica may create the table; the ones that lose the race use it.
            Self::DynamoDb => {
                let env = leader_test_support::dynamodb_env_at(&format!("http://127.0.0.1:{port}"));
                return Ok((format!("dynamodb://{FAULT_TABLE}?create_table=true"), env));
            }
            Self::Kubernetes => {
                let path = dir.join(format!("kubeconfig-{port}"));
                let config = leader_test_support::kube_api::kubeconfig(
                    &format!("http://127.0.0.1:{port}"),
                    "default",
                );
                std::fs::write(&path, config).map_err(|source| HarnessError::Io {
                    what: format!("writing {}", path.display()),
                    source,
                })?;
                return Ok((
                    "kubernetes://default".to_owned(),
                    vec![("KUBECONFIG".to_owned(), path.display().to_string())],
                ));
            }
        };
        Ok((url, Vec::new()))
    }

    /// [`replica_url`](Self::replica_url), checked by the backend's own parser, as the `leader`
    /// command will parse it.
    pub(crate) fn replica_lock(
        self,
        dir: &Path,
        port: u16,
        settings: &Settings,
    ) -> Result<(String, Vec<(String, String)>), HarnessError> {
        let (url, env) = self.replica_url(dir, port, settings)?;
        leader::LockUrl::parse(&url)?;
        Ok((url, env))
    }

    fn server(self) -> Option<ServerKind> {
        match self {
            Self::File => None,
            Self::Postgres | Self::Advisory => Some(ServerKind::Postgres),
            Self::Mysql | Self::MysqlNamed => Some(ServerKind::Mysql),
            Self::Nats => Some(ServerKind::Nats),
            Self::ZooKeeper => Some(ServerKind::ZooKeeper),
            Self::Redis => Some(ServerKind::Redis),
            Self::Etcd => Some(ServerKind::Etcd),
            // Started by `run`, as a cluster.
            Self::EtcdCluster => None,
            Self::Kubernetes => Some(ServerKind::Kube),
            Self::Consul => Some(ServerKind::Consul),
            Self::ObjectStore | Self::DynamoDb => Some(ServerKind::S3),
        }
    }

    /// Whether a follower waits out a holder's lease on its own clock from when it first reads
    /// the holder's version (S2), rather than the store deciding expiry: then a version first
    /// read after an outage (the holder renewed once more before it went) runs a whole lease
    /// from that read.
    #[must_use]
    pub fn counts_leases_itself(self) -> bool {
        matches!(
            self,
            Self::Nats
                | Self::ZooKeeper
                | Self::Kubernetes
                | Self::Consul
                | Self::ObjectStore
                | Self::DynamoDb
        )
    }

    /// Lower-case name, as in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Postgres => "postgres",
            Self::Advisory => "postgres advisory",
            Self::Mysql => "mysql",
            Self::MysqlNamed => "mysql GET_LOCK",
            Self::Nats => "nats",
            Self::ZooKeeper => "zookeeper",
            Self::Redis => "redis",
            Self::Etcd => "etcd",
            Self::EtcdCluster => "etcd (three members)",
            Self::Kubernetes => "kubernetes",
            Self::Consul => "consul",
            Self::ObjectStore => "object store (s3)",
            Self::DynamoDb => "dynamodb",
        }
    }
}

/// A fault, injected into the replica that leads at the time (or, for the server faults, into
/// the server they all use).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// SIGKILL of its `leader` process (its COMMAND dies with it); the replica is started again
    /// under a new identity once another leads.
    Kill,
    /// SIGSTOP of `leader` and COMMAND's group for longer than the lease, then SIGCONT:
    /// COMMAND first, then its supervisor and `leader`, so that it may write before anything
    /// of its replica can stop it.
    Freeze,
    /// Its connection to the backend cut (the proxy forwards nothing) until another leads, then
    /// restored with the held bytes delivered late: a partition of the leader alone, while the
    /// others still reach the server.
    Cut,
    /// Every byte between it and the backend held for twice the renew deadline, until another
    /// leads.
    Latency,
    /// The backend server crashed, down for one lease duration, and started again on its data.
    Restart,
    /// The backend server frozen (SIGSTOP of all its processes) for one lease duration, its
    /// connections open and silent, then resumed (SIGCONT).
    ServerFreeze,
    /// Every replica's connection to the backend closed, and every new one refused, for
    /// [`Settings::outage`]: a full outage. The replicas' failed attempts a second are measured
    /// meanwhile (S9).
    Outage,
    /// For the file lock: its `leader` stopped inside a write of the record, by a SIGSTOP that
    /// `strace` injects at one of the write's system calls (after the temporary file's `fsync`,
    /// before the link; after the `link`, before the check for a newer version; at the first
    /// `unlink`), and its COMMAND with it; resumed as [`Fault::Freeze`] is.
    FreezeInOperation,
    /// One member of a three-member etcd cluster killed (SIGKILL) for a renew deadline and a
    /// second, then started again on its data: the member the leader talks to, or the raft
    /// leader, or another, in turn. The leader must keep its term.
    MemberKill,
    /// One member frozen (SIGSTOP) for a renew deadline and a second, its connections open and
    /// silent, then resumed. The leader must keep its term.
    MemberFreeze,
    /// One member cut off from every replica (its proxy forwards nothing) for a renew deadline
    /// and a second, then reachable again. The leader must keep its term.
    MemberCut,
}

impl Fault {
    /// Every fault, in the order a round injects them.
    pub const ALL: [Self; 11] = [
        Self::Kill,
        Self::Freeze,
        Self::Cut,
        Self::Latency,
        Self::Restart,
        Self::ServerFreeze,
        Self::Outage,
        Self::FreezeInOperation,
        Self::MemberKill,
        Self::MemberFreeze,
        Self::MemberCut,
    ];

    /// Lower-case name, as in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "sigkill",
            Self::Freeze => "sigstop",
            Self::Cut => "network cut",
            Self::Latency => "latency spike",
            Self::Restart => "server restart",
            Self::ServerFreeze => "server frozen",
            Self::Outage => "full outage",
            Self::FreezeInOperation => "sigstop in an operation",
            Self::MemberKill => "member killed",
            Self::MemberFreeze => "member frozen",
            Self::MemberCut => "member cut off",
        }
    }

    /// Whether it is a fault of one member of a cluster, which must cost the leader nothing.
    #[must_use]
    pub fn of_a_member(self) -> bool {
        matches!(
            self,
            Self::MemberKill | Self::MemberFreeze | Self::MemberCut
        )
    }

    /// Whether the fault is timed from its end (the server back, the outage over) rather than
    /// from its injection.
    fn timed_from_its_end(self) -> bool {
        matches!(self, Self::Restart | Self::ServerFreeze | Self::Outage)
    }
}

/// Timing of the replicas and how many there are.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// `--lease-duration`.
    pub lease: Duration,
    /// `--renew-deadline`.
    pub renew: Duration,
    /// `--retry-period`.
    pub retry: Duration,
    /// Number of replicas.
    pub replicas: usize,
    /// How many of the replicas are another project's client instead of `leader run` (the last
    /// ones): kubert claimants, on [`Backend::Kubernetes`] only, with a lease of whole seconds.
    pub peers: usize,
    /// How long a [`Fault::Outage`] lasts.
    pub outage: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        let lease = Duration::from_secs(2);
        Self {
            lease,
            renew: Duration::from_millis(1500),
            retry: Duration::from_millis(250),
            replicas: 3,
            peers: 0,
            outage: lease * 3,
        }
    }
}

impl Settings {
    /// The advisory lock's idle session timeout: how long the server keeps the session (and
    /// its advisory lock) of a holder that went silent. Twice the lease: well above the
    /// holder's longest gap between requests (a retry period and its jitter).
    #[must_use]
    pub fn advisory_idle(&self) -> Duration {
        self.lease * 2
    }

    /// The promised bound on the time from a fault (for a server restart or freeze, from the
    /// server being back; for an outage, from its end) to the next leader's COMMAND starting:
    /// a lease and two retry periods, plus a generous margin for a loaded machine (one second;
    /// three when the server was away, for clients to reconnect). After an outage, add the
    /// longest back-off (a lease). On the advisory lock and the MySQL `GET_LOCK` lock, a leader
    /// that went silent (frozen, cut off, slowed down, or its server frozen) keeps its session
    /// until the idle session timeout ends it. On etcd the lease is whole seconds (the lock rounds it up), at least
    /// etcd's minimum TTL (2 s with its default election timeout: a 1 s grant is answered with
    /// 2 s), and etcd revokes expired leases every 500 ms. On Consul the holder's renewals are
    /// writes of its renewal key, and candidates take over a lease after the last one they read,
    /// as on any lock renewed by writes. Under a latency spike the leader's last renewal,
    /// sent up to a renew deadline after its last success, reaches the server twice the renew
    /// deadline late and extends the lease from there: the server cannot tell a late request
    /// from a new one. A server restart adds the time its clients may wait to try it again
    /// (`reconnect_wait`, with the time it was away).
    #[must_use]
    pub fn recovery_bound(&self, backend: Backend, fault: Fault) -> Duration {
        let margin = if fault.timed_from_its_end() {
            Duration::from_secs(3)
        } else {
            Duration::from_secs(1)
        };
        let lease = match backend {
            Backend::Etcd | Backend::EtcdCluster => {
                Duration::from_secs(whole_seconds(self.lease).max(2)) + Duration::from_millis(500)
            }
            _ => self.lease,
        };
        let mut bound = lease + self.retry * 2 + margin;
        if fault == Fault::Outage {
            bound += self.lease;
        }
        if fault == Fault::Latency {
            bound += self.renew * 3;
        }
        if matches!(backend, Backend::Advisory | Backend::MysqlNamed)
            && matches!(
                fault,
                Fault::Freeze | Fault::Cut | Fault::Latency | Fault::ServerFreeze
            )
        {
            // MySQL counts its idle session timeout in whole seconds.
            bound += match backend {
                Backend::MysqlNamed => {
                    Duration::from_secs(whole_seconds(self.advisory_idle()).max(1))
                }
                _ => self.advisory_idle(),
            };
        }
        bound
    }
}

/// The bucket of a private S3 server ([`ServerKind::S3`] makes it when it starts).
pub const FAULT_BUCKET: &str = "leader-fault";

/// The DynamoDB table of a private moto server ([`Backend::DynamoDb`]'s replicas create it).
pub const FAULT_TABLE: &str = "leader-fault";

/// How much later than the server's return its clients may come back, after `away` without it:
/// added to the recovery bound of a server restart.
///
/// The ZooKeeper client (zookeeper-client 0.11, `src/endpoint.rs`, `IterableEndpoints::timeout`)
/// waits before each pass over the servers after the first, twice as long each time: 100 ms per
/// server (at most 1 s) doubled per pass, plus up to 100 ms of jitter. With one server, pass `k`
/// waits 100 ms x 2^(k-1) and its jitter, and the passes before it took at least
/// 100 ms x (2^(k-1) - 1): a server back `away` after the client lost it is tried again less than
/// `away` + 200 ms after it returned (and the refused attempt's own time, a connection refused
/// on loopback). A frozen server gets no allowance: the client's attempts on it wait for an
/// answer rather than fail, and it answers them as it thaws. Nor does a full outage: its bound
/// adds a lease for back-off, and the client waits no longer than its session's deadline
/// (`src/session/mod.rs`, `start`), which the runs' short sessions reach within the outage. The
/// other clients try again within their retry period.
pub(super) fn reconnect_wait(backend: Backend, away: Duration) -> Duration {
    match backend {
        Backend::ZooKeeper => away + Duration::from_millis(200),
        _ => Duration::ZERO,
    }
}

/// `lease` rounded up to whole seconds.
pub(super) fn whole_seconds(lease: Duration) -> u64 {
    u64::try_from(lease.as_millis().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// What a run stands on: its temporary directory, the backend's private server (if it runs
/// one) and a proxy to that server per replica, through which the connection faults go.
pub(crate) struct Stage {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) server: Option<PrivateServer>,
    pub(crate) proxies: Vec<Proxy>,
}

/// Sets up the [`Stage`] of a run of `replicas` replicas on `backend`.
pub(crate) async fn stage(
    backend: Backend,
    programs: &Programs,
    replicas: usize,
) -> Result<Stage, HarnessError> {
    let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
        what: "temporary directory".into(),
        source,
    })?;
    let server = backend.start_server(programs).await?;
    let mut proxies = Vec::new();
    if let Some(server) = &server {
        for _ in 0..replicas {
            proxies.push(proxy_to(server).await?);
        }
    }
    Ok(Stage {
        dir,
        server,
        proxies,
    })
}

/// Creates the fenced sink's tables of one token under `prefix`: the high-water mark, and
/// every write with whether the sink accepted it.
pub(crate) async fn create_token_sink(
    sink: &tokio_postgres::Client,
    prefix: &str,
) -> Result<(), tokio_postgres::Error> {
    sink.batch_execute(&format!(
        "CREATE TABLE {prefix}_mark (token bigint NOT NULL);
         INSERT INTO {prefix}_mark VALUES (0);
         CREATE TABLE {prefix}_writes (seq bigserial PRIMARY KEY, token bigint NOT NULL,
             writer text NOT NULL, at bigint NOT NULL, accepted bool NOT NULL);"
    ))
    .await
}

/// A new run's tag (which names its election) and the prefix of its fenced sink of one token on
/// `sink_url` (`{kind}_sink_{tag}`), whose tables are made.
pub(crate) async fn token_sink(
    sink_url: &str,
    kind: &str,
) -> Result<(String, String), HarnessError> {
    let (sink, sink_error) = connect_sink(sink_url).await?;
    let tag = format!("{:08x}", fastrand::u32(..));
    let prefix = format!("{kind}_sink_{tag}");
    create_token_sink(&sink, &prefix)
        .await
        .map_err(&sink_error)?;
    Ok((tag, prefix))
}
