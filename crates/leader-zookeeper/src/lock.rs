//! The lock: one election's two znodes under the prefix.
//!
//! Election `name` keeps a container znode `PREFIX/NAME` (the *election znode*), whose data is
//! the last fencing token given out (a decimal `u64`), and under it `PREFIX/NAME/holder` (the
//! *record znode*), the record as JSON. The record znode is ephemeral on the holder's session
//! while it names a holder, so a holder whose session ends (a crash, a partition longer than
//! the session timeout) is gone as soon as the ensemble expires it; a record with nobody
//! holding it (a release, which keeps a handover request) is persistent.
//!
//! Every acquisition writes the election znode in the same `multi` as the record znode, with
//! a compare-and-set on the election znode's version: the token is one more than the one
//! stored there, and a record znode deleted by an expiry never takes the count with it.
//! ZooKeeper's own counters are 32-bit (`cversion`, the sequence of a sequential znode) and
//! wrap; this one is 64-bit. An election znode that goes with its count (the ensemble removes
//! it once it holds no record znode, or an operator deletes it) is counted on from a zxid.
//!
//! A renewal is a `setData` of the record znode at its version, in a `multi` that checks that
//! the election znode has not moved: ZooKeeper moves a znode's version on every `setData`,
//! also of identical bytes (`PrepRequestProcessor`: the new version is the stored one plus
//! one, whatever the data), so every renewal moves the fence (S14). Anything else that changes
//! who holds the lease, or asks for a handover, writes the election znode too: followers watch
//! that znode alone (a persistent watch), which renewals never touch.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use leader_core::{ChangeStream, LeaderElectionRecord, LockError, Observed, ResourceLock, Version};
use zookeeper_client as zk;

use crate::error::{BACKEND, map};
use crate::store::ZooKeeperStore;

mod stored;

pub(crate) use stored::Stored;

/// The znode name of election `name`: letters, digits, `-` and `_` as they are, every other
/// byte (`.` and `/` included) as `=` and two hex digits, so that any name is one valid znode
/// name (never `.`, `..` or empty) and no two names share one. The empty name is `=`.
pub fn node_of(name: &str) -> String {
    if name.is_empty() {
        return "=".to_owned();
    }
    let mut node = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_') {
            node.push(char::from(byte));
        } else {
            node.push_str(&format!("={byte:02X}"));
        }
    }
    node
}

/// The record znode's name under the election znode.
const RECORD: &str = "holder";

/// The least a lease is kept below the granted session timeout: the ensemble's leader hears of
/// a session on a follower from that follower's pings alone, every half tick (1 s at
/// ZooKeeper's default `tickTime` of 2 s), with the time the report takes on the way. Below
/// the connection timeout of the shortest session the ensemble grants by default (1.6 s of 4 s).
const FOLLOWER_REPORT: Duration = Duration::from_millis(1500);

impl ZooKeeperStore {
    /// A lock on election `name` for candidate `identity`, on this store's session.
    pub fn lock(&self, name: impl Into<String>, identity: impl Into<String>) -> ZooKeeperLock {
        let name = name.into();
        let path = format!("{}/{}", self.prefix(), node_of(&name));
        ZooKeeperLock {
            store: self.clone(),
            record_path: format!("{path}/{RECORD}"),
            path,
            name,
            identity: identity.into(),
            highest: Arc::default(),
        }
    }
}

/// A [`ResourceLock`] on a ZooKeeper ensemble: the holder's record in a znode ephemeral on its
/// session, compare-and-set on znode versions for every write, 64-bit fencing tokens kept in
/// the election's own znode (they survive the record's deletion), and a persistent watch that
/// wakes followers when the holder changes, releases or is asked to hand over.
///
/// # Sessions and leases
/// A holder stops leading by its renew deadline after its last successful renewal (the
/// elector's timer), while the ensemble expires its session, and deletes its record, about the
/// session timeout after it last heard from it, and up to about a client ping interval sooner
/// (the ensemble's leader times sessions from its followers' reports). A lock therefore
/// refuses to hold a lease longer than the session timeout the ensemble granted less the
/// client's connection timeout ([`LockError::Misconfigured`]): with
/// `lease_duration > renew_deadline`, a holder cut off from the ensemble has stopped before its
/// record can vanish, as Curator's `ConnectionState.SUSPENDED` asks of its users. A server lost
/// while another answers keeps the term: the client moves the session at once. With no server
/// to reach, the client waits twice as long before each pass over them, so an outage of more
/// than a few seconds can outlast the renew deadline (see the crate's documentation).
/// Candidates otherwise wait out a holder's lease on their own monotonic clock, from when they
/// saw its last renewal, and take an expired lease over by deleting the old record and
/// creating their own in one `multi`.
#[derive(Clone, Debug)]
pub struct ZooKeeperLock {
    store: ZooKeeperStore,
    name: String,
    path: String,
    record_path: String,
    identity: String,
    /// The highest fencing token this lock object (and its clones) read or wrote: a floor for
    /// its acquisitions, should an operator delete the election znode and its count.
    highest: Arc<AtomicU64>,
}

/// What a read of an election's two znodes found: the election znode and the record znode,
/// each if there.
pub(crate) type Read = (Option<Election>, Option<(Vec<u8>, zk::Stat)>);

/// The election znode as read: its version and count, or absent.
pub(crate) struct Election {
    version: i32,
    count: u64,
}

impl ZooKeeperLock {
    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The election znode's path under the chroot.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The record znode's path under the chroot.
    pub fn record_path(&self) -> &str {
        &self.record_path
    }

    fn context(&self) -> String {
        format!("{} znode {}", self.store.describe(), self.path)
    }

    fn note(&self, token: u64) {
        self.highest.fetch_max(token, Ordering::Relaxed);
    }

    /// The next fencing token: above the count, `seed` and every token this lock object saw,
    /// and at least `asked`. Each token is at most the zxid of the write that gives it out
    /// (one more than a count, a seed or a token written or read before), which is what lets
    /// a zxid seed a count that was deleted (see [`create`](ResourceLock::create)).
    ///
    /// # Errors
    /// [`LockError::InvalidRecord`] when the floor is `u64::MAX`: no larger token exists, and
    /// handing out the same one again would let two terms share it.
    fn next_token(&self, count: u64, seed: u64, asked: u64) -> Result<u64, LockError> {
        let floor = count.max(seed).max(self.highest.load(Ordering::Relaxed));
        let Some(next) = floor.checked_add(1) else {
            return Err(LockError::invalid_record(
                BACKEND,
                format!(
                    "{}: the fencing tokens are used up (the count is {floor}): no acquisition can get a larger token",
                    self.context()
                ),
            ));
        };
        Ok(asked.max(next))
    }

    /// Reads both znodes in one request.
    async fn read(&self, client: &zk::Client) -> Result<Read, LockError> {
        let mut reader = client.new_multi_reader();
        self.add_reads(&mut reader)?;
        let results = match reader.commit().await {
            Ok(results) => results,
            Err(err) => return Err(self.store.fail(client, &self.context(), err).await),
        };
        self.take_read(&mut results.into_iter())
    }

    /// Adds the reads of both znodes to `reader`.
    pub(crate) fn add_reads(&self, reader: &mut zk::MultiReader<'_>) -> Result<(), LockError> {
        reader
            .add_get_data(&self.path)
            .and_then(|()| reader.add_get_data(&self.record_path))
            .map_err(|err| map(&self.context(), err))
    }

    /// Takes the answers to [`add_reads`](Self::add_reads) from `results`: both, whatever the
    /// first says, so that the answers of the elections read after it in one request stay
    /// theirs.
    pub(crate) fn take_read(
        &self,
        results: &mut impl Iterator<Item = zk::MultiReadResult>,
    ) -> Result<Read, LockError> {
        let (first, second) = (results.next(), results.next());
        let context = self.context();
        let election = match first {
            Some(zk::MultiReadResult::Data { data, stat }) => Some(Election {
                version: stat.version,
                count: count_of(&context, &data)?,
            }),
            Some(zk::MultiReadResult::Error {
                err: zk::Error::NoNode,
            }) => None,
            Some(zk::MultiReadResult::Error { err }) => return Err(map(&context, err)),
            other => return Err(unexpected(&context, &other)),
        };
        let record = match second {
            Some(zk::MultiReadResult::Data { data, stat }) => Some((data, stat)),
            Some(zk::MultiReadResult::Error {
                err: zk::Error::NoNode,
            }) => None,
            Some(zk::MultiReadResult::Error { err }) => return Err(map(&context, err)),
            other => return Err(unexpected(&context, &other)),
        };
        if let Some(election) = &election {
            self.note(election.count);
        }
        Ok((election, record))
    }

    /// The record a read found, if both znodes are there.
    pub(crate) fn observed_of(&self, read: Read) -> Result<Option<Observed>, LockError> {
        let (Some(election), Some((data, stat))) = read else {
            return Ok(None);
        };
        let record = LeaderElectionRecord::from_json(BACKEND, &self.record_path, &data)?;
        let stored = Stored {
            election: election.version,
            record: stat.version,
            owner: stat.ephemeral_owner,
            token: record.leader_transitions,
            count: election.count,
        };
        Ok(Some(self.observed(&record, stored)))
    }

    /// Whether writing `record` over `stored` continues the stored term: the record names this
    /// identity with the token stored, and the record znode is ephemeral on some session (a
    /// held term). Only this session's own term ([`renews`](Self::renews)) may be continued;
    /// a record znode of another session with this token is another process's term (S13).
    fn continues(stored: Stored, record: &LeaderElectionRecord, identity: &str) -> bool {
        record.is_held_by(identity)
            && record.leader_transitions == stored.token
            && stored.owner != 0
    }

    /// Whether writing `record` over `stored` renews this session's own term: the record names
    /// this identity with the token stored, and the record znode is this session's.
    pub(crate) fn renews(
        &self,
        client: &zk::Client,
        stored: Stored,
        record: &LeaderElectionRecord,
    ) -> bool {
        Self::continues(stored, record, &self.identity) && stored.owner == client.session_id().0
    }

    /// Adds a renewal to `writer`: the election znode checked at its version, the record
    /// znode's data set to `json` (the record, encoded) at its version (two operations).
    pub(crate) fn add_renewal(
        &self,
        writer: &mut zk::MultiWriter<'_>,
        stored: Stored,
        json: &[u8],
    ) -> Result<(), LockError> {
        writer
            .add_check_version(&self.path, stored.election)
            .and_then(|()| writer.add_set_data(&self.record_path, json, Some(stored.record)))
            .map_err(|err| map(&self.context(), err))
    }

    /// Renews `stored` with `record` in one `multi` of its own.
    async fn write_renewal(
        &self,
        client: &zk::Client,
        stored: Stored,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let mut writer = client.new_multi_writer();
        self.add_renewal(&mut writer, stored, &record.to_json())?;
        let results = self.commit(client, &mut writer).await?;
        let written = set_data_version(&self.context(), &results, 1)?;
        Ok(self.renewed(record, stored, written))
    }

    /// What a renewal of `stored` that left the record znode at version `written` stored.
    pub(crate) fn renewed(
        &self,
        record: &LeaderElectionRecord,
        stored: Stored,
        written: i32,
    ) -> Observed {
        self.observed(
            record,
            Stored {
                record: written,
                ..stored
            },
        )
    }

    /// Refuses a lease this session could outlive the ensemble's patience for (see the type's
    /// documentation), when `record` names this lock's identity.
    pub(crate) fn check_held_lease(
        &self,
        client: &zk::Client,
        record: &LeaderElectionRecord,
    ) -> Result<(), LockError> {
        if record.is_held_by(&self.identity) {
            return self.check_granted(client, record.lease_duration);
        }
        Ok(())
    }

    /// Refuses a lease longer than the granted session timeout less the client's connection
    /// timeout, and less [`FOLLOWER_REPORT`] at least. The ensemble's leader expires a session
    /// by what its followers report of it (every half tick), and the client pings only after
    /// 3/8 of its connection timeout without a request: a session can expire up to about a
    /// ping interval before "session timeout after the holder's last renewal", and a connection
    /// timeout covers that. A write a follower forwards does not touch the session at the
    /// leader (`ZooKeeperServer.touch` skips a request without a connection), so however short
    /// the connection timeout, the leader's last sight of the session may be a half tick old.
    fn check_granted(&self, client: &zk::Client, lease: Duration) -> Result<(), LockError> {
        let granted = client.session_timeout();
        let connection = self
            .store
            .connection_timeout_for(granted)
            .max(FOLLOWER_REPORT);
        let longest = granted.saturating_sub(connection);
        if lease > longest {
            return Err(LockError::Misconfigured {
                backend: BACKEND,
                message: format!(
                    "{}: a lease of {lease:?} is longer than the session timeout the ensemble granted ({granted:?}) less the connection timeout ({connection:?}, at least {FOLLOWER_REPORT:?}), {longest:?}: the ensemble could expire the session, and delete the record, while its holder still leads; ask for a longer session (session_timeout=, up to the servers' maxSessionTimeout, 20 ticks by default) or shorten the lease",
                    self.context(),
                ),
            });
        }
        Ok(())
    }

    /// How the record znode is created for `record`: ephemeral on this session when it names
    /// this lock's identity, persistent otherwise.
    fn mode(&self, record: &LeaderElectionRecord) -> zk::CreateMode {
        if record.is_held_by(&self.identity) {
            zk::CreateMode::Ephemeral
        } else {
            zk::CreateMode::Persistent
        }
    }

    /// Commits `writer`, mapping a lost compare-and-set to a conflict.
    async fn commit(
        &self,
        client: &zk::Client,
        writer: &mut zk::MultiWriter<'_>,
    ) -> Result<Vec<zk::MultiWriteResult>, LockError> {
        match writer.commit().await {
            Ok(results) => Ok(results),
            Err(err) => Err(self.store.fail(client, &self.context(), err.into()).await),
        }
    }

    /// Replaces the record znode (delete at `stored`'s version, create anew, as
    /// [`mode`](Self::mode) says) and sets the count to `count`, in one `multi`.
    async fn replace(
        &self,
        client: &zk::Client,
        stored: Stored,
        count: u64,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let context = self.context();
        let mode = self.mode(record);
        let options = mode.with_acls(self.store.acls());
        let json = record.to_json();
        let mut writer = client.new_multi_writer();
        writer
            .add_delete(&self.record_path, Some(stored.record))
            .and_then(|()| {
                writer.add_set_data(
                    &self.path,
                    count.to_string().as_bytes(),
                    Some(stored.election),
                )
            })
            .and_then(|()| writer.add_create(&self.record_path, &json, &options))
            .map_err(|err| map(&context, err))?;
        let results = self.commit(client, &mut writer).await?;
        let election = set_data_version(&context, &results, 1)?;
        self.note(count);
        Ok(self.observed(
            record,
            Stored {
                election,
                record: 0,
                owner: owner_of(client, mode),
                token: record.leader_transitions,
                count,
            },
        ))
    }

    fn observed(&self, record: &LeaderElectionRecord, stored: Stored) -> Observed {
        self.note(record.leader_transitions);
        Observed {
            record: record.clone(),
            version: stored.version(),
        }
    }
}

/// The count in the election znode's data: a decimal `u64`, or nothing (0).
fn count_of(context: &str, data: &[u8]) -> Result<u64, LockError> {
    if data.is_empty() {
        return Ok(0);
    }
    std::str::from_utf8(data)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .ok_or_else(|| {
            LockError::invalid_record(
                BACKEND,
                format!("{context}: the election znode holds {} bytes that are not a fencing token count", data.len()),
            )
        })
}

/// The ephemeral owner of a znode this session creates in `mode`.
fn owner_of(client: &zk::Client, mode: zk::CreateMode) -> i64 {
    match mode {
        zk::CreateMode::Ephemeral => client.session_id().0,
        _ => 0,
    }
}

/// The version a `setData` at `index` of a committed `multi` left.
pub(crate) fn set_data_version(
    context: &str,
    results: &[zk::MultiWriteResult],
    index: usize,
) -> Result<i32, LockError> {
    match results.get(index) {
        Some(zk::MultiWriteResult::SetData { stat }) => Ok(stat.version),
        other => Err(unexpected(context, &other)),
    }
}

fn unexpected(context: &str, what: &dyn std::fmt::Debug) -> LockError {
    LockError::other(
        BACKEND,
        crate::error::Context::new(context, &format!("unexpected answer: {what:?}")),
    )
}

#[async_trait]
impl ResourceLock for ZooKeeperLock {
    async fn get(&self) -> Result<Option<Observed>, LockError> {
        let client = self.store.client().await?;
        let read = self.read(&client).await?;
        self.observed_of(read)
    }

    /// Creates the record znode where there is none (never written, or its holder's session
    /// ended), with a token one more than the election znode's count (and every token this
    /// lock object saw), and the count raised to it, in one `multi`.
    async fn create(&self, record: &LeaderElectionRecord) -> Result<Observed, LockError> {
        let client = self.store.client().await?;
        self.check_held_lease(&client, record)?;
        let (election, existing) = self.read(&client).await?;
        if existing.is_some() {
            return Err(LockError::conflict(BACKEND));
        }
        let context = self.context();
        let seed = match &election {
            Some(_) => 0,
            // The first of this election, or the first since its znode went (reaped as an
            // empty container, or deleted by an operator) with its count. The prefix's pzxid
            // is the zxid of the last creation or deletion under it, that deletion's or later,
            // so it is above every token the election gave out (see `next_token`). The prefix
            // may be gone too, which would fail every creation as if another had won it.
            None => {
                self.store.sync(&client).await?;
                let prefix = self.store.ensure_prefix(&client).await?;
                u64::try_from(prefix.pzxid).unwrap_or(0)
            }
        };
        let token = self.next_token(
            election.as_ref().map_or(0, |e| e.count),
            seed,
            record.leader_transitions,
        )?;
        let record = {
            let mut record = record.clone();
            record.leader_transitions = token;
            record
        };
        let mode = self.mode(&record);
        let record_options = mode.with_acls(self.store.acls());
        // A container: the ensemble deletes it once it has no record znode (its holder's
        // session ended and nobody took it since), so elections of past members and shards do
        // not pile up; the count it takes along is seeded again from a zxid.
        let election_options = zk::CreateMode::Container.with_acls(self.store.acls());
        let json = record.to_json();
        let count = token.to_string();
        let mut writer = client.new_multi_writer();
        match &election {
            Some(election) => {
                writer.add_set_data(&self.path, count.as_bytes(), Some(election.version))
            }
            None => writer.add_create(&self.path, count.as_bytes(), &election_options),
        }
        .and_then(|()| writer.add_create(&self.record_path, &json, &record_options))
        .map_err(|err| map(&context, err))?;
        let results = self.commit(&client, &mut writer).await?;
        let election = match &election {
            Some(_) => set_data_version(&context, &results, 0)?,
            None => 0,
        };
        Ok(self.observed(
            &record,
            Stored {
                election,
                record: 0,
                owner: owner_of(&client, mode),
                token,
                count: token,
            },
        ))
    }

    /// Writes `record` over `version`, in one `multi`:
    /// - the holder renewing its term (same token, the record znode its session's): the record
    ///   znode's data, the election znode checked, not written;
    /// - this identity taking the lease (any other write naming it): the old record znode
    ///   deleted and one ephemeral on this session created, the count raised to the new token;
    /// - a release (nobody holding): the record znode replaced by a persistent one;
    /// - a write naming another holder (a handover request on its behalf): the record znode's
    ///   data, its owner (and so the holder's lease) unchanged, the election znode rewritten so
    ///   that the watches fire.
    async fn update(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let stored = Stored::expected(version)?;
        let client = self.store.client().await?;
        self.check_held_lease(&client, record)?;
        let context = self.context();
        if record.is_held_by(&self.identity) {
            if self.renews(&client, stored, record) {
                return self.write_renewal(&client, stored, record).await;
            }
            // The stored term with its token, on another session: as `renew` answers it.
            if Self::continues(stored, record, &self.identity) {
                return Err(LockError::conflict(BACKEND));
            }
            let token = self.next_token(stored.count, 0, record.leader_transitions)?;
            let record = {
                let mut record = record.clone();
                record.leader_transitions = token;
                record
            };
            return self.replace(&client, stored, token, &record).await;
        }
        let count = stored.count.max(record.leader_transitions);
        if record.is_free() {
            return self.replace(&client, stored, count, record).await;
        }
        let mut writer = client.new_multi_writer();
        writer
            .add_set_data(
                &self.path,
                count.to_string().as_bytes(),
                Some(stored.election),
            )
            .and_then(|()| {
                writer.add_set_data(&self.record_path, &record.to_json(), Some(stored.record))
            })
            .map_err(|err| map(&context, err))?;
        let results = self.commit(&client, &mut writer).await?;
        let election = set_data_version(&context, &results, 0)?;
        let written = set_data_version(&context, &results, 1)?;
        Ok(self.observed(
            record,
            Stored {
                election,
                record: written,
                owner: stored.owner,
                token: record.leader_transitions,
                count,
            },
        ))
    }

    /// Renews this session's own term, in one `multi`; anything else is a conflict (a renewal
    /// never starts a term: a record znode another session owns, or another token, is not
    /// this term's).
    async fn renew(
        &self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Result<Observed, LockError> {
        let stored = Stored::expected(version)?;
        let client = self.store.client().await?;
        if !self.renews(&client, stored, record) {
            return Err(LockError::conflict(BACKEND));
        }
        self.check_held_lease(&client, record)?;
        self.write_renewal(&client, stored, record).await
    }

    /// Refuses a lease longer than the session timeout the ensemble granted less the client's
    /// connection timeout.
    async fn check_lease(&self, lease_duration: Duration) -> Result<(), LockError> {
        let client = self.store.client().await?;
        self.check_granted(&client, lease_duration)
    }

    fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self) -> String {
        format!("zookeeper:{}{}", self.store.describe(), self.path)
    }

    fn election_name(&self) -> Option<&str> {
        Some(&self.name)
    }

    /// A persistent watch of the election znode (ZooKeeper 3.6 and later): it fires when the
    /// record znode is created or deleted (an acquisition, a takeover, a release, an expired
    /// session) and when the election znode is written (a handover request), never for a
    /// renewal. It ends with the session, and when the session is back after a lost
    /// connection: the server dropped the watch with the connection, the client does not set
    /// persistent watches again (zookeeper-client 0.11's `resend_watches` sends none), and
    /// ZooKeeper may drop events that happen while a client is away (ZOOKEEPER-4698), so the
    /// elector subscribes again and reads the record on its next attempt.
    async fn watch(&self) -> Result<Option<ChangeStream>, LockError> {
        let client = self.store.client().await?;
        let watcher = match client.watch(&self.path, zk::AddWatchMode::Persistent).await {
            Ok(watcher) => watcher,
            Err(err) => return Err(self.store.fail(&client, &self.context(), err).await),
        };
        let stream = futures_util::stream::unfold(Some(watcher), |watcher| async move {
            let mut watcher = watcher?;
            loop {
                let event = watcher.changed().await;
                if event.event_type != zk::EventType::Session {
                    return Some(((), Some(watcher)));
                }
                // Nothing comes while the connection is lost; the session's end (after which
                // the client panics on a wait) or its return ends the stream.
                if event.session_state != zk::SessionState::Disconnected {
                    return None;
                }
            }
        });
        Ok(Some(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_valid_and_distinct() {
        let names = [
            "app",
            "app.v1",
            "app=2Ev1",
            "a b",
            "",
            "=",
            ".",
            "..",
            "a/b",
            "ü",
            "zookeeper",
        ];
        let nodes: Vec<String> = names.iter().map(|name| node_of(name)).collect();
        for (name, node) in names.iter().zip(&nodes) {
            assert!(!node.is_empty() && node != "." && node != "..", "{name:?}");
            assert!(
                node.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'=')),
                "{name:?} -> {node:?}"
            );
        }
        let distinct: std::collections::HashSet<&String> = nodes.iter().collect();
        assert_eq!(distinct.len(), nodes.len(), "{nodes:?}");
        assert_eq!(node_of("a/b"), "a=2Fb");
    }
}
