//! The store (connection, subscriber) and the lock.

use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use leader_core::{
    Acquisition, ChangeHub, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock,
    Version, redact_url,
};
use redis::Client;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSubSink};
use tokio::sync::Mutex;

use crate::error::{BACKEND, map};
use crate::scripts::{self, LuaScript};

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "leader:";

/// Builds a [`RedisStore`]; start with [`RedisStore::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("url", &redact_url(&self.url))
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisStoreBuilder {
    /// The prefix of every key (default `leader:`). An election `jobs` lives in the hash
    /// `leader:{jobs}`, its fencing counter in `leader:{jobs}:fence` (one hash slot, should you
    /// point it at a cluster-compatible proxy).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Parses the URL and prepares a connection that opens on first use and reconnects by itself.
    pub async fn build(self) -> Result<RedisStore, LockError> {
        let redacted = redact_url(&self.url);
        let client = Client::open(self.url.as_str()).map_err(|err| LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "invalid Redis URL {redacted}: {}",
                err.detail().unwrap_or("cannot parse it")
            ),
        })?;
        let connection = new_manager(&client).map_err(|err| map(&redacted, err))?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                client,
                connection: StdMutex::new(connection),
                redacted,
                prefix: self.prefix,
                subscriber: Subscriber::default(),
            }),
        })
    }
}

/// A connection that opens on first use and reconnects after connection errors.
fn new_manager(client: &Client) -> redis::RedisResult<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(3)))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500));
    ConnectionManager::new_lazy_with_config(client.clone(), config)
}

/// A Redis server holding elections: make [`RedisLock`]s from it. Cheap to clone; all locks of
/// a store share one multiplexed connection (reconnected when it breaks) and one pub/sub
/// connection.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    connection: StdMutex<ConnectionManager>,
    redacted: String,
    prefix: String,
    subscriber: Subscriber,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.inner.redacted)
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A builder for the server at `url`: `redis://[[user]:password@]host[:port][/db]`, or
    /// `rediss://` for TLS (verified against the Mozilla roots).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }

    /// A store for the server at `url` with the default prefix.
    pub async fn connect(url: impl Into<String>) -> Result<Self, LockError> {
        Self::builder(url).build().await
    }

    /// A lock on election `name` for candidate `identity`.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> RedisLock {
        let name = name.into();
        let prefix = &self.inner.prefix;
        RedisLock {
            store: self.clone(),
            key: format!("{prefix}{{{name}}}"),
            fence: format!("{prefix}{{{name}}}:fence"),
            channel: format!("{prefix}{{{name}}}:released"),
            name,
            identity: identity.into(),
        }
    }

    /// The URL with the password redacted.
    pub fn redacted_url(&self) -> &str {
        &self.inner.redacted
    }

    /// The shared connection, for commands of your own.
    pub fn connection(&self) -> ConnectionManager {
        self.inner
            .connection
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces a connection that will not recover by itself: the driver's manager reconnects
    /// after I/O errors but keeps returning a failed authentication forever, even once the
    /// password has been fixed on the server.
    fn renew_connection(&self) {
        if let Ok(fresh) = new_manager(&self.inner.client) {
            *self
                .inner
                .connection
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = fresh;
        }
    }
}

/// A [`ResourceLock`] on one Redis hash. Every operation is one Lua script (`EVALSHA`, falling
/// back to `EVAL` once after a server restart): compare-and-swap on a version field, expiry
/// by the server (`PEXPIRE` of the lease duration on every write), and a fencing token from a
/// counter that outlives the hash.
#[derive(Clone, Debug)]
pub struct RedisLock {
    store: RedisStore,
    name: String,
    identity: String,
    key: String,
    fence: String,
    channel: String,
}

impl RedisLock {
    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The hash that holds the election.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key of the fencing counter.
    pub fn fence_key(&self) -> &str {
        &self.fence
    }

    fn context(&self) -> String {
        format!("{} key {}", self.store.inner.redacted, self.key)
    }

    /// Runs `script` with the election's two keys and `args`: `EVALSHA`, and `EVAL` (which also
    /// caches the script) only when the server answers `NOSCRIPT`, as after a restart.
    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        args: &[&[u8]],
    ) -> Result<T, LockError> {
        let command = |verb: &str, body: &str| {
            let mut command = redis::cmd(verb);
            command.arg(body).arg(2).arg(&self.key).arg(&self.fence);
            for arg in args {
                command.arg(*arg);
            }
            command
        };
        let mut connection = self.store.connection();
        let mut result = command("EVALSHA", &script.sha)
            .query_async(&mut connection)
            .await;
        if let Err(err) = &result
            && err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        {
            result = command("EVAL", &script.source)
                .query_async(&mut connection)
                .await;
        }
        result.map_err(|err| {
            if err.kind() == redis::ErrorKind::AuthenticationFailed
                || matches!(err.code(), Some("WRONGPASS" | "NOAUTH"))
            {
                self.store.renew_connection();
            }
            map(&self.context(), err)
        })
    }

    /// A stored record from its fields; the fields are authoritative for holder and token.
    fn decode(
        &self,
        version: String,
        holder: String,
        transitions: i64,
        json: &str,
    ) -> Result<Observed, LockError> {
        let mut record =
            LeaderElectionRecord::from_json(BACKEND, &self.context(), json.as_bytes())?;
        record.holder_identity = holder;
        record.leader_transitions = u64::try_from(transitions).map_err(|_| {
            LockError::invalid_record(
                BACKEND,
                format!("{}: negative fencing token", self.context()),
            )
        })?;
        Ok(Observed {
            record,
            version: Version::new(version),
        })
    }
}

fn lease_ms(record: &LeaderElectionRecord) -> u64 {
    // A free record still expires, so released elections do not linger.
    u64::try_from(record.lease_duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

fn first_version() -> String {
    // Random, so a hash that expired and was created again never matches an old version.
    (fastrand::u64(..1 << 52) + 1).to_string()
}

#[async_trait]
impl ResourceLock for RedisLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let fields: Option<(String, String, i64, String)> = self.run(&scripts::GET, &[]).await?;
        fields
            .map(|(version, holder, transitions, json)| {
                self.decode(version, holder, transitions, &json)
            })
            .transpose()
    }

    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let (version, transitions): (String, u64) = self
            .run(
                &scripts::CREATE,
                &[
                    &record.to_json(),
                    record.holder_identity.as_bytes(),
                    record.leader_transitions.to_string().as_bytes(),
                    lease_ms(record).to_string().as_bytes(),
                    first_version().as_bytes(),
                ],
            )
            .await?;
        Ok(Observed {
            record: LeaderElectionRecord {
                leader_transitions: transitions,
                ..record.clone()
            },
            version: Version::new(version),
        })
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let (version, transitions): (String, u64) = self
            .run(
                &scripts::UPDATE,
                &[
                    version.as_str().as_bytes(),
                    &record.to_json(),
                    record.holder_identity.as_bytes(),
                    record.leader_transitions.to_string().as_bytes(),
                    lease_ms(record).to_string().as_bytes(),
                    self.channel.as_bytes(),
                ],
            )
            .await?;
        Ok(Observed {
            record: LeaderElectionRecord {
                leader_transitions: transitions,
                ..record.clone()
            },
            version: Version::new(version),
        })
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("redis:{}", self.key)
    }

    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        self.store
            .inner
            .subscriber
            .subscribe(&self.store, &self.channel)
            .await
            .map(Some)
    }

    async fn try_acquire(
        &self,
        desired: &LeaderElectionRecord,
    ) -> Result<Option<Acquisition>, LockError> {
        type Answer = (bool, String, i64, String, String, i64);
        let (acquired, version, transitions, holder, json, left_ms): Answer = self
            .run(
                &scripts::TRY_ACQUIRE,
                &[
                    &desired.to_json(),
                    desired.holder_identity.as_bytes(),
                    lease_ms(desired).to_string().as_bytes(),
                    first_version().as_bytes(),
                ],
            )
            .await?;
        let observed = self.decode(version, holder, transitions, &json)?;
        Ok(Some(if acquired {
            Acquisition::Acquired(observed)
        } else {
            Acquisition::Held {
                observed,
                // PTTL: -1 no expiry, -2 no key; neither tells a time to wait for.
                expires_in: u64::try_from(left_ms).ok().map(Duration::from_millis),
            }
        }))
    }
}

/// One pub/sub connection per store, fanned out to the followers of each channel.
#[derive(Default)]
struct Subscriber {
    sink: Mutex<Option<PubSubSink>>,
    hub: ChangeHub,
}

impl Subscriber {
    async fn subscribe(
        &self,
        store: &RedisStore,
        channel: &str,
    ) -> Result<ChangeStream, LockError> {
        let mut sink = self.sink.lock().await;
        if sink.is_none() || !self.hub.contains(channel) {
            if sink.is_none() {
                self.hub.close();
                let pubsub = store
                    .inner
                    .client
                    .get_async_pubsub()
                    .await
                    .map_err(|err| map(&store.inner.redacted, err))?;
                let (new_sink, mut messages) = pubsub.split();
                let hub = self.hub.clone();
                tokio::spawn(async move {
                    while let Some(message) = messages.next().await {
                        hub.notify(message.get_channel_name());
                    }
                    // The connection is gone: end every follower's stream so they subscribe again.
                    hub.close();
                });
                *sink = Some(new_sink);
            }
            let Some(active) = sink.as_mut() else {
                unreachable!("connected above");
            };
            if let Err(err) = active.subscribe(channel).await {
                *sink = None;
                return Err(map(&store.inner.redacted, err));
            }
        }
        Ok(self.hub.subscribe(channel))
    }
}
