//! Locks from URLs: which backend, and the lock for one election on it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use leader_core::backend::roster_key;
use leader_core::{FileUrl, LockError, LockSet, LockTarget, ResourceLock, UrlError, redact_url};

/// Why a lock URL cannot be used. The message never contains the URL's password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockUrlError {
    /// The URL is malformed, has an unknown scheme or a bad parameter.
    #[error("lock URL {url}: {message}")]
    Invalid {
        /// The URL, password removed.
        url: String,
        /// What is wrong with it.
        message: String,
    },
    /// The URL names a backend this build leaves out.
    #[error(
        "lock URL {url}: this build has no {backend} lock; enable the `{feature}` feature of the `leader` crate (or of `leader-cli`)"
    )]
    NotBuilt {
        /// The URL, password removed.
        url: String,
        /// The backend, for people.
        backend: &'static str,
        /// The cargo feature that brings it.
        feature: &'static str,
    },
}

/// Why [`open`] failed: the URL, or the backend when connecting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The URL cannot be used.
    #[error(transparent)]
    Url(#[from] LockUrlError),
    /// The backend refused or could not be reached.
    #[error(transparent)]
    Lock(#[from] LockError),
}

/// A lock URL, parsed by the crate of its backend, before anything connects. The facade only
/// maps the scheme to that crate ([`BACKENDS`]); each crate owns its grammar, in its `LockUrl`
/// (such as `leader_postgres::LockUrl`). The table of the [crate documentation](crate), rendered
/// from [`BACKENDS`], shows every scheme with its backend, feature, crate and an example URL.
///
/// Errors and [`describe`](Self::describe) never show a password or token, whatever it holds.
/// Percent-encode `/`, `?`, `#` and `@` in one (`%2F`, `%3F`, `%23`, `%40`), and `@` in a path
/// or parameter: a URL with an `@` after its first `/`, `?` or `#` is refused, as a parser would
/// read a part of the password as the host.
#[derive(Debug)]
pub struct LockUrl {
    target: Box<dyn LockTarget>,
}

/// A backend the facade knows: its schemes, its name for people, the cargo feature and crate that
/// bring it, what its lock is and an example URL (the lock-URL table of the READMEs is rendered
/// from these), and its crate's parser when this build has it.
#[derive(Debug)]
pub struct Backend {
    /// The URL schemes it takes.
    pub schemes: &'static [&'static str],
    /// Its name, for messages.
    pub name: &'static str,
    /// The feature of this crate (and of `leader-cli`) that brings it; empty when always there.
    pub feature: &'static str,
    /// The crate that parses and opens its URLs.
    pub crate_name: &'static str,
    /// What the lock is and the URL's main parameters, in a line of Markdown.
    pub description: &'static str,
    /// A URL of it, as a user would write one.
    pub example: &'static str,
    parse: Option<Parse>,
}

type Parse = fn(&str) -> Result<Box<dyn LockTarget>, UrlError>;

/// Every backend the facade knows, built or not: a scheme maps to one crate, which parses and
/// opens its own URLs.
pub const BACKENDS: &[Backend] = &[
    Backend {
        schemes: &["file"],
        name: "file",
        feature: "",
        crate_name: "leader-core",
        description: "a directory on this host, one directory per election in it: the processes of one machine, no server",
        example: "file:///run/myapp/leader",
        parse: Some(file_target),
    },
    Backend {
        schemes: &["postgres", "postgresql"],
        name: "Postgres",
        feature: "postgres",
        crate_name: "leader-postgres",
        description: "a row of a Postgres table (`table`, `schema`), or with `advisory=true` the \
                      advisory lock; `listen=false` behind PgBouncer in transaction mode; other \
                      parameters are the driver's (`sslmode`)",
        example: "postgres://app:secret@db:5432/app?table=leader_election",
        #[cfg(feature = "postgres")]
        parse: Some(leader_postgres::LockUrl::target),
        #[cfg(not(feature = "postgres"))]
        parse: None,
    },
    Backend {
        schemes: &["mysql", "mariadb"],
        name: "MySQL",
        feature: "mysql",
        crate_name: "leader-mysql",
        description: "a row of a MySQL or MariaDB table (`table`), or with `lock=named` the \
                      `GET_LOCK` lock; `ssl_ca` for a private CA; other parameters are the \
                      driver's",
        example: "mysql://app:secret@db:3306/app?lock=named",
        #[cfg(feature = "mysql")]
        parse: Some(leader_mysql::LockUrl::target),
        #[cfg(not(feature = "mysql"))]
        parse: None,
    },
    Backend {
        schemes: &["nats"],
        name: "NATS",
        feature: "nats",
        crate_name: "leader-nats",
        description: "a key in the NATS JetStream key-value bucket the path names (default \
                      `leader`); `server` for each other server, `creds` for a credentials file",
        example: "nats://app:secret@nats1:4222/leader?server=nats2:4222",
        #[cfg(feature = "nats")]
        parse: Some(leader_nats::LockUrl::target),
        #[cfg(not(feature = "nats"))]
        parse: None,
    },
    Backend {
        schemes: &["zk", "zookeeper"],
        name: "ZooKeeper",
        feature: "zookeeper",
        crate_name: "leader-zookeeper",
        description: "znodes of a ZooKeeper ensemble, under the chroot (which must exist) and \
                      `prefix` (default `/leader`); `session_timeout`; a user and password log \
                      in with `digest`",
        example: "zk://app:secret@zk1:2181,zk2:2181,zk3:2181/myapp?session_timeout=30s",
        #[cfg(feature = "zookeeper")]
        parse: Some(leader_zookeeper::LockUrl::target),
        #[cfg(not(feature = "zookeeper"))]
        parse: None,
    },
    Backend {
        schemes: &["redis", "rediss"],
        name: "Redis",
        feature: "redis",
        crate_name: "leader-redis",
        description: "a hash in one Redis (`rediss://`: TLS), the database as the path; `prefix` for \
                      its keys, `protocol` for the driver",
        example: "redis://:secret@cache:6379/0?prefix=myapp:",
        #[cfg(feature = "redis")]
        parse: Some(leader_redis::LockUrl::target),
        #[cfg(not(feature = "redis"))]
        parse: None,
    },
    Backend {
        schemes: &["etcd", "etcds"],
        name: "etcd",
        feature: "etcd",
        crate_name: "leader-etcd",
        description: "a key in etcd v3 (`etcds://`: TLS); name every member; `prefix`, \
                      `member_timeout`; building it needs `protoc`",
        example: "etcd://app:secret@etcd1:2379,etcd2:2379,etcd3:2379/?prefix=myapp/",
        #[cfg(feature = "etcd")]
        parse: Some(leader_etcd::LockUrl::target),
        #[cfg(not(feature = "etcd"))]
        parse: None,
    },
    Backend {
        schemes: &["consul", "consuls"],
        name: "Consul",
        feature: "consul",
        crate_name: "leader-consul",
        description: "a Consul KV key locked by a session, under the path (`consuls://`: TLS, \
                      port 8501); `dc`; the ACL token from `CONSUL_HTTP_TOKEN`, never in the URL",
        example: "consul://consul.internal:8500/myapp/?dc=dc1",
        #[cfg(feature = "consul")]
        parse: Some(leader_consul::LockUrl::target),
        #[cfg(not(feature = "consul"))]
        parse: None,
    },
    Backend {
        schemes: &["s3", "gs", "az", "azure"],
        name: "object storage",
        feature: "object-store",
        crate_name: "leader-object-store",
        description: "one object in S3 (or an S3-compatible store), Cloud Storage or Azure Blob \
                      Storage, written only with preconditions; credentials, region and \
                      endpoint from the environment",
        example: "s3://my-bucket/leader/",
        #[cfg(feature = "object-store")]
        parse: Some(leader_object_store::LockUrl::target),
        #[cfg(not(feature = "object-store"))]
        parse: None,
    },
    Backend {
        schemes: &["dynamodb"],
        name: "DynamoDB",
        feature: "dynamodb",
        crate_name: "leader-dynamodb",
        description: "an item in a DynamoDB table (a string partition key `name`), written only \
                      with conditions; `create_table`, `allow_global_table`; region, endpoint \
                      and credentials from the AWS environment",
        example: "dynamodb://leader_locks",
        #[cfg(feature = "dynamodb")]
        parse: Some(leader_dynamodb::LockUrl::target),
        #[cfg(not(feature = "dynamodb"))]
        parse: None,
    },
    Backend {
        schemes: &["kubernetes"],
        name: "Kubernetes",
        feature: "kubernetes",
        crate_name: "leader-kube",
        description: "a `coordination.k8s.io/v1` Lease named after the election in that \
                      namespace, with the in-cluster configuration or the kubeconfig; \
                      `binary_version` for coordinated leader election",
        example: "kubernetes://myapp",
        #[cfg(feature = "kubernetes")]
        parse: Some(leader_kube::LockUrl::target),
        #[cfg(not(feature = "kubernetes"))]
        parse: None,
    },
];

fn file_target(url: &str) -> Result<Box<dyn LockTarget>, UrlError> {
    Ok(Box::new(FileUrl::parse(url)?))
}

impl fmt::Display for LockUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// The schemes lock URLs use, for messages: `file://, postgres://, ...`.
fn schemes() -> String {
    BACKENDS
        .iter()
        .flat_map(|b| b.schemes)
        .map(|s| format!("{s}://"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `name` is a URL scheme: a letter, then letters, digits, `+`, `-` or `.`.
fn is_scheme(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphabetic())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
}

/// The default lock directory for election `name`: `leader-NAME` in `$XDG_RUNTIME_DIR`, else in
/// the temporary directory.
pub fn default_file(name: &str) -> PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("leader-{safe}"))
}

/// How long [`open`] waits for the backend to connect and answer its first read.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens the lock that `url` names for election `name`, as candidate `identity`, and checks it:
/// connects where the backend needs it and reads the record once, within [`OPEN_TIMEOUT`]. So
/// a server that is down or does not answer, a wrong password, a missing database, table or
/// bucket, missing rights to read and an unreadable record are errors here, at start, as the
/// `leader` command reports them; later outages are the elector's to retry. Rights to write
/// are not tried here (a write would change the record): a store that refuses the elector's
/// first write answers [`LockError::Forbidden`] (with the store's own message), which the
/// elector logs, passes to `on_error` and keeps in its status (`ElectorStatus::last_error`),
/// and tries again with back-off.
///
/// # Errors
/// The URL cannot be used ([`LockUrlError`]), or the backend's set-up or first read failed
/// ([`LockError`]; [`LockError::Timeout`] after [`OPEN_TIMEOUT`]).
pub async fn open(
    url: &str,
    name: &str,
    identity: &str,
) -> Result<Box<dyn ResourceLock>, OpenError> {
    LockUrl::parse(url)?
        .open_checked(name, identity, OPEN_TIMEOUT)
        .await
}

/// `opening`, or a timeout after `timeout`.
async fn within<T>(
    url: &LockUrl,
    timeout: Duration,
    opening: impl std::future::Future<Output = Result<T, LockError>>,
) -> Result<T, OpenError> {
    match tokio::time::timeout(timeout, opening).await {
        Ok(opened) => Ok(opened?),
        Err(_) => Err(OpenError::Lock(LockError::Timeout {
            lock: url.describe(),
            operation: "open",
            after: timeout,
        })),
    }
}

/// Opens the records of shard set `name` that `url` names, as member `identity` (see
/// [`Shards`](leader_core::Shards)), and checks them as [`open`] checks a lock: connects and
/// reads the set's roster once, within [`OPEN_TIMEOUT`].
///
/// # Errors
/// As [`open`]; [`LockError::Misconfigured`] for a backend that keeps no shard sets.
pub async fn open_set(
    url: &str,
    name: &str,
    identity: &str,
) -> Result<Box<dyn LockSet>, OpenError> {
    LockUrl::parse(url)?
        .open_set_checked(name, identity, OPEN_TIMEOUT)
        .await
}

impl LockUrl {
    /// Parses a lock URL with the crate of its scheme ([`BACKENDS`]).
    ///
    /// # Errors
    /// A malformed URL, an unknown scheme, a bad parameter, or a backend this build leaves out.
    pub fn parse(lock: &str) -> Result<Self, LockUrlError> {
        let redacted = redact_url(lock);
        // What comes before a `://` that follows no scheme (`app:pw@db?next=http://x`) may
        // hold a password: it is never named as a scheme.
        let Some((scheme, _)) = lock
            .split_once("://")
            .filter(|(scheme, _)| is_scheme(scheme))
        else {
            return Err(LockUrlError::Invalid {
                url: redacted,
                message: format!(
                    "not a URL; use one of {}, like file:///run/myapp/leader",
                    schemes()
                ),
            });
        };
        let scheme = scheme.to_ascii_lowercase();
        let Some(backend) = BACKENDS
            .iter()
            .find(|b| b.schemes.contains(&scheme.as_str()))
        else {
            return Err(LockUrlError::Invalid {
                url: redacted,
                message: format!("unknown scheme {scheme:?}; use one of {}", schemes()),
            });
        };
        let Some(parse) = backend.parse else {
            return Err(LockUrlError::NotBuilt {
                url: redacted,
                backend: backend.name,
                feature: backend.feature,
            });
        };
        let target = parse(lock).map_err(|err| LockUrlError::Invalid {
            url: err.url,
            message: err.message,
        })?;
        Ok(Self { target })
    }

    /// The file lock on directory `path`.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        Self {
            target: Box::new(FileUrl::new(path)),
        }
    }

    /// The directory a file lock URL names; `None` for every other backend.
    pub fn file_path(&self) -> Option<&Path> {
        self.target.file_path()
    }

    /// The file lock for election `name` as candidate `identity`, for a file lock URL; `None`
    /// for every other backend.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn file_lock(
        &self,
        name: &str,
        identity: &str,
    ) -> Option<Result<leader_core::FileLock, LockError>> {
        self.target.file_lock(name, identity)
    }

    /// The lock for messages, before it is opened; never with credentials.
    pub fn describe(&self) -> String {
        self.target.describe()
    }

    /// Opens the lock for election `name` as candidate `identity`, connecting where the backend
    /// needs it (for `postgres://`, it creates the lock table when it is missing and the role
    /// may). It checks no more than building the lock needs (Postgres connects lazily, for
    /// one): the crate's [`open`] also reads the record once, which finds a server that is
    /// down, refused credentials or missing rights to read.
    ///
    /// # Errors
    /// The backend's set-up failed: a server that cannot be reached, refused credentials, no
    /// Kubernetes configuration.
    pub async fn open(
        &self,
        name: &str,
        identity: &str,
    ) -> Result<Box<dyn ResourceLock>, LockError> {
        self.target.open(name, identity).await
    }

    /// Opens the records of shard set `name` as member `identity`, connecting where the
    /// backend needs it; the crate's [`open_set`] also reads the roster once.
    ///
    /// # Errors
    /// As [`open`](Self::open); [`LockError::Misconfigured`] for a backend that keeps no shard
    /// sets.
    pub async fn open_set(
        &self,
        name: &str,
        identity: &str,
    ) -> Result<Box<dyn LockSet>, LockError> {
        self.target.open_set(name, identity).await
    }

    /// Opens the lock as [`open`](Self::open) does and reads the record once, all within
    /// `timeout`: what the crate's [`open`] does with [`OPEN_TIMEOUT`], for a URL already
    /// parsed (or made with [`LockUrl::file`]).
    ///
    /// # Errors
    /// As the crate's [`open`].
    pub async fn open_checked(
        &self,
        name: &str,
        identity: &str,
        timeout: Duration,
    ) -> Result<Box<dyn ResourceLock>, OpenError> {
        within(self, timeout, async {
            let lock = self.open(name, identity).await?;
            lock.get().await?;
            Ok(lock)
        })
        .await
    }

    /// Opens the records of shard set `name` as [`open_set`](Self::open_set) does and reads
    /// the set's roster once, all within `timeout`: the crate's [`open_set`] for a URL
    /// already parsed.
    ///
    /// # Errors
    /// As the crate's [`open_set`].
    pub async fn open_set_checked(
        &self,
        name: &str,
        identity: &str,
        timeout: Duration,
    ) -> Result<Box<dyn LockSet>, OpenError> {
        within(self, timeout, async {
            let set = self.open_set(name, identity).await?;
            set.lock(&roster_key(name)).get().await?;
            Ok(set)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_goes_to_its_crate() {
        for (url, described) in [
            ("file:///run/a", "file:/run/a"),
            #[cfg(feature = "postgres")]
            (
                "postgresql://u:secret@db/app?table=t",
                "postgresql://u:***@db/app",
            ),
            #[cfg(feature = "redis")]
            (
                "rediss://:secret@cache:6380/2?prefix=app:",
                "rediss://:***@cache:6380/2",
            ),
            #[cfg(feature = "etcd")]
            (
                "etcds://u:secret@a:2379,b:2379/?prefix=x/",
                "etcd:https://a:2379,https://b:2379",
            ),
            #[cfg(feature = "consul")]
            (
                "consuls://consul.internal/app/?dc=eu1",
                "consul:https://consul.internal:8501/app/",
            ),
            #[cfg(feature = "object-store")]
            ("gs://b/a/job", "gs://b/a/job"),
            #[cfg(feature = "kubernetes")]
            ("kubernetes://jobs", "kubernetes:jobs"),
        ] {
            let parsed = LockUrl::parse(url).expect(url);
            assert_eq!(parsed.describe(), described, "{url}");
        }
        assert_eq!(
            LockUrl::parse("file:///run/a").expect("file").file_path(),
            Some(Path::new("/run/a"))
        );
        assert!(default_file("my/job").ends_with("leader-my_job"));
    }

    #[test]
    fn bad_values_name_the_problem_without_the_password() {
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                ("ftp://u:secret@h/x", "unknown scheme"),
                ("file://relative", "absolute path"),
                ("nonsense", "not a URL"),
                ("postgres:/u:secret@db/app", "not a URL"),
                ("postgres//u:secret@db/app", "not a URL"),
                ("postgres:u:secret@db/app", "not a URL"),
                ("u:secret@db/app", "not a URL"),
                ("u:secret@db/app?next=http://x", "not a URL"),
                ("postgres:/u:secret@db://x", "not a URL"),
                ("ftp:/u:secret@h/x", "not a URL"),
            ],
        );
        let err = LockUrl::parse("ftp://x").expect_err("unknown").to_string();
        for backend in BACKENDS {
            for scheme in backend.schemes {
                assert!(err.contains(&format!("{scheme}://")), "{err}");
            }
        }
    }

    /// A URL of a backend left out of the build says which feature brings it.
    #[test]
    fn a_backend_left_out_names_its_feature() {
        for (url, feature, built) in [
            (
                "postgres://u:secret@db/app",
                "postgres",
                cfg!(feature = "postgres"),
            ),
            ("redis://:secret@cache", "redis", cfg!(feature = "redis")),
            ("etcd://u:secret@e:2379", "etcd", cfg!(feature = "etcd")),
            ("consul://c:8500/x/", "consul", cfg!(feature = "consul")),
            (
                "kubernetes://jobs",
                "kubernetes",
                cfg!(feature = "kubernetes"),
            ),
            (
                "s3://bucket/locks/",
                "object-store",
                cfg!(feature = "object-store"),
            ),
        ] {
            match LockUrl::parse(url) {
                Ok(_) => assert!(built, "{url}"),
                Err(err) => {
                    assert!(!built, "{url}: {err}");
                    let message = err.to_string();
                    assert!(
                        message.contains(&format!("`{feature}` feature")),
                        "{message}"
                    );
                    assert!(!message.contains("secret"), "{message}");
                }
            }
        }
    }

    #[tokio::test]
    async fn a_file_url_opens_a_file_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("file://{}", dir.path().join("x").display());
        let lock = open(&url, "jobs", "a").await.expect("open");
        assert_eq!(lock.identity(), "a");
        assert!(lock.get().await.expect("get").is_none());
    }

    /// One election per name on a file URL, as on every other store: two schedules on one URL
    /// each have their own lock, with its own fencing tokens.
    #[tokio::test]
    async fn a_file_url_keeps_one_election_per_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("file://{}", dir.path().join("locks").display());
        let record = |holder: &str| {
            leader_core::LeaderElectionRecord::new(
                holder,
                std::time::Duration::from_secs(15),
                Default::default(),
                1,
            )
        };
        let nightly = open(&url, "nightly", "a").await.expect("open");
        let hourly = open(&url, "hourly", "b").await.expect("open");
        nightly.create(&record("a")).await.expect("nightly's lock");
        hourly
            .create(&record("b"))
            .await
            .expect("hourly's lock is another one");
        assert_eq!(
            open(&url, "nightly", "c")
                .await
                .expect("open")
                .get()
                .await
                .expect("get")
                .expect("held")
                .record
                .holder_identity,
            "a"
        );
        assert!(dir.path().join("locks/nightly").is_dir());
        assert!(dir.path().join("locks/hourly").is_dir());
    }

    /// A directory that holds one election of the earlier layout (its own version files) is
    /// used as it is, for every name, so that replicas of an earlier release and of this one
    /// share it during a rollout; a directory of the new layout carries a marker that an
    /// earlier release cannot read as a record, so it never leads (nor writes) there.
    #[tokio::test]
    async fn a_file_url_of_the_earlier_layout_is_used_as_it_is() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("locks");
        let earlier = leader_core::FileLock::new(&path, "old");
        let record = leader_core::LeaderElectionRecord::new(
            "old",
            std::time::Duration::from_secs(15),
            Default::default(),
            1,
        );
        earlier
            .create(&record)
            .await
            .expect("an earlier release's lock");
        let url = format!("file://{}", path.display());
        for name in ["nightly", "hourly"] {
            let lock = open(&url, name, "new").await.expect("open");
            let held = lock.get().await.expect("get").expect("the earlier lock");
            assert_eq!(held.record.holder_identity, "old", "{name}");
        }
        // The new layout, read as an earlier release reads its directory: not a record.
        let fresh = dir.path().join("fresh");
        let url = format!("file://{}", fresh.display());
        open(&url, "nightly", "new").await.expect("open");
        let err = leader_core::FileLock::new(&fresh, "old")
            .get()
            .await
            .expect_err("the marker is no record");
        assert!(matches!(err, LockError::InvalidRecord { .. }), "{err}");
    }
}
