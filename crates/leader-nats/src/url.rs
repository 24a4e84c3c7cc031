//! `nats://` lock URLs.

use std::path::PathBuf;
use std::time::Duration;

use leader_core::{LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait};

use crate::store::{NatsStore, NatsStoreBuilder, login_of, redacted, valid_bucket};

/// A NATS lock URL: `nats://[user:password@]host:4222[/bucket]`, with parameters `server`
/// (another server of the cluster, `host:port`; repeatable), `creds` (a credentials file),
/// `nkey_file` (a file holding an NKey seed), `tls=true` (require TLS), `tls_ca` (a private
/// CA's certificates), `tls_cert` and `tls_key` (a client certificate), `domain` or
/// `api_prefix` (where the JetStream API is), `replicas` (for a bucket the lock creates) and
/// `timeout` (a request's, like `5s`). A user without a password is a token. The bucket defaults to
/// [`DEFAULT_BUCKET`](crate::DEFAULT_BUCKET); unknown parameters are refused.
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    servers: Vec<String>,
    user: Option<(String, Option<String>)>,
    bucket: Option<String>,
    credentials: Option<PathBuf>,
    tls: bool,
    replicas: Option<usize>,
    timeout: Option<Duration>,
    nkey_file: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    domain: Option<String>,
    api_prefix: Option<String>,
}

impl std::fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl LockUrl {
    /// Parses a `nats://` URL.
    ///
    /// # Errors
    /// A malformed URL, another scheme, no host, an invalid bucket name or parameter.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: String| UrlError::new(lock, message);
        let url = leader_core::backend::parse_lock_url(lock, &["nats"], "not a nats:// URL")?;
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| invalid("no server host".to_owned()))?;
        let mut servers = vec![format!("{host}:{}", url.port().unwrap_or(4222))];
        let user = login_of(&url).map_err(invalid)?;
        let path = url.path().trim_matches('/');
        let bucket = match path {
            "" => None,
            bucket if valid_bucket(bucket) => Some(bucket.to_owned()),
            other => {
                return Err(invalid(format!(
                    "bucket {other:?}: one name of letters, digits, '-' and '_'"
                )));
            }
        };
        let mut parsed = Self {
            servers: Vec::new(),
            user,
            bucket,
            credentials: None,
            tls: false,
            replicas: None,
            timeout: None,
            nkey_file: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            domain: None,
            api_prefix: None,
        };
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "server" if value.is_empty() => return Err(invalid("server= is empty".to_owned())),
                "server" => servers.push(value.trim_start_matches("nats://").to_owned()),
                "creds" if value.is_empty() => return Err(invalid("creds= is empty".to_owned())),
                "creds" => parsed.credentials = Some(PathBuf::from(value.as_ref())),
                "tls" => {
                    parsed.tls = value
                        .parse()
                        .map_err(|_| invalid(format!("tls={value}: true or false")))?;
                }
                "replicas" => {
                    parsed.replicas = Some(
                        value
                            .parse()
                            .ok()
                            .filter(|n| (1..=5).contains(n))
                            .ok_or_else(|| invalid(format!("replicas={value}: 1 to 5")))?,
                    );
                }
                "timeout" => {
                    parsed.timeout = Some(
                        humantime::parse_duration(&value)
                            .ok()
                            .filter(|d| !d.is_zero())
                            .ok_or_else(|| {
                                invalid(format!("timeout={value}: a duration, like 5s"))
                            })?,
                    );
                }
                "nkey_file" | "tls_ca" | "tls_cert" | "tls_key" | "domain" | "api_prefix"
                    if value.is_empty() =>
                {
                    return Err(invalid(format!("{key}= is empty")));
                }
                "nkey_file" => parsed.nkey_file = Some(PathBuf::from(value.as_ref())),
                "tls_ca" => parsed.tls_ca = Some(PathBuf::from(value.as_ref())),
                "tls_cert" => parsed.tls_cert = Some(PathBuf::from(value.as_ref())),
                "tls_key" => parsed.tls_key = Some(PathBuf::from(value.as_ref())),
                "domain" => parsed.domain = Some(value.into_owned()),
                "api_prefix" => parsed.api_prefix = Some(value.into_owned()),
                other => {
                    return Err(invalid(format!(
                        "unknown parameter {other:?} (known: server, creds, nkey_file, tls, tls_ca, tls_cert, tls_key, domain, api_prefix, replicas, timeout)"
                    )));
                }
            }
        }
        if parsed.tls_cert.is_some() != parsed.tls_key.is_some() {
            return Err(invalid("tls_cert= and tls_key= go together".to_owned()));
        }
        if parsed.domain.is_some() && parsed.api_prefix.is_some() {
            return Err(invalid(
                "domain= and api_prefix= both name the JetStream API: give one".to_owned(),
            ));
        }
        parsed.servers = servers;
        Ok(parsed)
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// A store builder with the URL's servers, login, bucket and settings.
    pub fn store(&self) -> NatsStoreBuilder {
        let scheme = if self.tls { "tls" } else { "nats" };
        let servers: Vec<String> = self
            .servers
            .iter()
            .map(|server| format!("{scheme}://{server}"))
            .collect();
        let mut builder = NatsStore::builder(servers.join(",")).require_tls(self.tls);
        match &self.user {
            Some((user, Some(password))) => {
                builder = builder.user_and_password(user, password);
            }
            Some((token, None)) => builder = builder.token(token),
            None => {}
        }
        if let Some(bucket) = &self.bucket {
            builder = builder.bucket(bucket);
        }
        if let Some(path) = &self.credentials {
            builder = builder.credentials_file(path);
        }
        if let Some(replicas) = self.replicas {
            builder = builder.replicas(replicas);
        }
        if let Some(timeout) = self.timeout {
            builder = builder.request_timeout(timeout);
        }
        if let Some(path) = &self.nkey_file {
            builder = builder.nkey_file(path);
        }
        if let Some(path) = &self.tls_ca {
            builder = builder.tls_root_certificates(path);
        }
        if let (Some(certificate), Some(key)) = (&self.tls_cert, &self.tls_key) {
            builder = builder.tls_client_certificate(certificate, key);
        }
        if let Some(domain) = &self.domain {
            builder = builder.jetstream_domain(domain);
        }
        if let Some(prefix) = &self.api_prefix {
            builder = builder.jetstream_api_prefix(prefix);
        }
        builder
    }

    async fn build(&self) -> Result<NatsStore, LockError> {
        self.store().create_bucket(true).build().await
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        let login = match &self.user {
            Some((user, Some(_))) => format!("{user}:***@"),
            Some((_, None)) => "***@".to_owned(),
            None => String::new(),
        };
        format!(
            "nats://{login}{}/{}",
            redacted(&self.servers),
            self.bucket.as_deref().unwrap_or(crate::DEFAULT_BUCKET)
        )
    }

    /// Builds the store (it connects in the background and looks the bucket up on first use,
    /// creating it when it is missing and the user may) and makes the lock.
    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        Ok(Box::new(self.build().await?.lock(name, identity)))
    }

    /// A key per record in the bucket, on one connection.
    async fn open_set(&self, _name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        Ok(Box::new(self.build().await?.lock_set(identity)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_give_servers_login_bucket_and_settings() {
        let url = LockUrl::parse(
            "nats://app:s%40cret@n1:4223/locks?server=n2:4222&server=nats://n3:4222&tls=true&replicas=3&timeout=2s&creds=/etc/app.creds",
        )
        .expect("valid");
        assert_eq!(url.servers, ["n1:4223", "n2:4222", "n3:4222"]);
        assert_eq!(
            url.user,
            Some(("app".to_owned(), Some("s@cret".to_owned())))
        );
        assert_eq!(url.bucket.as_deref(), Some("locks"));
        assert!(url.tls);
        assert_eq!(url.replicas, Some(3));
        assert_eq!(url.timeout, Some(Duration::from_secs(2)));
        assert_eq!(url.credentials, Some(PathBuf::from("/etc/app.creds")));
        assert_eq!(
            url.describe(),
            "nats://app:***@n1:4223,n2:4222,n3:4222/locks"
        );
        let plain = LockUrl::parse("nats://127.0.0.1").expect("valid");
        assert_eq!(plain.servers, ["127.0.0.1:4222"]);
        assert_eq!(plain.describe(), "nats://127.0.0.1:4222/leader");
        let token = LockUrl::parse("nats://s3cret@h").expect("valid");
        assert_eq!(token.describe(), "nats://***@h:4222/leader");
    }

    #[test]
    fn bad_urls_name_the_problem_without_the_password() {
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                ("redis://u:secret@h/x", "not a nats:// URL"),
                ("nats://u:secret@h/a.b", "bucket"),
                ("nats://u:secret@h/a/b", "bucket"),
                ("nats://u:secret@h/x?replicas=0", "replicas=0"),
                ("nats://u:secret@h/x?timeout=soon", "timeout=soon"),
                ("nats://u:secret@h/x?tls=maybe", "tls=maybe"),
                ("nats://u:secret@h/x?bucket=y", "unknown parameter"),
                ("nats://u:secret@h/x?server=", "server= is empty"),
                ("nats://u:secret%FF@h/x", "not UTF-8"),
            ],
        );
    }
}
