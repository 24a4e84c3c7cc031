//! A conformance suite for [`ResourceLock`] implementations (feature `testing`).
//!
//! Not API-stable: checks are added as the contract is sharpened, and a new check may fail a
//! backend that passed before; that is its purpose.
//!
//! Every backend of this workspace runs it against a real server, and a third-party backend can run
//! it the same way: implement [`LockFactory`] and call [`run_all`] from a test. Each check uses an
//! election name of its own with a random suffix, so the suite can share a server with other tests.
//! A failed check panics with a message that names the broken rule.
//!
//! ```ignore
//! #[tokio::test]
//! async fn conformance() {
//!     leader_core::conformance::run_all(&MyFactory::connect().await).await;
//! }
//! ```

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, SubsecRound, Utc};

mod handovers;
mod leases;
mod records;
mod shards;

pub use handovers::*;
pub use leases::*;
pub use records::*;
pub use shards::{Interval, ShardLog, balanced, batches_answer_as_their_locks, shard_protocol};

use crate::{Acquisition, LeaderElectionRecord, LockError, Observed, ResourceLock};

/// Makes locks of one backend for the suite.
#[async_trait]
pub trait LockFactory: Send + Sync {
    /// A lock on election `name` for candidate `identity`. Locks with the same name contend for the
    /// same stored object.
    async fn lock(&self, name: &str, identity: &str) -> Arc<dyn ResourceLock>;

    /// Stores, under election `name`, a value that is not a valid record, as a broken writer
    /// would (the wrong type, garbage bytes, nonsense fields), and returns `true`; or returns
    /// `false` when the store checks what it holds so that no such value can be stored (a
    /// Kubernetes API server validates every Lease), and the check that needs one is skipped.
    async fn corrupt(&self, name: &str) -> bool;

    /// Whether the store keeps the record's
    /// [`unknown_fields`](crate::LeaderElectionRecord::unknown_fields) (the fields of a later
    /// release, S16): a store of the record as JSON does. A store of the record as columns
    /// (SQL) or as an API's object with a schema of its own (a Kubernetes Lease) does not: a
    /// later release's field is a column or an annotation this release leaves alone, which the
    /// backend's own tests show. Default: `true`.
    fn keeps_unknown_fields(&self) -> bool {
        true
    }

    /// How much longer than the suite's default bounds the store may take to expire a lease
    /// whose holder is gone without a word (the default bounds suit stores that expire a lease
    /// within a few seconds of its duration). A Consul session, for one, lives at least 10 s
    /// and is invalidated up to twice its TTL after its last renewal. Default: none.
    fn extra_expiry(&self) -> Duration {
        Duration::ZERO
    }

    /// The backend's own [`LockSet`](crate::LockSet) for member `identity`, when it has one
    /// (batched reads and renewals): the suite checks that its batches answer as the locks of
    /// its keys would, and runs the shard protocol on it. Default: none, and the shard protocol
    /// runs on locks from [`lock`](Self::lock), one request per record.
    async fn lock_set(&self, identity: &str) -> Option<Box<dyn crate::LockSet>> {
        let _ = identity;
        None
    }
}

/// Runs every check of the suite, one after the other.
pub async fn run_all(factory: &dyn LockFactory) {
    absent_object(factory).await;
    create_then_get(factory).await;
    create_conflicts_when_present(factory).await;
    update_is_compare_and_swap(factory).await;
    identical_writes_move_the_version(factory).await;
    fields_of_a_later_release_survive(factory).await;
    fields_round_trip(factory).await;
    acquisitions_keep_the_extensions(factory).await;
    extensions_outlive_a_crashed_holder(factory).await;
    concurrent_creates_have_one_winner(factory).await;
    concurrent_updates_have_one_winner(factory).await;
    invalid_record_is_reported_and_kept(factory).await;
    odd_records_do_not_block_the_election(factory).await;
    identity_and_describe(factory).await;
    election_name_is_the_given_name(factory).await;
    change_notifications(factory).await;
    store_clock_acquisition(factory).await;
    fencing_token_floor(factory).await;
    renewals_keep_the_lease(factory).await;
    lost_renewal_answers(factory).await;
    reads_show_the_last_renewal(factory).await;
    handover_requests(factory).await;
    electors_elect_one_and_hand_over(factory).await;
    wall_clock_steps(factory).await;
    planned_handover(factory).await;
    one_identity_one_process(factory).await;
    batches_answer_as_their_locks(factory).await;
    shard_protocol(factory).await;
}

fn unique(test: &str) -> String {
    format!("conformance-{test}-{:08x}", fastrand::u32(..))
}

/// Candidates `a` and `b` of a new election of its own for `test`.
async fn rivals(
    factory: &dyn LockFactory,
    test: &str,
) -> (Arc<dyn ResourceLock>, Arc<dyn ResourceLock>) {
    let name = unique(test);
    (
        factory.lock(&name, "a").await,
        factory.lock(&name, "b").await,
    )
}

/// The first term of a new election, for `a`: acquired where the backend acquires in one
/// request, created where it does not.
async fn first_term(context: &str, a: &dyn ResourceLock) -> Observed {
    match a.try_acquire(&record("a", 1)).await.expect("try_acquire") {
        Some(Acquisition::Acquired(taken)) => taken,
        None => a.create(&record("a", 1)).await.expect("create"),
        Some(other) => panic!("{context}: a free lease was not acquired: {other:?}"),
    }
}

/// Times as every backend can store them: whole microseconds.
fn now() -> DateTime<Utc> {
    Utc::now().trunc_subsecs(6)
}

/// The renewals, now, of records held as `taken` says (key, record as stored): what a shard
/// set member's round sends to [`LockSet::renew_many`](crate::LockSet::renew_many).
pub fn renewals(taken: &[(String, Observed)]) -> Vec<crate::backend::Renewal> {
    taken
        .iter()
        .map(|(key, observed)| {
            let mut record = observed.record.clone();
            record.renew_time = record.renewal_time(now());
            crate::backend::Renewal {
                key: key.clone(),
                version: observed.version.clone(),
                record,
            }
        })
        .collect()
}

/// A record held by `holder`, with a whole-second lease as every backend can store it.
pub fn record(holder: &str, leader_transitions: u64) -> LeaderElectionRecord {
    let now = now();
    LeaderElectionRecord {
        holder_identity: holder.to_owned(),
        lease_duration: Duration::from_secs(15),
        acquire_time: now,
        renew_time: now,
        leader_transitions,
        strategy: None,
        preferred_holder: None,
        extensions: std::collections::BTreeMap::new(),
        unknown_fields: std::collections::BTreeMap::new(),
    }
}

fn assert_stored(context: &str, written: &LeaderElectionRecord, stored: &Observed) {
    let mut expected = written.clone();
    assert!(
        stored.record.leader_transitions >= written.leader_transitions,
        "{context}: the stored leader_transitions ({}) is lower than written ({})",
        stored.record.leader_transitions,
        written.leader_transitions
    );
    expected.leader_transitions = stored.record.leader_transitions;
    assert_eq!(
        stored.record, expected,
        "{context}: the stored record differs from the written one"
    );
}

/// Panics unless `result` is a conflict ([`LockError::is_conflict`]); `context` says which
/// write.
pub fn assert_conflict<T: std::fmt::Debug>(context: &str, result: &Result<T, LockError>) {
    assert!(
        result.as_ref().is_err_and(LockError::is_conflict),
        "{context}: expected a conflict, got {result:?}"
    );
}

async fn get(context: &str, lock: &dyn ResourceLock) -> Option<Observed> {
    lock.get()
        .await
        .unwrap_or_else(|err| panic!("{context}: get failed: {err}"))
}

/// A released lease: an empty holder.
fn free(leader_transitions: u64) -> LeaderElectionRecord {
    let mut free = record("", leader_transitions);
    free.lease_duration = Duration::from_secs(1);
    free
}

/// Extensions as a feature would write them.
fn extensions() -> std::collections::BTreeMap<String, String> {
    std::collections::BTreeMap::from([
        (
            "cron/nightly-report".to_owned(),
            r#"{"at":"2026-01-01T00:00:00Z","token":7,"outcome":"started: \"ok\" ✓"}"#.to_owned(),
        ),
        ("shards".to_owned(), "16".to_owned()),
    ])
}
