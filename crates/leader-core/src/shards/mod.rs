//! Work split across replicas (S12): K shards, each an election of its own, spread evenly
//! over the replicas that run the same shard set.
//!
//! Every shard is a record of its own with its own fencing token, kept as the elector keeps its
//! one record: a shard is taken only when free or expired (S2), its term ends by a timer at the
//! start of its last successful renewal plus the renew deadline (S3), each acquisition raises
//! its token (S5), and its work stops before it is released (S6). Beside the shards the store
//! holds a roster (the shard count and the members) and one record per member, which the
//! member holds as a lease: the roster says who takes part, the member records who is alive.
//!
//! Each member renews its member record and all its shards in one batch per retry period
//! ([`LockSet::renew_many`]) and reads the roster, the member records and the shards in
//! another ([`LockSet::get_changed`], passing the version it last read of each shard, so that
//! a store whose renewals keep the version sends only what changed); once a read finds the
//! set balanced and nothing to do, the
//! member reads the shards only once per half a lease, or as soon as the live members or its
//! own shards change. From what it reads it computes every member's fair share
//! (the shard count divided by the live members, one more for some), the same on every member:
//! a member under its share takes free or expired shards (those it likes best first, by
//! rendezvous hashing), a member over its share hands its surplus to the members under theirs
//! by a planned handover (S10), and the shards of a member that died are taken once their
//! lease runs out. Balance and the roster rest on what members read; safety rests on each
//! shard's lease alone, so a member with a stale view can be slow to balance, never a second
//! owner.
//!
//! A shard whose work gives it up (its term's [`Leadership::step_down`], or work of
//! [`Shards::run_per_shard`] that returns or panics) is released, and the member that gave it
//! up takes it again only after a back-off, as Kubernetes's CrashLoopBackOff restarts a
//! container: the jittered retry period at first, doubling with each give-up that follows the
//! previous one within ten minutes, up to five minutes; a term that ran ten minutes before
//! its give-up starts the back-off over. Meanwhile any other member may take the shard, and
//! the member says so in a warning naming the shard, how many times in a row and the wait.
//!
//! A member's identity that outlives its process (static membership,
//! [`ShardsBuilder::static_membership`]) keeps its shards across a restart: released on
//! shutdown reserved for that identity, taken back by the process that starts with it within
//! the window ([`ShardsBuilder::static_membership_window`], a lease unless set). The count
//! lives in the roster; [`resize_shard_set`] changes it while the set runs, and every member
//! follows on its next read and tells its work ([`Shards::subscribe_count`]).
//!
//! A record of the set that cannot be read (garbage, a refusal) is reported and left alone
//! (S8): the member reads the records one by one, as [`ShardSetView`] does, and the rest of
//! the set goes on.
//!
//! [`ShardSetView`] reads a whole set (the count, the members and their last renewals, each
//! shard's owner, fencing token and since when, the shards nobody owns) without taking part:
//! what `leader status` shows of a set.

pub(crate) mod assign;
mod locks;
mod roster;
mod runner;
mod view;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::Timings;
use crate::error::ConfigError;
use crate::leadership::{Leadership, StepDown};
use crate::status::IdentityConflict;

pub use locks::{
    KeyedLocks, Known, LockCache, LockSet, Renewal, RenewedAndRead, Reread, common_prefix,
};
pub use roster::{RosterError, drain_member, resize_shard_set};
pub use view::{MemberView, RecordState, RecordView, ShardSetView, ShardSetViewError, ShardView};

/// The most shards a set may have.
pub const MAX_SHARDS: u32 = 100_000;

/// The longest [`ShardsBuilder::static_membership_window`]: a day.
pub const MAX_STATIC_MEMBERSHIP_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// The key of the roster record of shard set `name`: the shard count and the members.
pub fn roster_key(name: &str) -> String {
    format!("{name}-members")
}

/// The key of the record of shard `shard` of set `name`.
pub fn shard_key(name: &str, shard: u32) -> String {
    format!("{name}-shard-{shard}")
}

/// The key of the member record of `identity` in set `name` (a hash of the identity, so that
/// any identity makes a valid key on every backend).
pub fn member_key(name: &str, identity: &str) -> String {
    format!("{name}-member-{}", assign::hash_hex(identity))
}

/// The roster's extension holding the shard count.
pub const COUNT_EXTENSION: &str = "shards.count";

/// The shard count a roster record holds, from 1 to [`MAX_SHARDS`]; anything else is
/// [`ShardsError::InvalidRoster`] (a record written by something else).
pub(crate) fn stored_count(
    name: &str,
    roster: &crate::LeaderElectionRecord,
) -> Result<u32, ShardsError> {
    let value = roster.extensions.get(COUNT_EXTENSION);
    value
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|&c| c > 0 && c <= MAX_SHARDS)
        .ok_or_else(|| ShardsError::InvalidRoster {
            name: name.to_owned(),
            roster: roster_key(name),
            value: value.cloned(),
        })
}

/// Whether `identity` looks like the name of a Pod that a ReplicaSet (a Deployment's) made:
/// `NAME-HASH-SUFFIX`, the pod template's hash of 5 to 10 and a random suffix of 5 lowercase
/// letters and digits. Such a name changes on every restart, so static membership under it
/// keeps nothing.
pub(crate) fn looks_like_replica_set_pod(identity: &str) -> bool {
    let lower_alphanumeric = |part: &str| {
        part.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    };
    let mut parts = identity.rsplitn(3, '-');
    let (Some(suffix), Some(hash), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    suffix.len() == 5
        && lower_alphanumeric(suffix)
        && (5..=10).contains(&hash.len())
        && lower_alphanumeric(hash)
        && name
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// The member record's extension holding the member's weight, when not 1.
pub(crate) const WEIGHT_EXTENSION: &str = "shards.weight";

/// The member record's extension naming the process that holds it (a random number drawn at
/// its start), under static membership: what a newer process of the same identity fences.
pub(crate) const INCARNATION_EXTENSION: &str = "shards.incarnation";

/// The member record's extension a newer process of the member's identity writes, under static
/// membership, naming the incarnation it fences: that process hands its shards over and stops.
pub(crate) const FENCED_EXTENSION: &str = "shards.fenced";

/// The prefix of the roster's extensions naming a drained member: `drain.KEY` = identity, `KEY`
/// the member record's key.
pub(crate) const DRAIN_PREFIX: &str = "drain.";

/// The members a roster drains, by identity.
pub(crate) fn drained(roster: &crate::LeaderElectionRecord) -> std::collections::BTreeSet<&str> {
    roster
        .extensions
        .iter()
        .filter(|(k, _)| k.starts_with(DRAIN_PREFIX))
        .map(|(_, identity)| identity.as_str())
        .collect()
}

/// The weight a member record holds (1 unless it says otherwise).
pub(crate) fn weight_in(record: &crate::LeaderElectionRecord) -> u32 {
    record
        .extensions
        .get(WEIGHT_EXTENSION)
        .and_then(|w| w.parse().ok())
        .unwrap_or(1)
}

/// The prefix of the roster's extensions naming a member: `member.KEY` = identity, `KEY` the
/// member record's key.
pub(crate) const MEMBER_PREFIX: &str = "member.";

/// The prefix of the roster's extensions holding a static member's window: `window.KEY` = the
/// window in milliseconds, `KEY` the member record's key. The others keep the shards of a
/// member found gone without leaving (a crash) for it for that long.
pub(crate) const WINDOW_PREFIX: &str = "window.";

/// The static membership windows a roster holds, by member record key; a value that is not a
/// number of milliseconds is ignored, a longer one than [`MAX_STATIC_MEMBERSHIP_WINDOW`] cut to
/// it.
pub(crate) fn windows(roster: &crate::LeaderElectionRecord) -> BTreeMap<&str, Duration> {
    roster
        .extensions
        .iter()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix(WINDOW_PREFIX)?;
            let window = Duration::from_millis(v.parse().ok()?);
            Some((key, window.min(MAX_STATIC_MEMBERSHIP_WINDOW)))
        })
        .collect()
}

/// Why a shard set takes no shards.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShardsError {
    /// The store's roster says another shard count than this replica was started with:
    /// replicas of one set agree on it. A set is resized while it runs with
    /// [`resize_shard_set`] (`leader shards resize`), whose count running members follow; a replica started
    /// afterwards needs the new count.
    #[error(
        "shard set {name:?}: the store holds {stored} shards and this replica was started with \
         {ours}; every replica of a set needs the same count (start it with {stored}, or resize \
         the set with `leader shards resize --lock URL --name {name} {ours}`; roster record \
         {roster:?})"
    )]
    CountMismatch {
        /// The set's name.
        name: String,
        /// The count in the store.
        stored: u32,
        /// This replica's count.
        ours: u32,
        /// The roster's key.
        roster: String,
    },
    /// The roster record holds no valid count: written by something else.
    #[error(
        "shard set {name:?}: the roster record {roster:?} holds no valid shard count ({value:?})"
    )]
    InvalidRoster {
        /// The set's name.
        name: String,
        /// The roster's key.
        roster: String,
        /// What it holds as the count, if anything.
        value: Option<String>,
    },
    /// Another process holds this replica's member record under the same identity (S13): it
    /// takes no shard while that process lives.
    #[error(transparent)]
    IdentityConflict(IdentityConflict),
    /// Under static membership, a newer process started with this member's identity fenced
    /// this one (as Kafka fences the older consumer of a `group.instance.id`): it stopped its
    /// work and handed its shards to the newer process, which takes them at once. Each
    /// identity of a set is one process; a supervisor that starts this one again makes it the
    /// newer one, which fences the other in turn.
    #[error(
        "shard set {name:?}: another process started with this member's identity {identity:?} \
         (static membership) and fenced this one: its shards are handed to that process, and \
         this one stops; run each identity of a set once"
    )]
    Fenced {
        /// The set's name.
        name: String,
        /// The identity both processes run with.
        identity: String,
    },
    /// The store does not keep a lease of the set's duration
    /// ([`ResourceLock::check_lease`](crate::ResourceLock::check_lease)): the member does not
    /// join.
    #[error("shard set {name:?}: {message}")]
    LeaseNotKept {
        /// The set's name.
        name: String,
        /// What the store said.
        message: String,
    },
}

/// What a member knows about its shard set, published on [`Shards::subscribe`].
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ShardsState {
    /// The shards this member owns, each with its term. The copies here do not keep the
    /// shard's work running; take a clone while the work runs.
    pub owned: BTreeMap<u32, Leadership>,
    /// The members alive as last read, this one included once it holds its member record.
    pub members: usize,
    /// Why this member takes no shards, if it takes none for a reason.
    pub problem: Option<ShardsError>,
    /// True once the set has stopped.
    pub stopped: bool,
}

impl ShardsState {
    /// The fencing token of each shard owned.
    pub fn tokens(&self) -> BTreeMap<u32, u64> {
        self.owned
            .iter()
            .filter(|(_, l)| !l.is_lost())
            .map(|(&s, l)| (s, l.fencing_token()))
            .collect()
    }
}

type Started = dyn Fn(u32, Leadership) + Send + Sync;
pub(crate) type Stopped = dyn Fn(u32, StepDown) + Send + Sync;

/// Callbacks of a shard set.
#[derive(Clone, Default)]
pub(crate) struct Callbacks {
    pub(crate) started: Option<Arc<Started>>,
    pub(crate) stopped: Option<Arc<Stopped>>,
}

/// The configuration of a shard set, as validated by [`ShardsBuilder::build`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ShardsConfig {
    /// The set's name: the prefix of its keys, and the label of its metrics.
    pub name: String,
    /// The number of shards.
    pub count: u32,
    /// Each shard's lease: its timings (a round every retry period), request timeout (a batch
    /// counts as one), stop grace (work still running then keeps the shard unreleased, to
    /// expire after its lease), release on shutdown, token floor and wall clock, with the
    /// elector's defaults.
    pub lease: crate::LeaseConfig,
    /// This member's identity outlives its process (static membership): on shutdown its shards
    /// are released reserved for that identity, so that a process that comes back with it
    /// within [`static_membership_window`](Self::static_membership_window) takes them again
    /// and nobody else does meanwhile.
    pub static_membership: bool,
    /// How long the shards of a member that shut down under static membership wait for its
    /// identity to come back before the others take them (default: the lease).
    pub static_membership_window: Duration,
    /// This member's weight: its share of the shards is in proportion to it (default 1; 0
    /// takes none).
    pub weight: u32,
}

/// Builds [`Shards`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct ShardsBuilder {
    name: String,
    lease: crate::config::LeaseSettings,
    static_membership: bool,
    static_membership_window: Option<Duration>,
    weight: u32,
    locks: Arc<dyn LockSet>,
    callbacks: Callbacks,
    count: watch::Sender<u32>,
}

impl fmt::Debug for ShardsBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardsBuilder")
            .field("name", &self.name)
            .field("count", &*self.count.borrow())
            .field("lease", &self.lease)
            .field("locks", &self.locks)
            .finish_non_exhaustive()
    }
}

impl ShardsBuilder {
    /// Sets the lease, the renew deadline and the retry period at once.
    pub fn timings(mut self, timings: Timings) -> Self {
        self.lease.timings = timings;
        self
    }

    /// Each shard's lease (default 15 s).
    pub fn lease_duration(mut self, lease_duration: Duration) -> Self {
        self.lease.timings.lease_duration = lease_duration;
        self
    }

    /// How long a member keeps a shard without a successful renewal (default 10 s).
    pub fn renew_deadline(mut self, renew_deadline: Duration) -> Self {
        self.lease.timings.renew_deadline = renew_deadline;
        self
    }

    /// Time between rounds (default 2 s).
    pub fn retry_period(mut self, retry_period: Duration) -> Self {
        self.lease.timings.retry_period = retry_period;
        self
    }

    /// Timeout of every request, a batch counting as one (default: half the renew deadline, as
    /// the elector's).
    pub fn request_timeout(mut self, request_timeout: Duration) -> Self {
        self.lease.request_timeout = Some(request_timeout);
        self
    }

    /// How long to wait for a shard's work to stop before releasing it (default: the lease
    /// duration less the renew deadline, as the elector's).
    pub fn stop_grace(mut self, stop_grace: Duration) -> Self {
        self.lease.stop_grace = Some(stop_grace);
        self
    }

    /// Release the shards on shutdown (default true).
    pub fn release_on_cancel(mut self, release: bool) -> Self {
        self.lease.release_on_cancel = release;
        self
    }

    /// The wall clock whose times go into the records (default: the system clock); see
    /// [`LeaderElectorBuilder::wall_clock`](crate::LeaderElectorBuilder::wall_clock).
    pub fn wall_clock(mut self, clock: crate::WallClock) -> Self {
        self.lease.wall_clock = clock;
        self
    }

    /// The lowest fencing token a shard's term takes (default 0: none), as the elector's
    /// [`fencing_token_floor`](crate::LeaderElectorBuilder::fencing_token_floor): every
    /// acquisition's token is at least this and greater than every earlier one of the shard.
    pub fn fencing_token_floor(mut self, floor: u64) -> Self {
        self.lease.fencing_token_floor = floor;
        self
    }

    /// Static membership (default false), as Kafka's `group.instance.id`: this member's
    /// identity is the same when its process starts again (a StatefulSet's Pod name, a
    /// host name), so a restart need not move its shards.
    ///
    /// On shutdown the member stops each shard's work and releases the shard reserved for
    /// its own identity (a planned handover to itself, S10), for the
    /// [`static_membership_window`](Self::static_membership_window) (default: the lease).
    /// The other members stand back from a reserved shard for the window from when they see
    /// it; a process that starts with the same identity within it takes its shards back
    /// first. A rolling restart then moves no shard: each is idle from its work's stop until
    /// the new process takes it, instead of moving to another member and back. A member that
    /// does not come back (a scale-down) leaves its shards idle for the window before the
    /// others take them, each once.
    ///
    /// Leave it off where a restarted process gets a new identity (a Deployment's Pod
    /// names, which the member warns of): nobody would take the reserved shards before the
    /// window runs out. Without [`release_on_cancel`](Self::release_on_cancel) a shutdown
    /// is a crash.
    ///
    /// After a crash (no release: a process killed, a node lost) the member's shards wait
    /// for it too: the roster keeps the member's window, and the others, once they find its
    /// member record's lease run out, keep its shards for it for the window from then. A
    /// process started again with the identity within the window takes them back once their
    /// leases have run out (S13), and none moves; after the window they move to the others,
    /// each once. A member that crashes for good leaves its shards idle for a lease and the
    /// window, where without static membership they wait a lease.
    ///
    /// A process started while another still runs with its identity fences that one (Kafka
    /// fences the older consumer of a `group.instance.id` the same way): the older process
    /// hands its shards to the identity and its run ends with [`ShardsError::Fenced`].
    pub fn static_membership(mut self, on: bool) -> Self {
        self.static_membership = on;
        self
    }

    /// How long a member's shards wait for its identity to come back after it shut down
    /// under [`static_membership`](Self::static_membership), as Kafka's `session.timeout.ms`
    /// beside its heartbeats (default: the lease), counted from the shutdown, or after a crash
    /// from when the others find the member's lease run out. Within the window a process
    /// started with the same identity takes its shards back and none moves; after it the
    /// others take them, each once. A restart that takes longer than the lease (a Pod rescheduled onto another
    /// node, an image pulled) keeps its shards with a window that outlasts it; the price is
    /// as long an idle time for the shards of a member that does not come back.
    ///
    /// The window goes into each reserved shard's record (its lease duration, which a free
    /// record's readers stand back for), and into the roster beside the member, so every
    /// member follows the one that shut down or crashed.
    /// From the lease to [`MAX_STATIC_MEMBERSHIP_WINDOW`]; without static membership it
    /// changes nothing.
    pub fn static_membership_window(mut self, window: Duration) -> Self {
        self.static_membership_window = Some(window);
        self
    }

    /// This member's weight (default 1): each member's share of the shards is in proportion
    /// to its weight, so a member of weight 2 owns about twice the shards of a member of
    /// weight 1 (a larger machine). The weight goes into the member's record, where the others
    /// read it. A member of weight 0 takes no shard (nor does a member drained with
    /// [`drain_member`]), unless every member weighs 0: a set is never left to nobody.
    pub fn weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }

    /// Called when this member takes a shard, with the shard and a counted [`Leadership`] of
    /// its term: the shard is released only once every counted clone is gone (S6). Work that
    /// gives the shard up ([`Leadership::step_down`]) has it taken again by this member only
    /// after a back-off: the jittered retry period, doubling with each give-up within ten
    /// minutes of the previous one (unless the term ran that long), up to five minutes, as
    /// Kubernetes's CrashLoopBackOff. Another member may take it meanwhile.
    pub fn on_shard_started(
        mut self,
        callback: impl Fn(u32, Leadership) + Send + Sync + 'static,
    ) -> Self {
        self.callbacks.started = Some(Arc::new(callback));
        self
    }

    /// The shard count this member follows, as it changes: the count it was built with, then
    /// each count a resize writes ([`resize_shard_set`]), from the round in which the member
    /// reads it. For the callbacks, which are given before the set is built; the same as
    /// [`Shards::subscribe_count`].
    pub fn subscribe_count(&self) -> watch::Receiver<u32> {
        self.count.subscribe()
    }

    /// Called when a shard's term ends, with why.
    pub fn on_shard_stopped(
        mut self,
        callback: impl Fn(u32, StepDown) + Send + Sync + 'static,
    ) -> Self {
        self.callbacks.stopped = Some(Arc::new(callback));
        self
    }

    /// Checks the configuration (S4, a shard count from 1 to [`MAX_SHARDS`], and a static
    /// membership window from the lease to [`MAX_STATIC_MEMBERSHIP_WINDOW`]).
    ///
    /// # Errors
    /// The rule broken.
    pub fn build(self) -> Result<Shards, ConfigError> {
        let count = *self.count.borrow();
        if count == 0 || count > MAX_SHARDS {
            return Err(ConfigError::InvalidShardCount {
                count,
                max: MAX_SHARDS,
            });
        }
        if self.locks.identity().is_empty() {
            return Err(ConfigError::EmptyIdentity);
        }
        let lease = self.lease.check()?;
        let window = self
            .static_membership_window
            .unwrap_or(lease.lease_duration);
        if window < lease.lease_duration || window > MAX_STATIC_MEMBERSHIP_WINDOW {
            return Err(ConfigError::InvalidStaticMembershipWindow {
                window,
                lease_duration: lease.lease_duration,
                max: MAX_STATIC_MEMBERSHIP_WINDOW,
            });
        }
        let config = ShardsConfig {
            name: self.name,
            count,
            lease,
            static_membership: self.static_membership,
            static_membership_window: window,
            weight: self.weight,
        };
        let (state, _) = watch::channel(ShardsState::default());
        self.count.send_replace(config.count);
        Ok(Shards {
            config,
            locks: self.locks,
            callbacks: self.callbacks,
            state,
            count: self.count,
        })
    }
}

/// How often a give-up is asked again while the term's one request slot is taken.
const GIVE_UP_AGAIN: Duration = Duration::from_millis(20);

/// Gives up `term`'s shard ([`Leadership::step_down`]), asking again while another request of
/// the term (an extensions write) fills its one slot, until the member takes the request or
/// the term ends: a give-up is never lost, so a shard never stays owned with no work running.
async fn give_up(term: &Leadership) {
    while term.step_down().is_err() && !term.is_lost() {
        tokio::time::sleep(GIVE_UP_AGAIN).await;
    }
}

/// A member of a shard set: owns its fair share of the set's shards while it runs.
///
/// ```
/// use std::sync::Arc;
/// use leader_core::backend::KeyedLocks;
/// use leader_core::{CancellationToken, MemoryStore, Shards};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let locks = KeyedLocks::new("replica-1", "memory", move |key, identity| {
///     Arc::new(store.lock(key, identity))
/// });
/// let shards = Shards::builder("tenants", 16, locks).build()?;
/// let mut owned = shards.subscribe();
/// let shutdown = CancellationToken::new();
/// let member = tokio::spawn(shards.run_per_shard(shutdown.clone(), |shard, term| async move {
///     // The work of one shard, fenced by its token; it is dropped when the shard moves.
///     let _ = (shard, term.fencing_token());
///     std::future::pending::<()>().await
/// }));
/// owned.wait_for(|state| state.owned.len() == 16).await?;
/// shutdown.cancel();
/// member.await??;
/// # Ok(())
/// # }
/// ```
pub struct Shards {
    config: ShardsConfig,
    locks: Arc<dyn LockSet>,
    callbacks: Callbacks,
    state: watch::Sender<ShardsState>,
    count: watch::Sender<u32>,
}

impl fmt::Debug for Shards {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shards")
            .field("config", &self.config)
            .field("locks", &self.locks)
            .finish_non_exhaustive()
    }
}

impl Shards {
    /// A member of shard set `name` with `count` shards, on the records of `locks`.
    pub fn builder(
        name: impl Into<String>,
        count: u32,
        locks: impl LockSet + 'static,
    ) -> ShardsBuilder {
        ShardsBuilder {
            count: watch::Sender::new(count),
            name: name.into(),
            lease: crate::config::LeaseSettings::default(),
            static_membership: false,
            static_membership_window: None,
            weight: 1,
            locks: Arc::new(locks),
            callbacks: Callbacks::default(),
        }
    }

    /// The validated configuration.
    pub fn config(&self) -> &ShardsConfig {
        &self.config
    }

    /// The shards owned, as they change.
    pub fn subscribe(&self) -> watch::Receiver<ShardsState> {
        self.state.subscribe()
    }

    /// The shard count this member follows, as it changes: the count it was built with, then
    /// each count a resize writes ([`resize_shard_set`]), from the round in which this member
    /// reads it (the shards past a smaller count have had their terms ended by then, their
    /// work told to stop). Work that splits keys by the count (`key % count == shard`) reads
    /// it here and restarts under a new one; see "Resizing" in the crate's documentation for
    /// what keeps a key from being worked under two counts at once.
    pub fn subscribe_count(&self) -> watch::Receiver<u32> {
        self.count.subscribe()
    }

    /// Takes part in the set until `shutdown` is cancelled, then stops every shard's work,
    /// releases the shards (unless told not to) and leaves the roster.
    ///
    /// # Errors
    /// [`ShardsError::CountMismatch`] or [`ShardsError::InvalidRoster`] when the store's
    /// roster disagrees with this replica: it took no shard and stopped. Outages and a shared
    /// identity are not errors here: the member waits them out, and says so on its state.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ShardsError> {
        runner::Runner::new(
            self.config,
            self.locks,
            self.callbacks,
            self.state,
            self.count,
        )
        .run(shutdown)
        .await
    }

    /// Runs `work(shard, term)` for each shard while this member owns it, until `shutdown`:
    /// the work's future is dropped when the shard's term ends (a handover, a lost lease, the
    /// shutdown), and the shard is released only after that (S6). Work that returns or panics
    /// while the shard is still owned gives the shard up, so that a member never keeps a shard
    /// whose work no longer runs (S13). This member takes it again only after a back-off that
    /// grows while the work keeps ending soon after it starts, as
    /// [`on_shard_started`](ShardsBuilder::on_shard_started) says; another member may take it
    /// meanwhile.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub async fn run_per_shard<F, Fut>(
        mut self,
        shutdown: CancellationToken,
        work: F,
    ) -> Result<(), ShardsError>
    where
        F: Fn(u32, Leadership) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let work = Arc::new(work);
        let user = self.callbacks.started.take();
        self.callbacks.started = Some(Arc::new(move |shard, term: Leadership| {
            if let Some(user) = &user {
                user(shard, term.clone());
            }
            let work = work.clone();
            tokio::spawn(async move {
                let running = term.clone();
                let job = tokio::spawn(async move {
                    let _ = running.run(work(shard, running.clone())).await;
                });
                if job.await.is_err() {
                    tracing::error!(
                        shard,
                        fencing_token = term.fencing_token(),
                        "the shard's work panicked: giving the shard up"
                    );
                }
                // Work that ended while the shard was still owned gives it up.
                give_up(&term).await;
            });
        }));
        self.run(shutdown).await
    }
}

#[cfg(test)]
mod tests {
    use super::looks_like_replica_set_pod;

    #[test]
    fn a_replica_sets_pod_names_are_told_from_stable_names() {
        for deployment in [
            "web-7d4b9c8f6-x2kqz",
            "nginx-deployment-66b6c48dd5-4jw2p",
            "jobs-worker-5f8d9c7b4d-abcde",
            "a-bcdfg-hjklm",
            "api-0123456789-zz9zz",
        ] {
            assert!(looks_like_replica_set_pod(deployment), "{deployment}");
        }
        for stable in [
            // StatefulSet Pods, host names, the default identity (HOSTNAME-PID).
            "web-0",
            "kafka-broker-12",
            "jobs-worker-2",
            "ip-10-0-1-23",
            "build-host-48213",
            "replica-1",
            "",
            "-",
            "web-7d4b9c8f6",
            // A hash too short or too long, a suffix of another length.
            "web-7d4b-x2kqz",
            "web-7d4b9c8f6ab-x2kqz",
            "web-7d4b9c8f6-x2kq",
            "web-7d4b9c8f6-x2kqzz",
            // Not what Kubernetes writes: capitals, other characters, no name before.
            "web-7D4B9C8F6-X2KQZ",
            "web-7d4b9c8f6-x2_qz",
            "7d4b9c8f6-x2kqz",
            "-7d4b9c8f6-x2kqz",
            "web--7d4b9c8f6-x2kqz",
        ] {
            assert!(!looks_like_replica_set_pod(stable), "{stable:?}");
        }
    }
}
