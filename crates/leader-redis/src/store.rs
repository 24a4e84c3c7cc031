//! The store: one Redis server, its shared connection and its pub/sub subscriber.

use std::fmt;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use futures_util::StreamExt;
use leader_core::backend::ChangeHub;
use leader_core::{ChangeStream, LockError, redact_url};
use redis::Client;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSubSink, PubSubStream};
use tokio::sync::Mutex;

use crate::error::{BACKEND, map, refused_as_read_only};
use crate::eviction::EvictionCheck;

/// How long building a store waits for the server's eviction setting before it leaves the
/// check to the first term's start: a server that is down does not hold up the start.
const BUILD_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

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
        let invalid = |message: &str| LockError::Misconfigured {
            backend: BACKEND,
            message: format!("invalid Redis URL {redacted}: {message}"),
        };
        leader_core::backend::check_user_info(&self.url).map_err(|err| invalid(&err.message))?;
        let client = Client::open(self.url.as_str())
            .map_err(|err| invalid(err.detail().unwrap_or("cannot parse it")))?;
        let connection = new_manager(&client).map_err(|err| map(&redacted, err))?;
        let bulk = new_manager(&client).map_err(|err| map(&redacted, err))?;
        let store = RedisStore {
            inner: Arc::new(Inner {
                client,
                connection: StdMutex::new(connection),
                bulk: StdMutex::new(bulk),
                replaced: Default::default(),
                checked: Default::default(),
                redacted,
                prefix: self.prefix,
                subscriber: Subscriber::default(),
                eviction: EvictionCheck::default(),
            }),
        };
        // A server that evicts keys is refused here, in one line (S15); one that cannot be
        // reached yet is checked at the first term's start.
        if let Ok(Err(err @ LockError::Misconfigured { .. })) =
            tokio::time::timeout(BUILD_CHECK_TIMEOUT, store.check_eviction()).await
        {
            return Err(err);
        }
        Ok(store)
    }
}

/// How long a request waits for its answer before it fails, unless its caller gives up first
/// (the elector's request timeout, half the renew deadline by default). The driver's own default
/// (500 ms) failed every request to a server slowed down for a moment (a fork for a snapshot, a
/// large read), long before the elector would have given up.
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection that opens on first use and reconnects after connection errors.
fn new_manager(client: &Client) -> redis::RedisResult<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_connection_timeout(Some(Duration::from_secs(3)))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500));
    ConnectionManager::new_lazy_with_config(client.clone(), config)
}

/// A Redis server holding elections: make [`RedisLock`](crate::RedisLock)s from it. Cheap to clone; all locks of
/// a store share one multiplexed connection (reconnected when it breaks) and one pub/sub
/// connection. A shard set's reads of many records go on a second connection, so that
/// renewals never wait in line behind their large answers.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) connection: StdMutex<ConnectionManager>,
    /// The connection of shard sets' reads of many records ([`Lane::Bulk`]).
    pub(crate) bulk: StdMutex<ConnectionManager>,
    /// How many times each lane's connection was replaced, by [`Lane`]: a request left
    /// unanswered replaces the connection it went on, not one that replaced it already.
    replaced: [std::sync::atomic::AtomicU64; 2],
    /// By [`Lane`]: one more than the generation whose connection is being checked
    /// ([`RedisStore::check_connection`]).
    checked: [std::sync::atomic::AtomicU64; 2],
    pub(crate) redacted: String,
    pub(crate) prefix: String,
    pub(crate) subscriber: Subscriber,
    pub(crate) eviction: EvictionCheck,
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

    /// The URL with the password redacted.
    pub fn redacted_url(&self) -> &str {
        &self.inner.redacted
    }

    /// The shared connection, for commands of your own.
    pub fn connection(&self) -> ConnectionManager {
        self.connection_of(Lane::Main)
    }

    /// Checks the server's eviction setting ([`EvictionCheck::run`]) on the main connection.
    pub(crate) async fn check_eviction(&self) -> Result<(), LockError> {
        self.inner
            .eviction
            .run(&self.inner.redacted, self.connection_of(Lane::Main))
            .await
    }

    /// The connection of `lane`.
    pub(crate) fn connection_of(&self, lane: Lane) -> ConnectionManager {
        self.slot(lane).clone()
    }

    /// Sends `command` on the connection of `lane`. A connection the network stopped carrying
    /// without a reset (a firewall or NAT that dropped its state, a server moved away) gives
    /// the driver no error to reconnect on, and it would keep sending into it for as long as
    /// TCP retries, a quarter of an hour. So a request that timed out replaces its
    /// connection, and one given up by its caller while it waited (the elector's request
    /// timeout, a shard round's deadline) has the connection checked with a `PING`: replaced
    /// if that gets no answer either, kept if the server was only slow. A connection whose
    /// server refused a write as read-only (a replica, a primary a failover demoted, reached
    /// through a name that still leads there) is replaced too: the next one may reach the
    /// primary.
    pub(crate) async fn query<T: redis::FromRedisValue>(
        &self,
        lane: Lane,
        command: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        let (mut connection, generation) = {
            let slot = self.slot(lane);
            (slot.clone(), self.generation(lane))
        };
        let mut waiting = Unanswered {
            store: self,
            lane,
            generation,
            connection: Some(connection.clone()),
        };
        let result = command.query_async(&mut connection).await;
        waiting.connection = None;
        if result
            .as_ref()
            .is_err_and(|err| err.is_timeout() || refused_as_read_only(err))
        {
            self.replace_connection(lane, Some(generation));
        }
        result
    }

    /// Checks the connection of `lane` at `generation`, on which a request went unanswered,
    /// with a `PING` in the background: replaced if that gets no answer either. One check
    /// per connection at a time.
    fn check_connection(&self, lane: Lane, generation: u64, mut connection: ConnectionManager) {
        let checked = &self.inner.checked[lane as usize];
        if checked.fetch_max(generation + 1, std::sync::atomic::Ordering::AcqRel) > generation {
            return;
        }
        // Dropped outside a runtime (a store dropped at exit): nothing to check with.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.clone();
        runtime.spawn(async move {
            let answer: redis::RedisResult<String> =
                redis::cmd("PING").query_async(&mut connection).await;
            if answer.is_err() {
                store.replace_connection(lane, Some(generation));
            } else {
                // Answered: a later request left unanswered checks it again.
                let _ = store.inner.checked[lane as usize].compare_exchange(
                    generation + 1,
                    generation,
                    std::sync::atomic::Ordering::AcqRel,
                    std::sync::atomic::Ordering::Acquire,
                );
            }
        });
    }

    /// The connection of `lane`, locked.
    fn slot(&self, lane: Lane) -> std::sync::MutexGuard<'_, ConnectionManager> {
        let slot = match lane {
            Lane::Main => &self.inner.connection,
            Lane::Bulk => &self.inner.bulk,
        };
        slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many times the connection of `lane` was replaced.
    fn generation(&self, lane: Lane) -> u64 {
        self.inner.replaced[lane as usize].load(std::sync::atomic::Ordering::Acquire)
    }

    /// Replaces the connection of `lane` with one that opens on its first request, unless it
    /// was replaced since `generation` (any: `None`); requests already sent finish on the old
    /// one.
    fn replace_connection(&self, lane: Lane, generation: Option<u64>) {
        let mut slot = self.slot(lane);
        if generation.is_some_and(|g| g != self.generation(lane)) {
            return;
        }
        if let Ok(fresh) = new_manager(&self.inner.client) {
            tracing::debug!(
                server = self.inner.redacted,
                ?lane,
                "the connection is replaced (a request went unanswered or was refused as read-only, or a login failed)"
            );
            *slot = fresh;
            self.inner.replaced[lane as usize].fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
    }

    /// Replaces the connections that will not recover by themselves: the driver's manager
    /// reconnects after I/O errors but keeps returning a failed authentication forever, even
    /// once the password has been fixed on the server.
    pub(crate) fn renew_connection(&self) {
        self.replace_connection(Lane::Main, None);
        self.replace_connection(Lane::Bulk, None);
    }
}

/// A request in flight on a lane: dropped before its answer, it has the connection it went on
/// checked ([`RedisStore::check_connection`]).
struct Unanswered<'a> {
    store: &'a RedisStore,
    lane: Lane,
    /// How many times the lane's connection was replaced before this request.
    generation: u64,
    /// The connection the request went on, until its answer came.
    connection: Option<ConnectionManager>,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.take() {
            self.store
                .check_connection(self.lane, self.generation, connection);
        }
    }
}

/// Which of a store's connections a request goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Renewals, acquisitions, and reads of a few records.
    Main,
    /// A shard set's reads of many records: their answers are large, and a request behind
    /// them on one multiplexed connection waits until they have all arrived.
    Bulk,
}

/// How often the pub/sub connection is checked with a `PING`. The connection is idle while
/// nobody releases or takes a lease, and a NAT or firewall drops the state of an idle connection
/// (after some minutes, on many): the check keeps it in use, and finds one whose state was
/// dropped all the same, which no error reports, within this period and [`RESPONSE_TIMEOUT`].
pub(crate) const SUBSCRIBER_CHECK: Duration = Duration::from_secs(10);

/// One pub/sub connection per store, fanned out to the followers of each channel.
#[derive(Default)]
pub(crate) struct Subscriber {
    connection: Mutex<Option<PubSubConnection>>,
}

/// A pub/sub connection: its sink, the hub of its followers, and the tasks that read it and
/// check it, stopped (and the connection closed) when it is dropped.
struct PubSubConnection {
    sink: PubSubSink,
    hub: ChangeHub,
    reader: tokio::task::AbortHandle,
    checker: tokio::task::AbortHandle,
}

impl Drop for PubSubConnection {
    fn drop(&mut self) {
        self.reader.abort();
        self.checker.abort();
        self.hub.close();
    }
}

impl Subscriber {
    pub(crate) async fn subscribe(
        &self,
        store: &RedisStore,
        channel: &str,
    ) -> Result<ChangeStream, LockError> {
        let mut connection = self.connection.lock().await;
        // A connection whose hub closed (it ended, or did not answer a check) is replaced.
        if connection.as_ref().is_none_or(|c| c.hub.is_closed()) {
            *connection = None;
            let pubsub = store
                .inner
                .client
                .get_async_pubsub()
                .await
                .map_err(|err| map(&store.inner.redacted, err))?;
            let (sink, messages) = pubsub.split();
            let hub = ChangeHub::new();
            let reader = tokio::spawn(read_messages(messages, hub.clone())).abort_handle();
            let checker = tokio::spawn(check_connection(sink.clone(), hub.clone(), reader.clone()))
                .abort_handle();
            *connection = Some(PubSubConnection {
                sink,
                hub,
                reader,
                checker,
            });
        }
        let Some(active) = connection.as_mut() else {
            unreachable!("connected above");
        };
        if !active.hub.contains(channel)
            && let Err(err) = active.sink.subscribe(channel).await
        {
            // A refusal of this channel (an ACL) leaves the other locks' streams alone.
            if err.is_io_error() || err.is_connection_dropped() {
                *connection = None;
            }
            return Err(map(&store.inner.redacted, err));
        }
        // Ends at once if the hub closed meanwhile: the follower subscribes again.
        Ok(active.hub.subscribe(channel))
    }
}

/// Hands the pub/sub connection's messages to its followers until it ends; then every follower
/// is woken to read the record and its stream ends, and the next subscription opens a new
/// connection.
async fn read_messages(mut messages: PubSubStream, hub: ChangeHub) {
    while let Some(message) = messages.next().await {
        hub.notify(message.get_channel_name());
    }
    // A release may have gone unheard: every follower reads the record.
    hub.notify_all();
    hub.close();
}

/// Checks the pub/sub connection with a `PING` every [`SUBSCRIBER_CHECK`], beside its reader.
/// A `PING` with no answer within [`RESPONSE_TIMEOUT`], or whose connection failed, closes the
/// hub and the connection: the followers are woken to read the record (a release may have gone
/// unheard) and their streams end, so that the next subscription opens a new connection. A reply from the server,
/// an error one included (an ACL without `PING`), shows the connection carries data.
async fn check_connection(mut sink: PubSubSink, hub: ChangeHub, reader: tokio::task::AbortHandle) {
    loop {
        tokio::time::sleep(SUBSCRIBER_CHECK).await;
        if hub.is_closed() {
            return;
        }
        let dead = match tokio::time::timeout(RESPONSE_TIMEOUT, sink.ping::<redis::Value>()).await {
            Err(_) => true,
            Ok(Ok(_)) => false,
            Ok(Err(err)) => err.is_io_error() || err.is_connection_dropped(),
        };
        if dead {
            tracing::debug!("the pub/sub connection did not answer a PING: replaced");
            hub.notify_all();
            hub.close();
            // The reader holds the connection open: stopped, it closes it.
            reader.abort();
            return;
        }
    }
}
