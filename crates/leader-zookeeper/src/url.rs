//! `zk://` lock URLs.

use std::time::Duration;

use leader_core::{LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait};
use percent_encoding::percent_decode_str;

use crate::store::{DEFAULT_PREFIX, ZooKeeperStore, ZooKeeperStoreBuilder};

/// The default client port.
const DEFAULT_PORT: u16 = 2181;

/// A ZooKeeper lock URL: `zk://[user:password@]host:2181[,host2:2181...][/chroot]`, as
/// ZooKeeper's connect strings name an ensemble and a chroot (`zookeeper://` too). A user and
/// password authenticate the session with the `digest` scheme, and the lock's znodes get the
/// `auth` ACL. Parameters: `prefix` (the znode under the chroot that keeps the elections,
/// default `/leader`), `session_timeout` (asked of the ensemble, like `30s`), `connect_timeout`
/// and `connection_timeout` (see [`ZooKeeperStoreBuilder::connection_timeout`]); unknown
/// parameters are refused. The chroot must exist. The servers' plain client port: TLS and SASL
/// are not supported (see the crate's documentation).
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    servers: Vec<String>,
    digest: Option<(String, String)>,
    chroot: String,
    prefix: Option<String>,
    session_timeout: Option<Duration>,
    connect_timeout: Option<Duration>,
    connection_timeout: Option<Duration>,
}

impl std::fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Whether `path` is an absolute znode path ZooKeeper takes: no empty, `.` or `..` segment,
/// no trailing `/` (but the root), no control characters.
fn valid_path(path: &str) -> bool {
    path.starts_with('/')
        && (path == "/"
            || path[1..]
                .split('/')
                .all(|segment| !segment.is_empty() && segment != "." && segment != ".."))
        && !path.chars().any(char::is_control)
}

impl LockUrl {
    /// Parses a `zk://` URL.
    ///
    /// # Errors
    /// A malformed URL, another scheme, no host, a bad port, chroot or parameter.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: String| UrlError::new(lock, message);
        leader_core::backend::check_user_info(lock)?;
        let rest = lock
            .strip_prefix("zk://")
            .or_else(|| lock.strip_prefix("zookeeper://"))
            .ok_or_else(|| invalid("not a zk:// URL".to_owned()))?;
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match rest.find('/') {
            Some(at) => rest.split_at(at),
            None => (rest, ""),
        };
        let (user_info, hosts) = match authority.rsplit_once('@') {
            Some((user_info, hosts)) => (Some(user_info), hosts),
            None => (None, authority),
        };
        let decode = |part: &str| percent_decode_str(part).decode_utf8_lossy().into_owned();
        let digest = match user_info {
            None => None,
            Some(user_info) => match user_info.split_once(':') {
                Some((user, password)) if !user.is_empty() => {
                    Some((decode(user), decode(password)))
                }
                _ => {
                    return Err(invalid(
                        "a user needs a password (zk://user:password@host): the digest scheme takes both".to_owned(),
                    ));
                }
            },
        };
        let mut servers = Vec::new();
        for host in hosts.split(',') {
            let host = host.trim();
            if host.is_empty() {
                return Err(invalid("an empty server in the host list".to_owned()));
            }
            // `[v6]:port`, `[v6]`, `host:port` or `host`.
            let (name, port) = match host.rsplit_once(':') {
                Some((name, port)) if !port.contains(']') => (name, Some(port)),
                _ => (host, None),
            };
            let port = match port {
                None => DEFAULT_PORT,
                Some(port) => port
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| {
                        invalid(format!("server {host:?}: port {port:?} is not a port"))
                    })?,
            };
            if name.is_empty() {
                return Err(invalid(format!("server {host:?}: no host")));
            }
            servers.push(format!("{name}:{port}"));
        }
        let chroot = decode(path);
        let chroot = match chroot.as_str() {
            "" | "/" => String::new(),
            path if valid_path(path.trim_end_matches('/')) => path.trim_end_matches('/').to_owned(),
            other => {
                return Err(invalid(format!(
                    "chroot {other:?}: an absolute znode path without empty, '.' or '..' parts"
                )));
            }
        };
        let mut parsed = Self {
            servers,
            digest,
            chroot,
            prefix: None,
            session_timeout: None,
            connect_timeout: None,
            connection_timeout: None,
        };
        let duration = |key: &str, value: &str| {
            humantime::parse_duration(value)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| invalid(format!("{key}={value}: a duration, like 30s")))
        };
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            match key.as_ref() {
                "prefix" if valid_path(&value) && value != "/" => {
                    parsed.prefix = Some(value.into_owned());
                }
                "prefix" => {
                    return Err(invalid(format!(
                        "prefix={value}: an absolute znode path (like {DEFAULT_PREFIX}) below the root"
                    )));
                }
                "session_timeout" => parsed.session_timeout = Some(duration(&key, &value)?),
                "connect_timeout" => parsed.connect_timeout = Some(duration(&key, &value)?),
                "connection_timeout" => {
                    parsed.connection_timeout = Some(duration(&key, &value)?);
                }
                other => {
                    return Err(invalid(format!(
                        "unknown parameter {other:?} (known: prefix, session_timeout, connect_timeout, connection_timeout)"
                    )));
                }
            }
        }
        Ok(parsed)
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// A store builder with the URL's ensemble, credentials, chroot and settings.
    pub fn store(&self) -> ZooKeeperStoreBuilder {
        let mut builder = ZooKeeperStore::builder(self.servers.join(",")).chroot(&self.chroot);
        if let Some((user, password)) = &self.digest {
            builder = builder.digest(user, password);
        }
        if let Some(prefix) = &self.prefix {
            builder = builder.prefix(prefix);
        }
        if let Some(timeout) = self.session_timeout {
            builder = builder.session_timeout(timeout);
        }
        if let Some(timeout) = self.connect_timeout {
            builder = builder.connect_timeout(timeout);
        }
        if let Some(timeout) = self.connection_timeout {
            builder = builder.connection_timeout(timeout);
        }
        builder
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        let login = match &self.digest {
            Some((user, _)) => format!("{user}:***@"),
            None => String::new(),
        };
        format!(
            "zk://{login}{}{}{}",
            self.servers.join(","),
            self.chroot,
            self.prefix.as_deref().unwrap_or(DEFAULT_PREFIX)
        )
    }

    /// Opens the session (checking the chroot and creating the prefix) and makes the lock.
    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        Ok(Box::new(self.store().build().await?.lock(name, identity)))
    }

    /// An election znode per record, on one session.
    async fn open_set(&self, _name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        Ok(Box::new(self.store().build().await?.lock_set(identity)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_give_servers_credentials_chroot_and_settings() {
        let url = LockUrl::parse(
            "zk://app:s%40c+ret@z1:2182,z2,[::1]:2183/kafka/prod?prefix=/locks&session_timeout=20s&connect_timeout=3s&connection_timeout=2s",
        )
        .expect("valid");
        assert_eq!(url.servers, ["z1:2182", "z2:2181", "[::1]:2183"]);
        assert_eq!(url.digest, Some(("app".to_owned(), "s@c+ret".to_owned())));
        assert_eq!(url.chroot, "/kafka/prod");
        assert_eq!(url.prefix.as_deref(), Some("/locks"));
        assert_eq!(url.session_timeout, Some(Duration::from_secs(20)));
        assert_eq!(url.connect_timeout, Some(Duration::from_secs(3)));
        assert_eq!(url.connection_timeout, Some(Duration::from_secs(2)));
        assert_eq!(
            url.describe(),
            "zk://app:***@z1:2182,z2:2181,[::1]:2183/kafka/prod/locks"
        );
        let plain = LockUrl::parse("zookeeper://127.0.0.1").expect("valid");
        assert_eq!(plain.servers, ["127.0.0.1:2181"]);
        assert_eq!(plain.chroot, "");
        assert_eq!(plain.describe(), "zk://127.0.0.1:2181/leader");
        assert_eq!(LockUrl::parse("zk://h/").expect("valid").chroot, "");
    }

    #[test]
    fn bad_urls_name_the_problem_without_the_password() {
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                ("redis://u:secret@h/x", "not a zk:// URL"),
                ("zk://u:secret@h:99999/x", "is not a port"),
                ("zk://u:secret@h:0", "is not a port"),
                ("zk://u:secret@h,,g/x", "empty server"),
                ("zk://u:secret@/x", "empty server"),
                ("zk://u:secret@:2181/x", "no host"),
                ("zk://u:secret@h/a//b", "chroot"),
                ("zk://u:secret@h/a/../b", "chroot"),
                ("zk://u:secret@h/x?prefix=relative", "prefix=relative"),
                ("zk://u:secret@h/x?prefix=/", "prefix=/"),
                (
                    "zk://u:secret@h/x?session_timeout=soon",
                    "session_timeout=soon",
                ),
                ("zk://u:secret@h/x?bucket=y", "unknown parameter"),
                ("zk://secret@h/x", "needs a password"),
            ],
        );
    }
}
