//! The server and its bucket: one client connection shared by every lock made from it.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use leader_core::LockError;
use leader_core::backend::LockErrorExt;

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
    /// kept in memory, which a server's restart empties; one whose limits make the server
    /// delete records (an election's record removed while its
    /// holder leads is created afresh by a candidate at once), and a replicated bucket on a
    /// server whose clustered compare-and-swap can let two writers win or replicas diverge
    /// or lose it ([`REPLICATED_FLAWS`]: before 2.10.19, and 2.10.20 to 2.10.22), or whose
    /// version does not parse.
    fn check(&self, context: &str, config: &jetstream::stream::Config) -> Result<(), LockError> {
        let refuse = |message: String| {
            Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!("{context}: {message}"),
            })
        };
        if config.storage == jetstream::stream::StorageType::Memory {
            return refuse(
                "its records are kept in memory (storage memory, `nats kv add --storage memory`): a restart of the server that holds it loses every record and the stream's sequence with them, so a candidate leads beside the holder and fencing tokens start again; use a bucket on file storage"
                    .to_owned(),
            );
        }
        if !config.max_age.is_zero() {
            return refuse(format!(
                "its records expire after {:?} (max_age, `nats kv add --ttl`), also while their holder leads; use a bucket without a TTL",
                config.max_age
            ));
        }
        if config.discard_new_per_subject {
            return refuse(
                "it refuses a value for a key that holds one already (discard_new_per_subject), so no record could be renewed or taken over; use a bucket without it"
                    .to_owned(),
            );
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
        if config.num_replicas > 1 {
            let version = self.inner.client.server_info().version;
            let replicas = config.num_replicas;
            let (major, minor, patch) = REPLICATED_FLAWS[REPLICATED_FLAWS.len() - 1].1;
            match replicated_compare_and_swap_flaws(&version) {
                Some(flaws) if flaws.is_empty() => {}
                Some(flaws) => {
                    return refuse(format!(
                        "the bucket has {replicas} replicas and the server runs nats-server {version}: {}; upgrade every server to {major}.{minor}.{patch} or later, or use a bucket with one replica",
                        flaws.join("; ")
                    ));
                }
                None => {
                    return refuse(format!(
                        "the bucket has {replicas} replicas and the server's version {version:?} does not parse, so the lock cannot tell whether it fixed the flaws of replicated streams (fixed by {major}.{minor}.{patch}: nats-server#4319, nats-server#5794, nats-server#6888); run a released server, or use a bucket with one replica"
                    ));
                }
            }
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

    /// Checks the bucket again before a write that starts a term (S15), in one request: its
    /// settings, which an operator may have changed since it was looked up (`nats kv edit
    /// --ttl`, a limit, a scale to three replicas), and its stream, which may have been deleted
    /// and created again. Returns the lowest fencing token the term may have: one above the
    /// stream's last sequence (above every revision the bucket has written) and above
    /// `expected`, the key's revision the write will compare with. A stream's information may
    /// come from a replica that lags: nats-server lets a member that sees no leader answer it
    /// with its own state (`jsStreamInfoRequest`). The compare-and-swap checks `expected`
    /// exactly, so it bounds every token the key had, each its own write, whoever answered.
    ///
    /// # Errors
    /// A setting the lock refuses ([`LockError::Misconfigured`], as at the lookup); a stream
    /// other than the one looked up ([`LockError::Conflict`]: what was read may be the old
    /// bucket's, and the next request looks the bucket up again); the server's errors.
    pub(crate) async fn term_start(
        &self,
        opened: &Opened,
        expected: u64,
    ) -> Result<u64, LockError> {
        let context = self.context();
        let info = match opened.store.stream.get_info().await {
            Ok(info) => info,
            Err(err) => {
                if stream_not_found(&err) {
                    self.forget(opened.generation);
                }
                return Err(map(&context, &self.inner.refusals, is_timeout(&err), err));
            }
        };
        if info.created.unix_timestamp_nanos() != opened.created {
            self.forget(opened.generation);
            return Err(LockError::conflict(BACKEND));
        }
        self.check(&context, &info.config)?;
        Ok(info.state.last_sequence.max(expected).saturating_add(1))
    }

    pub(crate) fn context(&self) -> String {
        format!("{} bucket {}", self.inner.redacted, self.inner.bucket)
    }

    pub(crate) fn refusals(&self) -> &Refusals {
        &self.inner.refusals
    }
}

/// A nats-server release: major, minor, patch.
type Release = (u64, u64, u64);

/// The flaws of a replicated (R>1) stream that break the lock, each with the nats-server
/// releases that have it (from the first, before the second, which fixed it), by the release
/// that fixed it, oldest first: the last names the release every server needs.
const REPLICATED_FLAWS: [(Release, Release, &str); 3] = [
    (
        (0, 0, 0),
        (2, 9, 21),
        "before 2.9.21 a replicated stream checks the expected revision only before it proposes a write, not when it applies it (nats-server#4319), so two compare-and-swaps at one revision can both win",
    ),
    (
        (0, 0, 0),
        (2, 10, 19),
        "before 2.10.19 a replicated stream does not check a create (expected revision 0) before it proposes it, so a replica can store a create the others refuse and the replicas then hold different records (nats-server#5794)",
    ),
    (
        (2, 10, 20),
        (2, 10, 23),
        "2.10.20 to 2.10.22 can forget a replicated stream after a few of its servers crash, even with sync_interval always (nats-server#6888), and the bucket, its sequence and the fencing tokens start over",
    ),
];

/// The flaws of [`REPLICATED_FLAWS`] a server of `version` has (none: the lock holds on its
/// replicated streams); `None` when the version does not parse, which says nothing of what the
/// server fixed.
fn replicated_compare_and_swap_flaws(version: &str) -> Option<Vec<&'static str>> {
    let parsed = semver::Version::parse(version.trim_start_matches('v')).ok()?;
    let release = (parsed.major, parsed.minor, parsed.patch);
    Some(
        REPLICATED_FLAWS
            .iter()
            .filter(|(from, fixed, _)| *from <= release && release < *fixed)
            .map(|(_, _, flaw)| *flaw)
            .collect(),
    )
}

/// The user (or token) and password in `url`, percent-decoded as a URL's user-info is (RFC
/// 3986): `+` and `&` are themselves, not a space and a separator as in form data, so that
/// generated passwords log in as written; `None` without a user.
///
/// # Errors
/// A user or password that is not UTF-8 once decoded, in a message that shows neither.
pub(crate) fn login_of(url: &url::Url) -> Result<Option<(String, Option<String>)>, String> {
    if url.username().is_empty() {
        return Ok(None);
    }
    let decode = |part: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8()
            .map(std::borrow::Cow::into_owned)
            .map_err(|_| "the user or password is not UTF-8 once percent-decoded".to_owned())
    };
    let password = url.password().map(decode).transpose()?;
    Ok(Some((decode(url.username())?, password)))
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
    fn replicated_streams_hold_from_2_10_23_and_an_unknown_version_is_not_taken_for_it() {
        for (version, flaws) in [
            ("2.9.10", Some(&["#4319", "#5794"][..])),
            ("v2.8.4", Some(&["#4319", "#5794"][..])),
            ("2.9.21", Some(&["#5794"][..])),
            ("2.9.25", Some(&["#5794"][..])),
            ("2.10.0", Some(&["#5794"][..])),
            ("2.10.0-beta.1", Some(&["#5794"][..])),
            ("2.10.18", Some(&["#5794"][..])),
            ("2.10.19", Some(&[][..])),
            ("2.10.19-RC.1", Some(&[][..])),
            ("2.10.20", Some(&["#6888"][..])),
            ("2.10.22", Some(&["#6888"][..])),
            ("2.10.23", Some(&[][..])),
            ("2.11.4", Some(&[][..])),
            ("", None),
            ("2.10", None),
            ("dev", None),
        ] {
            let found = replicated_compare_and_swap_flaws(version);
            assert_eq!(found.is_none(), flaws.is_none(), "{version}: {found:?}");
            if let (Some(found), Some(flaws)) = (found, flaws) {
                assert_eq!(found.len(), flaws.len(), "{version}: {found:?}");
                for (flaw, issue) in found.iter().zip(flaws) {
                    assert!(flaw.contains(issue), "{version}: {flaw}");
                }
            }
        }
    }

    /// A user-info is percent-encoded, not form data: `+` and `&` are themselves.
    #[test]
    fn logins_are_percent_decoded_as_user_info() {
        for (url, user, password) in [
            (
                "nats://app:p4ss+w0rd&x%2By%40z%25@h",
                "app",
                Some("p4ss+w0rd&x+y@z%"),
            ),
            ("nats://a%2Bb+c@h", "a+b+c", None),
            ("nats://u:%zz%4@h", "u", Some("%zz%4")),
            ("nats://u:%+1@h", "u", Some("%+1")),
            ("nats://%C3%BC:%C3%A9@h", "\u{fc}", Some("\u{e9}")),
        ] {
            let parsed = url::Url::parse(url).expect(url);
            assert_eq!(
                login_of(&parsed),
                Ok(Some((user.to_owned(), password.map(str::to_owned)))),
                "{url}"
            );
        }
        assert_eq!(
            login_of(&url::Url::parse("nats://h:4222").expect("url")),
            Ok(None)
        );
        let err = login_of(&url::Url::parse("nats://u:s3cret%FF@h").expect("url"))
            .expect_err("not UTF-8");
        assert!(
            err.contains("not UTF-8") && !err.contains("s3cret"),
            "{err}"
        );
    }

    #[test]
    fn reconnect_attempts_start_at_once_and_stay_at_most_a_second_apart() {
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(50));
        assert_eq!(reconnect_delay(3), Duration::from_millis(100));
        assert_eq!(reconnect_delay(6), Duration::from_millis(800));
        assert_eq!(reconnect_delay(7), MAX_RECONNECT_DELAY);
        let waits: Vec<Duration> = (1..10_000).map(reconnect_delay).collect();
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert_eq!(waits.last(), Some(&MAX_RECONNECT_DELAY));
        assert_eq!(reconnect_delay(usize::MAX), MAX_RECONNECT_DELAY);
    }
}
