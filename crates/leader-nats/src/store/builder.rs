//! The store's builder: the servers, the credentials, TLS, the bucket and its checks, and the
//! client's connection.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use async_nats::jetstream;
use leader_core::backend::Backoff;
use leader_core::{LockError, redact_url};

use super::{Inner, Lookups, MAX_RECONNECT_DELAY, NatsStore, login_of};
use crate::error::{BACKEND, Refusals};

/// The client's waits between attempts to connect again: none before the first, then doubling
/// from 50 ms up to [`MAX_RECONNECT_DELAY`].
const RECONNECT: Backoff =
    Backoff::new(Duration::from_millis(50), MAX_RECONNECT_DELAY).first_retry_at_once();

/// The wait before the client's `attempts`-th attempt in a row to connect again (the client
/// counts from 1).
pub(super) fn reconnect_delay(attempts: usize) -> Duration {
    RECONNECT.wait_after(u32::try_from(attempts).unwrap_or(u32::MAX))
}

/// How long the connection may stay silent before the client sends a `PING`; with two left
/// without their `PONG`, the third makes it connect again. A connection whose state a NAT or
/// firewall dropped reports no error, and the client's default (a minute) would leave the lock
/// on it, failing every request, for three minutes. Anything the server sends delays the next
/// `PING`, and only a `PONG` answers one.
const PING_INTERVAL: Duration = Duration::from_secs(3);

/// Builds a [`NatsStore`].
#[must_use]
pub struct NatsStoreBuilder {
    pub(super) servers: Vec<String>,
    pub(super) bucket: String,
    pub(super) create_bucket: bool,
    pub(super) replicas: usize,
    pub(super) credentials: Option<PathBuf>,
    pub(super) login: Option<Login>,
    pub(super) require_tls: bool,
    pub(super) request_timeout: Duration,
    pub(super) nkey_file: Option<PathBuf>,
    pub(super) tls_roots: Option<PathBuf>,
    pub(super) tls_client: Option<(PathBuf, PathBuf)>,
    pub(super) api_prefix: Option<String>,
}

/// A login other than a credentials file.
pub(super) enum Login {
    UserAndPassword(String, String),
    Token(String),
}

impl fmt::Debug for NatsStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsStoreBuilder")
            .field("servers", &redacted(&self.servers))
            .field("bucket", &self.bucket)
            .field("create_bucket", &self.create_bucket)
            .field("replicas", &self.replicas)
            .field("credentials", &self.credentials)
            .field(
                "login",
                &match &self.login {
                    Some(Login::UserAndPassword(user, _)) => format!("{user}:***"),
                    Some(Login::Token(_)) => "token ***".to_owned(),
                    None => "none".to_owned(),
                },
            )
            .field("require_tls", &self.require_tls)
            .field("request_timeout", &self.request_timeout)
            .field("nkey_file", &self.nkey_file)
            .field("tls_roots", &self.tls_roots)
            .field("tls_client", &self.tls_client)
            .field("api_prefix", &self.api_prefix)
            .finish()
    }
}

/// The servers with their passwords and tokens redacted, as one list: a password holding a
/// comma was split with it.
pub(crate) fn redacted(servers: &[String]) -> String {
    let joined = servers.join(",");
    // Without a scheme (`user:pass@host`) the user-info is not found: redacted with one.
    if joined.contains("://") {
        return redact_url(&joined);
    }
    let redacted = redact_url(&format!("nats://{joined}"));
    match redacted.strip_prefix("nats://") {
        Some(rest) => rest.to_owned(),
        None => redacted,
    }
}

/// Whether `name` can name a bucket: letters, digits, `-` and `_` (the server's rule).
pub(crate) fn valid_bucket(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl NatsStoreBuilder {
    /// The bucket that keeps the records (default [`DEFAULT_BUCKET`]).
    pub fn bucket(mut self, bucket: impl Into<String>) -> Self {
        self.bucket = bucket.into();
        self
    }

    /// Creates the bucket when it is missing, on first use (needs the right to add streams):
    /// one value per key kept (history 1), on disk, no expiry of its own.
    pub fn create_bucket(mut self, create: bool) -> Self {
        self.create_bucket = create;
        self
    }

    /// How many servers of a JetStream cluster keep a bucket this store creates (default 1;
    /// 3 or 5 in a cluster, so that the records outlive a server).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Logs in with a credentials file (a user JWT and its nkey seed, as `nsc` writes it).
    pub fn credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.credentials = Some(path.into());
        self
    }

    /// Logs in with a user name and password.
    pub fn user_and_password(
        mut self,
        user: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.login = Some(Login::UserAndPassword(user.into(), password.into()));
        self
    }

    /// Logs in with a token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.login = Some(Login::Token(token.into()));
        self
    }

    /// Logs in with the NKey whose seed (`SU...`) the file at `path` holds, as `nk -gen user`
    /// writes it (the seed is read when the store is built, never shown).
    pub fn nkey_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.nkey_file = Some(path.into());
        self
    }

    /// Trusts the CA certificates (PEM) in the file at `path` for the server's certificate,
    /// as a private CA needs, and requires TLS.
    pub fn tls_root_certificates(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls_roots = Some(path.into());
        self
    }

    /// Presents the client certificate and key (PEM files) the server asks for (`verify:
    /// true` in its `tls` block), and requires TLS.
    pub fn tls_client_certificate(
        mut self,
        certificate: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.tls_client = Some((certificate.into(), key.into()));
        self
    }

    /// The JetStream domain of the bucket (a leaf node's, or a hub's seen from a leaf node):
    /// the JetStream API is `$JS.DOMAIN.API`.
    pub fn jetstream_domain(mut self, domain: impl AsRef<str>) -> Self {
        self.api_prefix = Some(format!("$JS.{}.API", domain.as_ref()));
        self
    }

    /// The JetStream API prefix, for an account that imports another's JetStream under its own
    /// prefix (default `$JS.API`).
    pub fn jetstream_api_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.api_prefix = Some(prefix.into());
        self
    }

    /// Refuses a connection without TLS (`tls://` addresses ask for it too).
    pub fn require_tls(mut self, require: bool) -> Self {
        self.require_tls = require;
        self
    }

    /// How long a request waits for the server's answer (default
    /// [`DEFAULT_REQUEST_TIMEOUT`]).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Makes the store. The client connects in the background (and again after every lost
    /// connection, at most [`MAX_RECONNECT_DELAY`] apart): a server that is down at start makes the first requests fail as
    /// [`LockError::Unavailable`], not the build. The bucket is looked up on first use.
    ///
    /// # Errors
    /// An invalid server address or bucket name, or an unreadable credentials file
    /// ([`LockError::Misconfigured`]).
    pub async fn build(self) -> Result<NatsStore, LockError> {
        let redacted = redacted(&self.servers);
        let misconfigured = |message: String| LockError::Misconfigured {
            backend: BACKEND,
            message,
        };
        if !valid_bucket(&self.bucket) {
            return Err(misconfigured(format!(
                "bucket name {:?}: only letters, digits, '-' and '_'",
                self.bucket
            )));
        }
        // A login in an address is the client's too (the client itself would ignore it): the
        // builder's own login, if any, wins.
        let mut login = self.login;
        let mut addresses = Vec::with_capacity(self.servers.len());
        for server in &self.servers {
            let bad = |err: String| misconfigured(format!("server address in {redacted}: {err}"));
            let with_scheme = if server.contains("://") {
                server.clone()
            } else {
                format!("nats://{server}")
            };
            leader_core::backend::check_user_info(&with_scheme).map_err(|err| bad(err.message))?;
            let mut url = url::Url::parse(&with_scheme).map_err(|err| bad(err.to_string()))?;
            let in_address = login_of(&url).map_err(bad)?;
            if let Some((user, password)) = in_address {
                let found = match password {
                    Some(password) => Login::UserAndPassword(user, password),
                    None => Login::Token(user),
                };
                login.get_or_insert(found);
                let _ = url.set_username("");
                let _ = url.set_password(None);
            }
            addresses.push(
                url.as_str()
                    .parse::<async_nats::ServerAddr>()
                    .map_err(|err| bad(err.to_string()))?,
            );
        }
        if addresses.is_empty() {
            return Err(misconfigured("no server address".to_owned()));
        }
        let refusals = Arc::new(Refusals::default());
        let events = Arc::clone(&refusals);
        let mut options = async_nats::ConnectOptions::new()
            .name("leader")
            .retry_on_initial_connect()
            .reconnect_delay_callback(reconnect_delay)
            .ping_interval(PING_INTERVAL)
            .request_timeout(Some(self.request_timeout))
            .require_tls(self.require_tls)
            .event_callback(move |event| {
                let events = Arc::clone(&events);
                async move {
                    match event {
                        async_nats::Event::ServerError(
                            async_nats::ServerError::AuthorizationViolation,
                        ) => events.record("authorization violation (a wrong user, password, token or credentials)".to_owned()),
                        async_nats::Event::ServerError(async_nats::ServerError::Other(message))
                            if message.to_ascii_lowercase().contains("permission") =>
                        {
                            events.record(message);
                        }
                        // A login refused while connecting (and again at each retry).
                        async_nats::Event::ClientError(async_nats::ClientError::Other(message))
                            if message.to_ascii_lowercase().contains("authori")
                                || message.to_ascii_lowercase().contains("authentic") =>
                        {
                            events.record(format!("login refused: {message}"));
                        }
                        async_nats::Event::Connected => events.clear(),
                        _ => {}
                    }
                }
            });
        match &login {
            Some(Login::UserAndPassword(user, password)) => {
                options = options.user_and_password(user.clone(), password.clone());
            }
            Some(Login::Token(token)) => options = options.token(token.clone()),
            None => {}
        }
        if let Some(path) = &self.nkey_file {
            let seed = std::fs::read_to_string(path).map_err(|err| {
                misconfigured(format!("NKey seed file {}: {err}", path.display()))
            })?;
            let seed = seed.trim();
            if !seed.starts_with('S') {
                return Err(misconfigured(format!(
                    "NKey seed file {}: no seed (a seed begins with S, such as SU... for a user)",
                    path.display()
                )));
            }
            options = options.nkey(seed.to_owned());
        }
        let readable = |what: &str, path: &std::path::Path| {
            std::fs::File::open(path)
                .map(drop)
                .map_err(|err| misconfigured(format!("{what} {}: {err}", path.display())))
        };
        if let Some(path) = &self.tls_roots {
            readable("TLS CA file", path)?;
            options = options
                .add_root_certificates(path.clone())
                .require_tls(true);
        }
        if let Some((certificate, key)) = &self.tls_client {
            readable("TLS client certificate", certificate)?;
            readable("TLS client key", key)?;
            options = options
                .add_client_certificate(certificate.clone(), key.clone())
                .require_tls(true);
        }
        if let Some(path) = &self.credentials {
            options = options.credentials_file(path).await.map_err(|err| {
                misconfigured(format!("credentials file {}: {err}", path.display()))
            })?;
        }
        let client = options.connect(addresses).await.map_err(|err| {
            // Only a configuration the client refuses fails here: connecting is retried.
            misconfigured(format!("{redacted}: {err}"))
        })?;
        let jetstream = match &self.api_prefix {
            Some(prefix) => jetstream::ContextBuilder::new()
                .api_prefix(prefix.clone())
                .timeout(self.request_timeout)
                .build(client.clone()),
            None => jetstream::ContextBuilder::new()
                .timeout(self.request_timeout)
                .build(client.clone()),
        };
        Ok(Self::store(
            (self.bucket, self.create_bucket, self.replicas),
            jetstream,
            refusals,
            redacted,
        ))
    }

    /// Makes the store on the service's own JetStream context (its connection, login, TLS and
    /// domain or API prefix), with this builder's bucket settings; the builder's servers,
    /// login, TLS and JetStream settings are not used. The connection's own event callback
    /// stays the service's, so a server's refusal is not told apart from a timeout by the
    /// lock: keep the request timeout of the context below the elector's renew deadline.
    ///
    /// # Errors
    /// An invalid bucket name ([`LockError::Misconfigured`]).
    pub fn build_on(self, jetstream: jetstream::Context) -> Result<NatsStore, LockError> {
        if !valid_bucket(&self.bucket) {
            return Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "bucket name {:?}: only letters, digits, '-' and '_'",
                    self.bucket
                ),
            });
        }
        let redacted = format!(
            "(the service's connection to {})",
            jetstream.client().server_info().host
        );
        Ok(Self::store(
            (self.bucket, self.create_bucket, self.replicas),
            jetstream,
            Arc::default(),
            redacted,
        ))
    }

    /// The store on `jetstream` for the bucket settings `(bucket, create, replicas)`.
    fn store(
        (bucket, create_bucket, replicas): (String, bool, usize),
        jetstream: jetstream::Context,
        refusals: Arc<Refusals>,
        redacted: String,
    ) -> NatsStore {
        NatsStore {
            inner: Arc::new(Inner {
                client: jetstream.client(),
                jetstream,
                bucket,
                create_bucket,
                replicas,
                kv: std::sync::Mutex::new(None),
                lookups: tokio::sync::Mutex::new(Lookups::default()),
                lookups_done: AtomicU64::new(0),
                refusals,
                redacted,
            }),
        }
    }
}
