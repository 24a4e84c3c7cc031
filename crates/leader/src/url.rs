//! Locks from URLs: which backend, and the lock for one election on it.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use leader_core::{FileLock, LockError, ResourceLock, redact_url};
use url::Url;

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

/// A parsed lock URL: the backend and its settings, before anything connects.
///
/// | URL | lock |
/// |---|---|
/// | `file:///run/myapp/leader` | [`FileLock`] on that directory |
/// | `postgres://user:pass@host/db?table=T&schema=S&advisory=true&idle_session_timeout=30s` (or `postgresql://`) | the Postgres table lock, or the advisory lock (`idle_session_timeout`: how long the server keeps a silent session and its advisory lock); other parameters go to the driver |
/// | `redis://host:6379/0?prefix=P` (or `rediss://`) | the Redis lock |
/// | `etcd://user:pass@host1:2379,host2:2379/?prefix=P` (or `etcds://`) | the etcd lock |
/// | `consul://HOST:8500/PREFIX?dc=DC` (or `consuls://` for TLS) | the Consul lock; the ACL token from `CONSUL_HTTP_TOKEN` |
/// | `s3://BUCKET/PREFIX/`, `gs://BUCKET/PREFIX/`, `az://CONTAINER/PREFIX/` | the object storage lock: the object `PREFIX/NAME` (a path not ending in `/` names the object itself); credentials, region and endpoint from the environment as `object_store` reads them (`AWS_*`, `GOOGLE_*`, `AZURE_*`) |
/// | `kubernetes://NAMESPACE?binary_version=V&emulation_version=E` | a Lease in that namespace (in-cluster or kubeconfig); with `binary_version`, a candidate in coordinated leader election (`emulation_version` defaults to it) |
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockUrl {
    /// `file://PATH`.
    File(PathBuf),
    /// `postgres://` or `postgresql://`.
    Postgres {
        /// The connection string without the lock's own parameters.
        url: String,
        /// `advisory=true`: the advisory lock.
        advisory: bool,
        /// `schema=`.
        schema: Option<String>,
        /// `table=`.
        table: Option<String>,
        /// `idle_session_timeout=` (a duration such as `10s`), for the advisory lock.
        idle_session_timeout: Option<Duration>,
    },
    /// `redis://` or `rediss://`.
    Redis {
        /// The connection string without the lock's own parameters.
        url: String,
        /// `prefix=`.
        prefix: Option<String>,
    },
    /// `etcd://` or `etcds://`.
    Etcd {
        /// `http(s)://host:port` of each member.
        endpoints: Vec<String>,
        /// User and password, if given.
        user: Option<(String, String)>,
        /// `prefix=`.
        prefix: Option<String>,
    },
    /// `consul://` or `consuls://`.
    Consul {
        /// `http(s)://host:port` of the agent.
        address: String,
        /// The key prefix (the URL's path), if given.
        prefix: Option<String>,
        /// `dc=`.
        datacenter: Option<String>,
    },
    /// `s3://`, `gs://`, `az://` or `azure://`.
    ObjectStore {
        /// `SCHEME://BUCKET/PREFIX/`: the store and the prefix of the records.
        url: String,
        /// The object's name under the prefix when the URL names one object (its path does
        /// not end in `/`); otherwise the election's name.
        object: Option<String>,
    },
    /// `kubernetes://NAMESPACE`.
    Kubernetes {
        /// The namespace of the Lease.
        namespace: String,
        /// `binary_version=` and `emulation_version=`: take part in coordinated leader
        /// election with these versions.
        coordinated: Option<(String, String)>,
    },
}

impl fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// The schemes lock URLs use, for messages.
const SCHEMES: &str = "file://, postgres://, postgresql://, redis://, rediss://, etcd://, etcds://, consul://, consuls://, s3://, gs://, az://, kubernetes://";

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
/// bucket, missing rights and an unreadable record are errors here, at start, as the `leader`
/// command reports them; later outages are the elector's to retry.
///
/// # Errors
/// The URL cannot be used ([`LockUrlError`]), or the backend's set-up or first read failed
/// ([`LockError`]; [`LockError::Timeout`] after [`OPEN_TIMEOUT`]).
pub async fn open(
    url: &str,
    name: &str,
    identity: &str,
) -> Result<Box<dyn ResourceLock>, OpenError> {
    let url = LockUrl::parse(url)?;
    let checked = async {
        let lock = url.open(name, identity).await?;
        lock.get().await?;
        Ok::<_, LockError>(lock)
    };
    match tokio::time::timeout(OPEN_TIMEOUT, checked).await {
        Ok(opened) => Ok(opened?),
        Err(_) => Err(OpenError::Lock(LockError::Timeout {
            lock: url.describe(),
            operation: "open",
            after: OPEN_TIMEOUT,
        })),
    }
}

impl LockUrl {
    /// Parses a lock URL; see the table above.
    ///
    /// # Errors
    /// A malformed URL, an unknown scheme, a bad parameter, or a backend this build leaves out.
    pub fn parse(lock: &str) -> Result<Self, LockUrlError> {
        let parsed = Self::parse_any(lock)?;
        if let Some((backend, feature)) = parsed.missing_feature() {
            return Err(LockUrlError::NotBuilt {
                url: redact_url(lock),
                backend,
                feature,
            });
        }
        Ok(parsed)
    }

    /// The backend and feature this URL needs, if this build leaves it out.
    fn missing_feature(&self) -> Option<(&'static str, &'static str)> {
        match self {
            Self::File(_) => None,
            Self::Postgres { .. } => {
                (!cfg!(feature = "postgres")).then_some(("Postgres", "postgres"))
            }
            Self::Redis { .. } => (!cfg!(feature = "redis")).then_some(("Redis", "redis")),
            Self::Etcd { .. } => (!cfg!(feature = "etcd")).then_some(("etcd", "etcd")),
            Self::Kubernetes { .. } => {
                (!cfg!(feature = "kubernetes")).then_some(("Kubernetes", "kubernetes"))
            }
            Self::Consul { .. } => (!cfg!(feature = "consul")).then_some(("Consul", "consul")),
            Self::ObjectStore { .. } => {
                (!cfg!(feature = "object-store")).then_some(("object storage", "object-store"))
            }
        }
    }

    /// Parses any scheme this crate knows, built or not.
    fn parse_any(lock: &str) -> Result<Self, LockUrlError> {
        let redacted = redact_url(lock);
        let invalid = |message: String| LockUrlError::Invalid {
            url: redacted.clone(),
            message,
        };
        let scheme = lock
            .split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase());
        match scheme.as_deref() {
            Some("file") => {
                let path = &lock["file://".len()..];
                if !path.starts_with('/') || path.len() < 2 {
                    return Err(invalid(
                        "a file lock needs an absolute path, like file:///run/myapp/leader"
                            .to_owned(),
                    ));
                }
                Ok(Self::File(PathBuf::from(path)))
            }
            Some("postgres" | "postgresql") => {
                let mut url = Url::parse(lock).map_err(|err| invalid(err.to_string()))?;
                let (mut advisory, mut schema, mut table) = (false, None, None);
                let mut idle_session_timeout = None;
                let mut kept = Vec::new();
                for (key, value) in url.query_pairs() {
                    match key.as_ref() {
                        "advisory" => advisory = parse_bool(&value).map_err(invalid)?,
                        "idle_session_timeout" => {
                            idle_session_timeout =
                                Some(humantime::parse_duration(&value).map_err(|err| {
                                    invalid(format!(
                                        "idle_session_timeout={value:?} is not a duration like 30s: {err}"
                                    ))
                                })?);
                        }
                        "schema" => schema = Some(value.into_owned()),
                        "table" => table = Some(value.into_owned()),
                        _ => kept.push((key.into_owned(), value.into_owned())),
                    }
                }
                set_query(&mut url, &kept);
                if idle_session_timeout.is_some() && !advisory {
                    return Err(invalid(
                        "idle_session_timeout applies to the advisory lock (advisory=true)"
                            .to_owned(),
                    ));
                }
                Ok(Self::Postgres {
                    url: url.into(),
                    advisory,
                    schema,
                    table,
                    idle_session_timeout,
                })
            }
            Some("redis" | "rediss") => {
                let mut url = Url::parse(lock).map_err(|err| invalid(err.to_string()))?;
                let mut prefix = None;
                let mut kept = Vec::new();
                for (key, value) in url.query_pairs() {
                    match key.as_ref() {
                        "prefix" => prefix = Some(value.into_owned()),
                        _ => kept.push((key.into_owned(), value.into_owned())),
                    }
                }
                set_query(&mut url, &kept);
                Ok(Self::Redis {
                    url: url.into(),
                    prefix,
                })
            }
            Some(scheme @ ("etcd" | "etcds")) => {
                let tls = scheme == "etcds";
                // etcd://user:password@host1:2379,host2:2379/?prefix=app/ — several hosts in the
                // authority, which URL parsers do not take: split them by hand, and parse the
                // rest (user, password, query) as a URL with the first host alone.
                let rest = &lock[scheme.len() + 3..];
                let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
                let authority = &rest[..authority_end];
                let (user_info, hosts) = match authority.rsplit_once('@') {
                    Some((user_info, hosts)) => (Some(user_info), hosts),
                    None => (None, authority),
                };
                if hosts.is_empty() || hosts.split(',').any(str::is_empty) {
                    return Err(invalid("no etcd host".to_owned()));
                }
                let first = hosts.split(',').next().unwrap_or_default();
                let single = format!(
                    "{scheme}://{}{first}{}",
                    user_info.map(|u| format!("{u}@")).unwrap_or_default(),
                    &rest[authority_end..]
                );
                let url = Url::parse(&single).map_err(|err| invalid(err.to_string()))?;
                let http = if tls { "https" } else { "http" };
                let endpoints = hosts
                    .split(',')
                    .map(|host| format!("{http}://{host}"))
                    .collect();
                let user = (!url.username().is_empty()).then(|| {
                    let decode = |s: &str| {
                        url::form_urlencoded::parse(s.as_bytes())
                            .map(|(k, _)| k.into_owned())
                            .next()
                            .unwrap_or_default()
                    };
                    (
                        decode(url.username()),
                        url.password().map(decode).unwrap_or_default(),
                    )
                });
                let prefix = url
                    .query_pairs()
                    .find(|(k, _)| k == "prefix")
                    .map(|(_, v)| v.into_owned());
                Ok(Self::Etcd {
                    endpoints,
                    user,
                    prefix,
                })
            }
            Some(scheme @ ("consul" | "consuls")) => {
                let url = Url::parse(lock).map_err(|err| invalid(err.to_string()))?;
                if !url.username().is_empty() || url.password().is_some() {
                    return Err(invalid(
                        "a consul:// URL takes no credentials; set CONSUL_HTTP_TOKEN".to_owned(),
                    ));
                }
                let host = url
                    .host_str()
                    .ok_or_else(|| invalid("consul://HOST:PORT needs a host".to_owned()))?;
                let port = url
                    .port()
                    .unwrap_or(if scheme == "consuls" { 8501 } else { 8500 });
                let http = if scheme == "consuls" { "https" } else { "http" };
                let mut datacenter = None;
                for (key, value) in url.query_pairs() {
                    match key.as_ref() {
                        "dc" => datacenter = Some(value.into_owned()),
                        other => {
                            return Err(invalid(format!(
                                "unknown parameter {other:?}; consul:// takes dc (the token comes from CONSUL_HTTP_TOKEN)"
                            )));
                        }
                    }
                }
                let prefix = url.path().trim_start_matches('/');
                Ok(Self::Consul {
                    address: format!("{http}://{host}:{port}"),
                    prefix: (!prefix.is_empty()).then(|| prefix.to_owned()),
                    datacenter,
                })
            }
            Some(scheme @ ("s3" | "gs" | "az" | "azure")) => {
                let url = Url::parse(lock).map_err(|err| invalid(err.to_string()))?;
                if !url.username().is_empty() || url.password().is_some() {
                    return Err(invalid(format!(
                        "a {scheme}:// URL takes no credentials; object_store reads them from the environment"
                    )));
                }
                if url.query().is_some() {
                    return Err(invalid(format!(
                        "a {scheme}:// URL takes no parameters; configure the store with object_store's environment variables (AWS_REGION, AWS_ENDPOINT, GOOGLE_SERVICE_ACCOUNT, AZURE_STORAGE_ACCOUNT_NAME, ...)"
                    )));
                }
                let bucket = url
                    .host_str()
                    .filter(|h| !h.is_empty())
                    .ok_or_else(|| invalid(format!("{scheme}://BUCKET/PREFIX/ needs a bucket")))?;
                let path = url.path().trim_start_matches('/');
                let (prefix, object) = match path.rsplit_once('/') {
                    _ if path.is_empty() => ("leader/", None),
                    Some((prefix, "")) => (&path[..prefix.len() + 1], None),
                    Some((prefix, object)) => (&path[..prefix.len() + 1], Some(object)),
                    None => ("", Some(path)),
                };
                Ok(Self::ObjectStore {
                    url: format!("{scheme}://{bucket}/{prefix}"),
                    object: object.map(str::to_owned),
                })
            }
            Some("kubernetes") => {
                let rest = &lock["kubernetes://".len()..];
                let (namespace, query) = rest.split_once('?').unwrap_or((rest, ""));
                let namespace = namespace.trim_end_matches('/');
                let valid = !namespace.is_empty()
                    && namespace.len() <= 63
                    && namespace
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
                if !valid {
                    return Err(invalid("kubernetes://NAMESPACE needs a namespace name (lowercase letters, digits, '-')".to_owned()));
                }
                let (mut binary, mut emulation) = (None, None);
                for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
                    match key.as_ref() {
                        "binary_version" => binary = Some(value.into_owned()),
                        "emulation_version" => emulation = Some(value.into_owned()),
                        other => {
                            return Err(invalid(format!(
                                "unknown parameter {other:?}; kubernetes:// takes binary_version and emulation_version"
                            )));
                        }
                    }
                }
                let coordinated = match (binary, emulation) {
                    (None, None) => None,
                    (None, Some(_)) => {
                        return Err(invalid(
                            "emulation_version needs binary_version (coordinated leader election)"
                                .to_owned(),
                        ));
                    }
                    (Some(binary), emulation) => {
                        let emulation = emulation.unwrap_or_else(|| binary.clone());
                        Some((binary, emulation))
                    }
                };
                Ok(Self::Kubernetes {
                    namespace: namespace.to_owned(),
                    coordinated,
                })
            }
            Some(other) => Err(invalid(format!(
                "unknown scheme {other:?}; use one of {SCHEMES}"
            ))),
            None => Err(invalid(format!(
                "not a URL; use one of {SCHEMES}, like file:///run/myapp/leader"
            ))),
        }
    }

    /// The lock for messages, before it is opened; never with credentials.
    pub fn describe(&self) -> String {
        match self {
            Self::File(path) => format!("file:{}", path.display()),
            Self::Postgres { url, .. } | Self::Redis { url, .. } => redact_url(url),
            Self::Etcd { endpoints, .. } => format!("etcd:{}", endpoints.join(",")),
            Self::Consul {
                address, prefix, ..
            } => format!("consul:{address}/{}", prefix.as_deref().unwrap_or_default()),
            Self::ObjectStore { url, object } => {
                format!("{url}{}", object.as_deref().unwrap_or_default())
            }
            Self::Kubernetes {
                namespace,
                coordinated: None,
            } => format!("kubernetes:{namespace}"),
            Self::Kubernetes {
                namespace,
                coordinated: Some((binary, emulation)),
            } => format!("kubernetes:{namespace} (coordinated, {binary}/{emulation})"),
        }
    }

    /// Opens the lock for election `name` as candidate `identity`, connecting where the backend
    /// needs it. For `postgres://` it creates the lock table when it is missing and the role may.
    /// It checks no more than building the lock needs (Postgres connects lazily, for one): the
    /// crate's [`open`] also reads the record once, which finds a server that is down, refused
    /// credentials or missing rights.
    ///
    /// # Errors
    /// The backend's set-up failed: a server that cannot be reached, refused credentials, no
    /// Kubernetes configuration.
    pub async fn open(
        &self,
        name: &str,
        identity: &str,
    ) -> Result<Box<dyn ResourceLock>, LockError> {
        // Only the file lock, which needs no name, may be all this build has.
        let _ = name;
        Ok(match self {
            Self::File(path) => Box::new(FileLock::new(path, identity)),
            #[cfg(feature = "postgres")]
            Self::Postgres {
                url,
                advisory,
                schema,
                table,
                idle_session_timeout,
            } => {
                let mut builder = leader_postgres::PostgresStore::builder(url.clone());
                if let Some(schema) = schema {
                    builder = builder.schema(schema);
                }
                if let Some(table) = table {
                    builder = builder.table(table);
                }
                let store = builder.build().await?;
                // Creating the table needs more rights than electing: a role without them finds
                // out from the lock's own error if the table is really missing.
                if let Err(err) = store.create_table().await {
                    tracing::debug!(error = %err, "could not create the lock table");
                }
                if *advisory {
                    let mut lock = store.advisory_lock(name, identity);
                    if let Some(timeout) = idle_session_timeout {
                        lock = lock.idle_session_timeout(*timeout);
                    }
                    Box::new(lock)
                } else {
                    Box::new(store.lock(name, identity))
                }
            }
            #[cfg(feature = "redis")]
            Self::Redis { url, prefix } => {
                let mut builder = leader_redis::RedisStore::builder(url.clone());
                if let Some(prefix) = prefix {
                    builder = builder.prefix(prefix);
                }
                Box::new(builder.build().await?.lock(name, identity))
            }
            #[cfg(feature = "etcd")]
            Self::Etcd {
                endpoints,
                user,
                prefix,
            } => {
                let mut builder = leader_etcd::EtcdStore::builder(endpoints);
                if let Some((user, password)) = user {
                    builder = builder.user(user, password);
                }
                if let Some(prefix) = prefix {
                    builder = builder.prefix(prefix);
                }
                Box::new(builder.build().await?.lock(name, identity))
            }
            #[cfg(feature = "consul")]
            Self::Consul {
                address,
                prefix,
                datacenter,
            } => {
                let mut builder = leader_consul::ConsulStore::builder(address);
                if let Some(prefix) = prefix {
                    builder = builder.prefix(prefix);
                }
                if let Some(datacenter) = datacenter {
                    builder = builder.datacenter(datacenter);
                }
                if let Ok(token) = std::env::var("CONSUL_HTTP_TOKEN") {
                    builder = builder.token(token);
                }
                Box::new(builder.build()?.lock(name, identity)?)
            }
            #[cfg(feature = "object-store")]
            Self::ObjectStore { url, object } => {
                let store = leader_object_store::BucketStore::from_url(url).build()?;
                // A store that does not keep preconditions is refused here, before anything
                // runs; a store that cannot be reached now is checked before the first write.
                match store.check_conditional_writes().await {
                    Err(err @ (LockError::Misconfigured { .. } | LockError::Forbidden { .. })) => {
                        return Err(err);
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "could not check the store's conditional writes yet");
                    }
                    Ok(()) => {}
                }
                Box::new(store.lock(object.as_deref().unwrap_or(name), identity))
            }
            #[cfg(feature = "kubernetes")]
            Self::Kubernetes {
                namespace,
                coordinated,
            } => {
                let lock =
                    leader_kube::LeaseLock::from_env(namespace, name, identity, KUBE_TIMEOUT)
                        .await?;
                match coordinated {
                    None => Box::new(lock),
                    Some((binary, emulation)) => Box::new(lock.coordinated(
                        leader_kube::Coordination::oldest_emulation_version(binary, emulation),
                    )?),
                }
            }
            #[allow(unreachable_patterns)]
            other => {
                let (backend, feature) = other.missing_feature().unwrap_or(("this", "?"));
                return Err(LockError::Misconfigured {
                    backend: "leader",
                    message: format!(
                        "this build has no {backend} lock; enable the `{feature}` feature"
                    ),
                });
            }
        })
    }
}

/// The connect and read timeout of the Kubernetes client.
#[cfg(feature = "kubernetes")]
const KUBE_TIMEOUT: Duration = Duration::from_secs(5);

fn parse_bool(value: &str) -> Result<bool, String> {
    match value {
        "" | "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        other => Err(format!(
            "advisory={other:?} is not a boolean (true or false)"
        )),
    }
}

fn set_query(url: &mut Url, pairs: &[(String, String)]) {
    if pairs.is_empty() {
        url.set_query(None);
    } else {
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_are_parsed_and_own_parameters_removed() {
        assert_eq!(
            LockUrl::parse("file:///run/a").ok(),
            Some(LockUrl::File("/run/a".into()))
        );
        let postgres = LockUrl::parse_any(
            "postgres://u:p@db/app?advisory=true&sslmode=require&table=locks&idle_session_timeout=5s",
        );
        assert_eq!(
            postgres.ok(),
            Some(LockUrl::Postgres {
                url: "postgres://u:p@db/app?sslmode=require".into(),
                advisory: true,
                schema: None,
                table: Some("locks".into()),
                idle_session_timeout: Some(Duration::from_secs(5)),
            })
        );
        assert_eq!(
            LockUrl::parse_any("rediss://:pw@cache:6380/2?prefix=app:").ok(),
            Some(LockUrl::Redis {
                url: "rediss://:pw@cache:6380/2".into(),
                prefix: Some("app:".into()),
            })
        );
        assert_eq!(
            LockUrl::parse_any("etcds://u:p@a:2379,b:2379/?prefix=x/").ok(),
            Some(LockUrl::Etcd {
                endpoints: vec!["https://a:2379".into(), "https://b:2379".into()],
                user: Some(("u".into(), "p".into())),
                prefix: Some("x/".into()),
            })
        );
        assert_eq!(
            LockUrl::parse_any("kubernetes://jobs/?binary_version=1.4.0").ok(),
            Some(LockUrl::Kubernetes {
                namespace: "jobs".into(),
                coordinated: Some(("1.4.0".into(), "1.4.0".into())),
            })
        );
        assert_eq!(
            LockUrl::parse_any("kubernetes://jobs?binary_version=1.5.0&emulation_version=1.4.0")
                .ok(),
            Some(LockUrl::Kubernetes {
                namespace: "jobs".into(),
                coordinated: Some(("1.5.0".into(), "1.4.0".into())),
            })
        );
        assert_eq!(
            LockUrl::parse_any("consuls://consul.internal/app/locks/?dc=eu1").ok(),
            Some(LockUrl::Consul {
                address: "https://consul.internal:8501".into(),
                prefix: Some("app/locks/".into()),
                datacenter: Some("eu1".into()),
            })
        );
        assert_eq!(
            LockUrl::parse_any("consul://127.0.0.1:8500").ok(),
            Some(LockUrl::Consul {
                address: "http://127.0.0.1:8500".into(),
                prefix: None,
                datacenter: None,
            })
        );
        for (url, store, object) in [
            ("s3://b/locks/", "s3://b/locks/", None),
            ("s3://b", "s3://b/leader/", None),
            ("gs://b/a/b/job", "gs://b/a/b/", Some("job")),
            ("az://c/job", "az://c/", Some("job")),
        ] {
            assert_eq!(
                LockUrl::parse_any(url).ok(),
                Some(LockUrl::ObjectStore {
                    url: store.into(),
                    object: object.map(Into::into),
                }),
                "{url}"
            );
        }
        assert!(default_file("my/job").ends_with("leader-my_job"));
    }

    #[test]
    fn bad_values_name_the_problem_without_the_password() {
        for (lock, expected) in [
            ("ftp://u:secret@h/x", "unknown scheme"),
            ("file://relative", "absolute path"),
            ("nonsense", "not a URL"),
            ("kubernetes://Not_A_Namespace", "needs a namespace name"),
            ("kubernetes://jobs?binary=1.0.0", "unknown parameter"),
            ("consul://u:secret@host:8500", "CONSUL_HTTP_TOKEN"),
            ("consul://host:8500/?token=secret", "unknown parameter"),
            ("s3://AKID:secret@bucket/x/", "takes no credentials"),
            (
                "s3://bucket/x/?aws_session_token=secret",
                "takes no parameters",
            ),
            ("gs:///x/", "needs a bucket"),
            (
                "kubernetes://jobs?emulation_version=1.0.0",
                "needs binary_version",
            ),
            ("postgres://u:secret@h/x?advisory=maybe", "not a boolean"),
            (
                "postgres://u:secret@h/x?advisory=true&idle_session_timeout=soon",
                "not a duration",
            ),
            (
                "postgres://u:secret@h/x?idle_session_timeout=5s",
                "applies to the advisory lock",
            ),
        ] {
            let err = LockUrl::parse_any(lock).expect_err(lock).to_string();
            assert!(err.contains(expected), "{lock}: {err}");
            assert!(!err.contains("secret"), "{lock}: {err}");
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
}
