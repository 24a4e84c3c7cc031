//! S16 on a SQL lock table: a nullable column that a later release's migration added keeps the
//! value that release wrote through every write of this release, and `get` and a shard set's
//! `get_many` still read the record beside it. The table's statements are the backend's; the
//! writes and the checks after each are the same for every SQL backend.

use std::future::Future;

use chrono::Utc;
use leader_core::backend::Known;
use leader_core::conformance::{record, renewals};
use leader_core::{Acquisition, LockSet, Observed, ResourceLock, request_handover};

/// What a later release wrote into its own column.
pub const LATER: &str = "n+1";

/// A lock table with the later release's column (`holder_release`), reached by a connection of
/// the test's own.
pub trait LaterTable {
    /// Writes a free record of election `name` as the later release would, its column set to
    /// [`LATER`].
    fn write(&self, name: &str) -> impl Future<Output = ()>;

    /// The later release's column of `name`. Err: the row could not be read, or is gone.
    fn column(&self, name: &str) -> impl Future<Output = Result<Option<String>, String>>;
}

/// The later release's column of a [`LaterTable`], watched through this release's writes;
/// `reader` is a shard set of the same store, whose `get_many` must read what `get` reads.
#[derive(Debug)]
pub struct LaterColumn<T, S> {
    /// The table, as the backend's test reaches it.
    pub table: T,
    /// A shard set of the store under test.
    pub reader: S,
}

impl<T: LaterTable, S: LockSet> LaterColumn<T, S> {
    /// After `step`: the column of `name` still holds [`LATER`], and `get` and the reader's
    /// `get_many` both read the record.
    pub async fn kept(&self, step: &str, name: &str, lock: &dyn ResourceLock) -> Observed {
        let value = self
            .table
            .column(name)
            .await
            .unwrap_or_else(|err| panic!("{step}: the row of {name}: {err}"));
        assert_eq!(
            value.as_deref(),
            Some(LATER),
            "{step}: the later release's column of {name} lost its value"
        );
        let read = lock
            .get()
            .await
            .unwrap_or_else(|err| panic!("{step}: get: {err}"))
            .unwrap_or_else(|| panic!("{step}: get found no record"));
        let many = self.reader.get_many(&[name.to_owned()]).await;
        let [Ok(Some(many))] = many.as_slice() else {
            panic!("{step}: get_many: {many:?}");
        };
        assert_eq!(many, &read, "{step}: get_many and get differ");
        read
    }

    /// Every write of one election: `a` acquires, renews, updates with an extension, `b` asks
    /// for a handover, `a` releases, `b` acquires; the column is checked after each.
    pub async fn every_write(&self, name: &str, a: &dyn ResourceLock, b: &dyn ResourceLock) {
        self.table.write(name).await;
        self.kept("a later release's write", name, a).await;

        let held = acquired(a, "a", &format!("{name}: a did not take the free lease")).await;
        let read = self.kept("an acquisition", name, a).await;
        assert!(read.record.is_held_by("a"), "{read:?}");

        let mut renewal = held.record.clone();
        renewal.renew_time = renewal.renewal_time(Utc::now());
        let renewed = a.renew(&held.version, &renewal).await.expect("renewal");
        self.kept("a renewal", name, a).await;

        let mut extended = renewed.record.clone();
        extended.renew_time = extended.renewal_time(Utc::now());
        extended
            .extensions
            .insert("schedule".to_owned(), "fired=1".to_owned());
        a.update(&renewed.version, &extended)
            .await
            .expect("update with an extension");
        let read = self.kept("an update with an extension", name, a).await;
        assert_eq!(read.record.extensions, extended.extensions);

        request_handover(b, "b").await.expect("handover request");
        let requested = self.kept("a handover request", name, a).await;
        assert_eq!(requested.record.handover_to(), Some("b"));

        let now = Utc::now();
        let mut released = requested.record.clone();
        released.holder_identity = String::new();
        released.acquire_time = now;
        released.renew_time = now;
        a.update(&requested.version, &released)
            .await
            .expect("release");
        let read = self.kept("a release", name, a).await;
        assert!(read.record.is_free(), "{read:?}");

        acquired(
            b,
            "b",
            &format!("{name}: b did not take the lease handed to it"),
        )
        .await;
        let read = self.kept("another candidate's acquisition", name, b).await;
        assert!(read.record.is_held_by("b"), "{read:?}");
        assert!(read.record.leader_transitions > held.record.leader_transitions);
        assert_eq!(read.record.extensions, extended.extensions);
    }

    /// A shard set's writes of two shards the later release wrote: member `m` of `set` takes
    /// them, renews them in a batch and in a round that also reads them; the column is checked
    /// after each.
    pub async fn every_shard_write(&self, set: &dyn LockSet) {
        let keys = ["shard-0".to_owned(), "shard-1".to_owned()];
        let mut taken = Vec::new();
        for key in &keys {
            self.table.write(key).await;
            let held = acquired(
                &*set.lock(key),
                "m",
                &format!("{key}: m did not take the free lease"),
            )
            .await;
            self.kept("a shard's acquisition", key, &*set.lock(key))
                .await;
            taken.push((key.clone(), held));
        }
        let mut renewed = Vec::new();
        for (key, result) in keys.iter().zip(set.renew_many(&renewals(&taken)).await) {
            renewed.push((key.clone(), result.expect("a batched renewal")));
            self.kept("a batched renewal", key, &*set.lock(key)).await;
        }
        let round = set
            .renew_and_read(&renewals(&renewed), &keys, &[Known::Nothing; 2])
            .await;
        for ((key, renewal), read) in keys.iter().zip(round.renewed).zip(round.read) {
            renewal.expect("a round's renewal");
            read.expect("a round's read");
            self.kept("a round's renewal", key, &*set.lock(key)).await;
        }
    }
}

/// What `holder` acquired through `lock`, whose lease is free; panics with `failed` and the
/// answer when the lease is not taken or the request fails.
async fn acquired(lock: &dyn ResourceLock, holder: &str, failed: &str) -> Observed {
    match lock.try_acquire(&record(holder, 0)).await {
        Ok(Some(Acquisition::Acquired(held))) => held,
        other => panic!("{failed}: {other:?}"),
    }
}
