//! The server and its bucket: one client connection shared by every lock made from it.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use leader_core::{LockError, redact_url};

use crate::error::{BACKEND, Refusals, map, stream_not_found};

mod builder;

pub use builder::NatsStoreBuilder;
pub(crate) use builder::{redacted, valid_bucket};

/// The default bucket.
pub const DEFAULT_BUCKET: &str = "leader";

/// The default time a request waits for the server's answer.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest the client waits between two attempts to connect again after it lost the
/// server. The client's own default grows to 4 s, which an election would add to its wait for
/// a server that came back (a follower could lead up to 4 s late); one attempt a second per
/// replica is a small load on a server that is down.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);

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
    use super::builder::reconnect_delay;
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
