//! `--lock URL`: which backend, and the lock for one election on it.

use std::path::PathBuf;

use leader_core::{FileLock, LockError, ResourceLock, redact_url};
use leader_postgres::PostgresStore;
use leader_redis::RedisStore;
use url::Url;

/// Why a `--lock` value cannot be used; exits with [`crate::exit::BAD_LOCK`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockUrlError {
    #[error("{0}")]
    Invalid(String),
}

/// A parsed `--lock` value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LockSpec {
    File(PathBuf),
    Postgres {
        url: String,
        advisory: bool,
        schema: Option<String>,
        table: Option<String>,
    },
    Redis {
        url: String,
        prefix: Option<String>,
    },
    Etcd {
        endpoints: Vec<String>,
        user: Option<(String, String)>,
        prefix: Option<String>,
    },
    Kubernetes {
        namespace: String,
    },
}

/// The schemes `--lock` understands, for messages.
pub(crate) const SCHEMES: &str =
    "file://, postgres://, postgresql://, redis://, rediss://, etcd://, etcds://, kubernetes://";

/// The default lock file for election `name`: in `$XDG_RUNTIME_DIR`, else the temp directory.
pub(crate) fn default_file(name: &str) -> PathBuf {
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

impl LockSpec {
    /// Parses `--lock`; `None` is the default file lock for `name`.
    pub(crate) fn parse(lock: Option<&str>, name: &str) -> Result<Self, LockUrlError> {
        let Some(lock) = lock else {
            return Ok(Self::File(default_file(name)));
        };
        let redacted = redact_url(lock);
        let scheme = lock
            .split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase());
        match scheme.as_deref() {
            Some("file") => {
                let path = &lock["file://".len()..];
                if !path.starts_with('/') || path.len() < 2 {
                    return Err(LockUrlError::Invalid(format!(
                        "--lock {redacted}: a file lock needs an absolute path, like file:///run/myapp/leader"
                    )));
                }
                Ok(Self::File(PathBuf::from(path)))
            }
            Some("postgres" | "postgresql") => {
                let mut url = parse(lock, &redacted)?;
                let (mut advisory, mut schema, mut table) = (false, None, None);
                let mut kept = Vec::new();
                for (key, value) in url.query_pairs() {
                    match key.as_ref() {
                        "advisory" => advisory = parse_bool(&value, &redacted)?,
                        "schema" => schema = Some(value.into_owned()),
                        "table" => table = Some(value.into_owned()),
                        _ => kept.push((key.into_owned(), value.into_owned())),
                    }
                }
                set_query(&mut url, &kept);
                Ok(Self::Postgres {
                    url: url.into(),
                    advisory,
                    schema,
                    table,
                })
            }
            Some("redis" | "rediss") => {
                let mut url = parse(lock, &redacted)?;
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
                let url = parse(lock, &redacted)?;
                let tls = scheme == "etcds";
                // etcd://user:password@host1:2379,host2:2379/?prefix=app/ — several hosts in the
                // authority, which URL parsers do not take: split them by hand.
                let rest = &lock[scheme.len() + 3..];
                let authority = rest.split(['/', '?']).next().unwrap_or_default();
                let hosts = authority
                    .rsplit_once('@')
                    .map_or(authority, |(_, hosts)| hosts);
                if hosts.is_empty() {
                    return Err(LockUrlError::Invalid(format!(
                        "--lock {redacted}: no etcd host"
                    )));
                }
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
            Some("kubernetes") => {
                let namespace = lock["kubernetes://".len()..].trim_end_matches('/');
                let valid = !namespace.is_empty()
                    && namespace.len() <= 63
                    && namespace
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
                if !valid {
                    return Err(LockUrlError::Invalid(format!(
                        "--lock {redacted}: kubernetes://NAMESPACE needs a namespace name (lowercase letters, digits, '-')"
                    )));
                }
                Ok(Self::Kubernetes {
                    namespace: namespace.to_owned(),
                })
            }
            Some(other) => Err(LockUrlError::Invalid(format!(
                "--lock {redacted}: unknown scheme {other:?}; use one of {SCHEMES}"
            ))),
            None => Err(LockUrlError::Invalid(format!(
                "--lock {redacted}: not a URL; use one of {SCHEMES}, like file:///run/myapp/leader"
            ))),
        }
    }

    /// The lock for messages, before it is opened; never with credentials.
    pub(crate) fn describe(&self) -> String {
        match self {
            Self::File(path) => format!("file:{}", path.display()),
            Self::Postgres { url, .. } | Self::Redis { url, .. } => redact_url(url),
            Self::Etcd { endpoints, .. } => format!("etcd:{}", endpoints.join(",")),
            Self::Kubernetes { namespace } => format!("kubernetes:{namespace}"),
        }
    }

    /// The lock for election `name` as candidate `identity`, and the same lock as a
    /// [`FileLock`] when it is one (its term lock is handed to COMMAND).
    pub(crate) async fn open(
        &self,
        name: &str,
        identity: &str,
    ) -> Result<(Box<dyn ResourceLock>, Option<FileLock>), LockError> {
        if let Self::File(path) = self {
            let lock = FileLock::new(path, identity);
            return Ok((Box::new(lock.clone()), Some(lock)));
        }
        let lock: Box<dyn ResourceLock> = match self {
            Self::File(_) => unreachable!("opened above"),
            Self::Postgres {
                url,
                advisory,
                schema,
                table,
            } => {
                let mut builder = PostgresStore::builder(url.clone());
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
                    Box::new(store.advisory_lock(name, identity))
                } else {
                    Box::new(store.lock(name, identity))
                }
            }
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
            Self::Kubernetes { namespace } => Box::new(
                leader_kube::LeaseLock::from_env(
                    namespace,
                    name,
                    identity,
                    std::time::Duration::from_secs(5),
                )
                .await?,
            ),
            Self::Redis { url, prefix } => {
                let mut builder = RedisStore::builder(url.clone());
                if let Some(prefix) = prefix {
                    builder = builder.prefix(prefix);
                }
                Box::new(builder.build().await?.lock(name, identity))
            }
        };
        Ok((lock, None))
    }
}

fn parse(lock: &str, redacted: &str) -> Result<Url, LockUrlError> {
    Url::parse(lock).map_err(|err| LockUrlError::Invalid(format!("--lock {redacted}: {err}")))
}

fn parse_bool(value: &str, redacted: &str) -> Result<bool, LockUrlError> {
    match value {
        "" | "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        other => Err(LockUrlError::Invalid(format!(
            "--lock {redacted}: advisory={other:?} is not a boolean (true or false)"
        ))),
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
            LockSpec::parse(Some("file:///run/a.json"), "x").ok(),
            Some(LockSpec::File("/run/a.json".into()))
        );
        assert_eq!(
            LockSpec::parse(
                Some("postgres://u:p@db/app?advisory=true&sslmode=require&table=locks"),
                "x"
            )
            .ok(),
            Some(LockSpec::Postgres {
                url: "postgres://u:p@db/app?sslmode=require".into(),
                advisory: true,
                schema: None,
                table: Some("locks".into()),
            })
        );
        assert_eq!(
            LockSpec::parse(Some("rediss://:pw@cache:6380/2?prefix=app:"), "x").ok(),
            Some(LockSpec::Redis {
                url: "rediss://:pw@cache:6380/2".into(),
                prefix: Some("app:".into()),
            })
        );
        assert!(
            matches!(LockSpec::parse(None, "my/job").ok(), Some(LockSpec::File(p)) if p.ends_with("leader-my_job"))
        );
    }

    #[test]
    fn bad_values_name_the_problem_without_the_password() {
        for (lock, expected) in [
            ("ftp://u:secret@h/x", "unknown scheme"),
            ("file://relative", "absolute path"),
            ("nonsense", "not a URL"),
            ("kubernetes://Not_A_Namespace", "needs a namespace name"),
            ("postgres://u:secret@h/x?advisory=maybe", "not a boolean"),
        ] {
            let err = LockSpec::parse(Some(lock), "x")
                .expect_err(lock)
                .to_string();
            assert!(err.contains(expected), "{lock}: {err}");
            assert!(!err.contains("secret"), "{lock}: {err}");
        }
    }
}
