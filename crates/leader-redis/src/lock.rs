//! The lock: one election's hash, fence counter and release channel on a [`RedisStore`].

use std::time::Duration;

use async_trait::async_trait;
use leader_core::{
    Acquisition, ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version,
};

use crate::error::{BACKEND, map};
use crate::scripts::{self, LuaScript};
use crate::store::{Lane, RedisStore};

/// What follows `PREFIX{NAME}` in each key of an election, in the order of [`keys`]. The braces
/// are a Redis Cluster hash tag: every key of one election is in one slot.
const SUFFIXES: [&str; 4] = ["", ":fence", ":extensions", ":released"];

/// The keys of election `name`: the hash, the fence counter, the kept extensions, and the
/// release channel.
pub(crate) fn keys(prefix: &str, name: &str) -> [String; 4] {
    first_keys(prefix, name)
}

/// The first `N` of [`keys`], and only those: a shard set's round asks for thousands (the hash
/// alone for a renewal, three for a read), each made in one allocation of its exact length.
pub(crate) fn first_keys<const N: usize>(prefix: &str, name: &str) -> [String; N] {
    const { assert!(N <= SUFFIXES.len()) };
    std::array::from_fn(|i| {
        let suffix = SUFFIXES[i];
        let mut key = String::with_capacity(prefix.len() + name.len() + 2 + suffix.len());
        key.push_str(prefix);
        key.push('{');
        key.push_str(name);
        key.push('}');
        key.push_str(suffix);
        key
    })
}

impl RedisStore {
    /// A lock on election `name` for candidate `identity`.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> RedisLock {
        let name = name.into();
        let [key, fence, extensions, channel] = keys(&self.inner.prefix, &name);
        RedisLock {
            store: self.clone(),
            key,
            fence,
            extensions,
            channel,
            name,
            identity: identity.into(),
        }
    }
}

/// Runs `script` with `keys` and `args` on the connection of `lane`: `EVALSHA`, and `EVAL` (which also caches the script)
/// only when the server answers `NOSCRIPT`, as after a restart.
pub(crate) async fn eval<T: redis::FromRedisValue>(
    store: &RedisStore,
    lane: Lane,
    script: &LuaScript,
    keys: &[&str],
    args: &[&[u8]],
    context: impl Fn() -> String,
) -> Result<T, LockError> {
    let command = |verb: &str, body: &str| {
        let mut command = redis::cmd(verb);
        command.arg(body).arg(keys.len()).arg(keys);
        for arg in args {
            command.arg(*arg);
        }
        command
    };
    let mut result = store.query(lane, &command("EVALSHA", &script.sha)).await;
    // A connection found broken (the server was away: restarted, cut off) is made again by
    // the connection manager, which this request only started: sent once more, it goes on the
    // new connection, so the first request after an outage is not a failure that costs the
    // elector a whole back-off. Every script is a compare-and-swap or a read, so a second
    // send of one whose answer was lost changes nothing twice. A request that timed out is not
    // sent again: it may still run on a slow server, and its copy would then find the
    // lease already taken by this candidate (and report another process with its identity).
    if let Err(err) = &result
        && (err.is_connection_dropped() || err.is_io_error())
        && !err.is_timeout()
    {
        result = store.query(lane, &command("EVALSHA", &script.sha)).await;
    }
    if let Err(err) = &result
        && err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
    {
        result = store.query(lane, &command("EVAL", &script.source)).await;
    }
    result.map_err(|err| {
        if err.kind() == redis::ErrorKind::AuthenticationFailed
            || matches!(err.code(), Some("WRONGPASS" | "NOAUTH"))
        {
            store.renew_connection();
        }
        map(&context(), err)
    })
}

/// A stored record from its fields; the fields are authoritative for holder and token.
pub(crate) fn decode(
    context: impl std::fmt::Display + Copy,
    version: String,
    holder: String,
    transitions: i64,
    json: &str,
) -> Result<Observed, LockError> {
    let mut record = LeaderElectionRecord::from_json(BACKEND, context, json.as_bytes())?;
    record.holder_identity = holder;
    record.leader_transitions = u64::try_from(transitions).map_err(|_| {
        LockError::invalid_record(BACKEND, format!("{context}: negative fencing token"))
    })?;
    Ok(Observed {
        record,
        version: Version::new(version),
    })
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
    /// The record's extensions as last written, without expiry.
    extensions: String,
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

    /// The key that keeps the record's extensions when the hash expires with its holder.
    pub fn extensions_key(&self) -> &str {
        &self.extensions
    }

    fn context(&self) -> String {
        format!("{} key {}", self.store.inner.redacted, self.key)
    }

    /// Runs `script` with the election's three keys and `args`.
    async fn run<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        args: &[&[u8]],
    ) -> Result<T, LockError> {
        let keys = [self.key.as_str(), &self.fence, &self.extensions];
        eval(&self.store, Lane::Main, script, &keys, args, || {
            self.context()
        })
        .await
    }

    /// At a term's start (`taken` was just acquired): checks again that the server does not
    /// evict keys, since `CONFIG SET` changes that on a running server (S15). When it does,
    /// the lease is released at once and the term never starts.
    async fn check_store(&self, taken: &Observed) -> Result<(), LockError> {
        let checked = self.store.check_eviction().await;
        leader_core::backend::refuse_at_term_start(self, taken, checked).await
    }

    /// A stored record from its fields; the fields are authoritative for holder and token.
    fn decode(
        &self,
        version: String,
        holder: String,
        transitions: i64,
        json: &str,
    ) -> Result<Observed, LockError> {
        decode(&self.context(), version, holder, transitions, json)
    }
}

fn lease_ms(record: &LeaderElectionRecord) -> u64 {
    // A free record still expires, so released elections do not linger.
    u64::try_from(record.lease_duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The pending handover's candidate, or nothing, for the hash's `preferred` field.
fn preferred(record: &LeaderElectionRecord) -> &[u8] {
    record.handover_to().unwrap_or_default().as_bytes()
}

/// The highest fencing token the lock gives: the scripts count in Lua's numbers, which are
/// doubles, exact up to 2^53 (S5 allows a store a narrower counter, said where it is chosen).
pub const MAX_TOKEN: u64 = (1 << 53) - 1;

/// `record` as the hash's `record` field keeps it: without its fencing token, which is the
/// hash's `transitions` field (the scripts re-encode the JSON with Lua's 14 digits, which would
/// turn a token of 10^14 or more into a number no reader takes), refused above [`MAX_TOKEN`].
fn stored_json(record: &LeaderElectionRecord, context: &str) -> Result<Vec<u8>, LockError> {
    if record.leader_transitions > MAX_TOKEN {
        return Err(LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: fencing token {} is above {MAX_TOKEN}, the highest the Redis lock \
                 counts to (Lua's numbers are exact up to 2^53); use a lower fencing-token floor",
                record.leader_transitions
            ),
        });
    }
    let mut stored = record.clone();
    stored.leader_transitions = 0;
    Ok(stored.to_json())
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
        let (version, transitions, json): (String, u64, String) = self
            .run(
                &scripts::CREATE,
                &[
                    &stored_json(record, &self.context())?,
                    record.holder_identity.as_bytes(),
                    record.leader_transitions.to_string().as_bytes(),
                    lease_ms(record).to_string().as_bytes(),
                    first_version().as_bytes(),
                    preferred(record),
                ],
            )
            .await?;
        // The record as written: with the extensions an expired hash left, if any.
        let extensions =
            LeaderElectionRecord::from_json(BACKEND, self.context(), json.as_bytes())?.extensions;
        let created = Observed {
            record: {
                let mut record = record.clone();
                record.leader_transitions = transitions;
                record.extensions = extensions;
                record
            },
            version: Version::new(version),
        };
        if record.is_held_by(&self.identity) {
            self.check_store(&created).await?;
        }
        Ok(created)
    }

    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        // A write naming another holder is on its behalf (a handover request).
        let on_behalf = !record.is_free() && record.holder_identity != self.identity;
        let (version, transitions): (String, u64) = self
            .run(
                &scripts::UPDATE,
                &[
                    version.as_str().as_bytes(),
                    &stored_json(record, &self.context())?,
                    record.holder_identity.as_bytes(),
                    record.leader_transitions.to_string().as_bytes(),
                    lease_ms(record).to_string().as_bytes(),
                    self.channel.as_bytes(),
                    preferred(record),
                    if on_behalf { b"1" } else { b"0" },
                ],
            )
            .await?;
        Ok(Observed {
            record: {
                let mut record = record.clone();
                record.leader_transitions = transitions;
                record
            },
            version: Version::new(version),
        })
    }

    /// One script that extends the hash's expiry if it still holds `version`: the record, its
    /// `renew_time` and its version stay as stored.
    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let _: i64 = self
            .run(
                &scripts::RENEW,
                &[
                    version.as_str().as_bytes(),
                    lease_ms(record).to_string().as_bytes(),
                ],
            )
            .await?;
        Ok(Observed {
            record: record.clone(),
            version: version.clone(),
        })
    }

    /// The hash's `PTTL` while someone holds it.
    async fn time_left(&self) -> Result<Option<Duration>, LockError> {
        let left: i64 = self.run(&scripts::TIME_LEFT, &[]).await?;
        Ok(u64::try_from(left).ok().map(Duration::from_millis))
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("redis:{}", self.key)
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
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
                    // Without extensions: a new object has none, a takeover keeps the stored.
                    // The token is the fence's (the floor goes below).
                    &stored_json(
                        &{
                            let mut record = desired.clone();
                            record.extensions = Default::default();
                            record
                        },
                        &self.context(),
                    )?,
                    desired.holder_identity.as_bytes(),
                    lease_ms(desired).to_string().as_bytes(),
                    first_version().as_bytes(),
                    desired.leader_transitions.to_string().as_bytes(),
                ],
            )
            .await?;
        let observed = self.decode(version, holder, transitions, &json)?;
        Ok(Some(if acquired {
            self.check_store(&observed).await?;
            Acquisition::Acquired(observed)
        } else {
            Acquisition::Held {
                // A holder's hash expires unless it renews; one without a TTL (written by
                // another client) is left to the candidates' own clocks.
                renewed_in_store: left_ms >= 0 && !observed.record.is_free(),
                observed,
                // PTTL: -1 no expiry, -2 no key; neither tells a time to wait for.
                expires_in: u64::try_from(left_ms).ok().map(Duration::from_millis),
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key of an election carries the same hash tag, and a set's round asks for the
    /// first of them only.
    #[test]
    fn an_elections_keys_share_one_hash_tag() {
        assert_eq!(
            keys("leader:", "jobs"),
            [
                "leader:{jobs}",
                "leader:{jobs}:fence",
                "leader:{jobs}:extensions",
                "leader:{jobs}:released"
            ]
        );
        assert_eq!(first_keys::<1>("p", "a"), ["p{a}"]);
        assert_eq!(
            first_keys::<3>("", "s-1"),
            ["{s-1}", "{s-1}:fence", "{s-1}:extensions"]
        );
    }
}
