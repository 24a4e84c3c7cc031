//! The server and its bucket: one client connection shared by every lock made from it.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use leader_core::{LockError, redact_url};

use crate::error::{BACKEND, Refusals, map, stream_not_found};

/// The default bucket.
pub const DEFAULT_BUCKET: &str = "leader";

/// The default time a request waits for the server's answer.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest the client waits between two attempts to connect again after it lost the
/// server. The client's own default grows to 4 s, which an election would add to its wait for
/// a server that came back (a follower could lead up to 4 s late); one attempt a second per
/// replica is a small load on a server that is down.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);

/// The wait before the client's `attempts`-th attempt in a row to connect again: none for the
/// first, then doubling from 50 ms up to [`MAX_RECONNECT_DELAY`].
fn reconnect_delay(attempts: usize) -> Duration {
    let doublings = u32::try_from(attempts.saturating_sub(2)).unwrap_or(u32::MAX);
    match attempts {
        0 | 1 => Duration::ZERO,
        _ => Duration::from_millis(50)
            .saturating_mul(2u32.saturating_pow(doublings.min(16)))
            .min(MAX_RECONNECT_DELAY),
    }
}

/// Builds a [`NatsStore`].
#[must_use]
pub struct NatsStoreBuilder {
    servers: Vec<String>,
    bucket: String,
    create_bucket: bool,
    replicas: usize,
    credentials: Option<PathBuf>,
    login: Option<Login>,
    require_tls: bool,
    request_timeout: Duration,
    nkey_file: Option<PathBuf>,
    tls_roots: Option<PathBuf>,
    tls_client: Option<(PathBuf, PathBuf)>,
    api_prefix: Option<String>,
}

/// A login other than a credentials file.
enum Login {
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
            leader_core::UrlError::check_user_info(&with_scheme).map_err(|err| bad(err.message))?;
            let mut url = url::Url::parse(&with_scheme).map_err(|err| bad(err.to_string()))?;
            if let Some((user, password)) = login_of(&url) {
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

/// A NATS server (or cluster) and the key-value bucket that keeps the election records, on one
/// client connection. Cheap to clone; every lock made from it shares the connection.
#[derive(Clone)]
pub struct NatsStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: async_nats::Client,
    pub(crate) jetstream: jetstream::Context,
    pub(crate) bucket: String,
    create_bucket: bool,
    replicas: usize,
    /// The bucket's handle, until a request finds its stream gone.
    kv: std::sync::Mutex<Option<Opened>>,
    /// Lookups of the bucket, one at a time.
    lookups: tokio::sync::Mutex<Lookups>,
    /// `lookups.done`, readable without waiting.
    lookups_done: AtomicU64,
    pub(crate) refusals: Arc<Refusals>,
    pub(crate) redacted: String,
}

/// The bucket's handle, the number of the lookup that found it, and when its stream was
/// created (which names it: a bucket deleted and created again has another).
#[derive(Clone)]
pub(crate) struct Opened {
    pub(crate) store: Arc<kv::Store>,
    pub(crate) generation: u64,
    pub(crate) created: i128,
}

/// The lookups of the bucket made so far, and how the last one failed, if it did.
#[derive(Default)]
struct Lookups {
    done: u64,
    failure: Option<LockError>,
}

impl fmt::Debug for NatsStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsStore")
            .field("servers", &self.inner.redacted)
            .field("bucket", &self.inner.bucket)
            .finish_non_exhaustive()
    }
}

impl NatsStore {
    /// A builder for the server at `servers`: `nats://[user:password@]host:4222` (or
    /// `tls://`), several separated by commas.
    pub fn builder(servers: impl AsRef<str>) -> NatsStoreBuilder {
        NatsStoreBuilder {
            servers: servers
                .as_ref()
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            bucket: DEFAULT_BUCKET.to_owned(),
            create_bucket: false,
            replicas: 1,
            credentials: None,
            login: None,
            require_tls: false,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            nkey_file: None,
            tls_roots: None,
            tls_client: None,
            api_prefix: None,
        }
    }

    /// The client, for the service's own use of the connection.
    pub fn client(&self) -> &async_nats::Client {
        &self.inner.client
    }

    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        &self.inner.bucket
    }

    /// The bucket's handle: looked up on first use (and created, if the builder says so), and
    /// again after a request found the bucket's stream gone (an operator deleted the bucket, or
    /// deleted and created it again), with its settings checked each time.
    ///
    /// # Errors
    /// A missing bucket ([`LockError::Misconfigured`]), no answer
    /// ([`LockError::Unavailable`]), missing rights ([`LockError::Forbidden`]).
    pub async fn kv(&self) -> Result<kv::Store, LockError> {
        self.opened().await.map(|opened| (*opened.store).clone())
    }

    /// The bucket's handle and the number of the lookup that found it. Concurrent callers wait
    /// for one lookup and share its outcome, so a fleet of locks on one store makes one
    /// request, not one each, when the handle was dropped.
    pub(crate) async fn opened(&self) -> Result<Opened, LockError> {
        if let Some(opened) = self.cached() {
            return Ok(opened);
        }
        let before = self.inner.lookups_done.load(Ordering::Acquire);
        let mut lookups = self.inner.lookups.lock().await;
        if let Some(opened) = self.cached() {
            return Ok(opened);
        }
        if lookups.done > before
            && let Some(failure) = &lookups.failure
        {
            return Err(failure.duplicate());
        }
        let found = self.look_up().await;
        lookups.done += 1;
        self.inner
            .lookups_done
            .store(lookups.done, Ordering::Release);
        match found {
            Ok(store) => {
                lookups.failure = None;
                let opened = Opened {
                    created: store.stream.cached_info().created.unix_timestamp_nanos(),
                    store: Arc::new(store),
                    generation: lookups.done,
                };
                *self.inner.kv.lock().unwrap_or_else(|p| p.into_inner()) = Some(opened.clone());
                Ok(opened)
            }
            Err(err) => {
                lookups.failure = Some(err.duplicate());
                Err(err)
            }
        }
    }

    fn cached(&self) -> Option<Opened> {
        self.inner
            .kv
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Drops the handle of lookup `generation` (not a newer one), after a request that went
    /// unanswered or found no stream: the next request looks the bucket up again, and creates
    /// it if the builder says so. Nothing is retried here; the elector's next attempt, after its
    /// retry period and back-off, makes the lookup.
    pub(crate) fn forget(&self, generation: u64) {
        let mut kv = self.inner.kv.lock().unwrap_or_else(|p| p.into_inner());
        if kv
            .as_ref()
            .is_some_and(|opened| opened.generation == generation)
        {
            *kv = None;
            tracing::debug!(
                bucket = %self.inner.bucket,
                "the bucket's stream did not answer or is gone: looking it up again on the next request"
            );
        }
    }

    /// Looks the bucket up (and creates it, if the builder says so), and checks its settings.
    async fn look_up(&self) -> Result<kv::Store, LockError> {
        let context = self.context();
        let found = self.inner.jetstream.get_key_value(&self.inner.bucket).await;
        let store = match found {
            Ok(store) => Ok(store),
            Err(err) if err.kind() == jetstream::context::KeyValueErrorKind::InvalidStoreName => {
                Err(LockError::Misconfigured {
                    backend: BACKEND,
                    message: format!(
                        "{context}: the stream KV_{} is not a key-value bucket (it keeps no value per key)",
                        self.inner.bucket
                    ),
                })
            }
            // Nobody subscribes to the JetStream API: the server (or the account) runs
            // without JetStream.
            Err(err) if answered_by_nobody(&err) => Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "{context}: no JetStream answers on this server (no responders): enable it (`nats-server -js`, or a jetstream block in the server's configuration) and for the account"
                ),
            }),
            Err(err) => {
                let mapped = map(&context, &self.inner.refusals, is_timeout(&err), err);
                if !(self.inner.create_bucket && matches!(mapped, LockError::Misconfigured { .. }))
                {
                    return Err(mapped);
                }
                self.create(&context).await
            }
        }?;
        self.check(&context, &store.stream.cached_info().config)?;
        Ok(store)
    }

    /// Refuses a bucket the lock cannot be safe on (S15), in one line naming the setting: one
    /// whose limits make the server delete records (an election's record removed while its
    /// holder leads is created afresh by a candidate at once), and a replicated bucket on a
    /// server whose clustered compare-and-swap can let two writers win (before 2.9.21).
    fn check(&self, context: &str, config: &jetstream::stream::Config) -> Result<(), LockError> {
        let refuse = |message: String| {
            Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!("{context}: {message}"),
            })
        };
        if !config.max_age.is_zero() {
            return refuse(format!(
                "its records expire after {:?} (max_age, `nats kv add --ttl`), also while their holder leads; use a bucket without a TTL",
                config.max_age
            ));
        }
        if config.discard == jetstream::stream::DiscardPolicy::Old {
            if config.max_messages > 0 {
                return refuse(format!(
                    "it keeps at most {} values and discards the oldest (max_msgs with discard old), which deletes the records of other elections; use a bucket without that limit",
                    config.max_messages
                ));
            }
            if config.max_bytes > 0 {
                return refuse(format!(
                    "it keeps at most {} bytes and discards the oldest values (max_bytes with discard old), which deletes the records of other elections; use a bucket without that limit",
                    config.max_bytes
                ));
            }
        }
        let version = self.inner.client.server_info().version;
        if config.num_replicas > 1 && !has_clustered_compare_and_swap(&version) {
            return refuse(format!(
                "the bucket has {} replicas and the server runs nats-server {version}: before 2.9.21 a replicated stream checks the expected revision only before it proposes a write (nats-server#4319), so two compare-and-swaps at one revision can both win; upgrade the servers to 2.9.21 or later, or use a bucket with one replica",
                config.num_replicas
            ));
        }
        Ok(())
    }

    /// Creates the bucket's stream with the key-value conventions (`KV_<bucket>`, subjects
    /// `$KV.<bucket>.>`, one value per key, rollups allowed, deletes through markers only,
    /// direct gets). The client's own bucket creation first reads account fields that 2.9
    /// servers do not send, so it cannot be used with them.
    async fn create(&self, context: &str) -> Result<kv::Store, LockError> {
        let bucket = &self.inner.bucket;
        let config = jetstream::stream::Config {
            name: format!("KV_{bucket}"),
            description: Some("leader election records".to_owned()),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            storage: jetstream::stream::StorageType::File,
            num_replicas: self.inner.replicas,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: jetstream::stream::DiscardPolicy::New,
            ..Default::default()
        };
        // No bucket is created that would be refused once made.
        self.check(context, &config)?;
        let created = self.inner.jetstream.create_stream(config).await;
        // Whether it was this store or another replica that created it, read it as a bucket.
        match self.inner.jetstream.get_key_value(bucket).await {
            Ok(store) => Ok(store),
            Err(err) => Err(match created {
                Err(created) => map(context, &self.inner.refusals, is_timeout(&created), created),
                Ok(_) => map(context, &self.inner.refusals, is_timeout(&err), err),
            }),
        }
    }

    /// The stream's last sequence number now: above every revision the bucket has written.
    pub(crate) async fn last_sequence(&self, opened: &Opened) -> Result<u64, LockError> {
        match opened.store.stream.get_info().await {
            Ok(info) => {
                // Deleted and created again since it was looked up: the next request looks it
                // up again, and checks its settings.
                if info.created.unix_timestamp_nanos() != opened.created {
                    self.forget(opened.generation);
                }
                Ok(info.state.last_sequence)
            }
            Err(err) => {
                if stream_not_found(&err) {
                    self.forget(opened.generation);
                }
                Err(map(
                    &self.context(),
                    &self.inner.refusals,
                    is_timeout(&err),
                    err,
                ))
            }
        }
    }

    pub(crate) fn context(&self) -> String {
        format!("{} bucket {}", self.inner.redacted, self.inner.bucket)
    }

    pub(crate) fn refusals(&self) -> &Refusals {
        &self.inner.refusals
    }
}

/// Whether a server of `version` checks a clustered stream's expected revision when it applies
/// a write, not only before it proposes it (nats-server#4319, released in 2.9.21). A version
/// that does not parse is taken for a current one.
fn has_clustered_compare_and_swap(version: &str) -> bool {
    semver::Version::parse(version.trim_start_matches('v'))
        .map_or(true, |v| (v.major, v.minor, v.patch) >= (2, 9, 21))
}

/// The user (or token) and password in `url`, percent-decoded; `None` without a user.
pub(crate) fn login_of(url: &url::Url) -> Option<(String, Option<String>)> {
    let decode = |part: &str| {
        url::form_urlencoded::parse(format!("x={part}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    (!url.username().is_empty()).then(|| (decode(url.username()), url.password().map(decode)))
}

/// Whether the server said that nobody subscribes to the request's subject, somewhere in
/// `err`'s chain.
fn answered_by_nobody(err: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::context::{RequestError, RequestErrorKind};
    let mut current = Some(err);
    while let Some(err) = current {
        if err
            .downcast_ref::<RequestError>()
            .is_some_and(|err| err.kind() == RequestErrorKind::NoResponders)
            || err
                .to_string()
                .to_ascii_lowercase()
                .contains("no responders")
        {
            return true;
        }
        current = err.source();
    }
    false
}

/// Whether the client gave up waiting for an answer somewhere in `err`'s chain.
pub(crate) fn is_timeout(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(err);
    while let Some(err) = current {
        let text = err.to_string().to_ascii_lowercase();
        if text.contains("timed out") || text.contains("no responders") {
            return true;
        }
        current = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clustered_compare_and_swap_holds_from_2_9_21() {
        for (version, holds) in [
            ("2.9.10", false),
            ("2.9.20", false),
            ("2.9.21", true),
            ("2.10.0", true),
            ("2.11.4", true),
            ("v2.8.4", false),
            ("2.10.0-beta.1", true),
            ("", true),
        ] {
            assert_eq!(has_clustered_compare_and_swap(version), holds, "{version}");
        }
    }

    #[test]
    fn reconnect_attempts_start_at_once_and_stay_at_most_a_second_apart() {
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(50));
        assert_eq!(reconnect_delay(3), Duration::from_millis(100));
        let waits: Vec<Duration> = (1..10_000).map(reconnect_delay).collect();
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert_eq!(waits.last(), Some(&MAX_RECONNECT_DELAY));
        assert_eq!(reconnect_delay(usize::MAX), MAX_RECONNECT_DELAY);
    }
}
