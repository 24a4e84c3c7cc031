//! What a member knows of each shard of the set, by shard number: its key, its record as the
//! last read of every shard found it, and what it saw of it since when (S2); and what it saw
//! of the set's other records (the roster, the members').

use std::collections::{BTreeMap, BTreeSet, HashMap};

use tokio::time::Instant;

use crate::record::{LeaderElectionRecord, Observed};
use crate::rules::{Sighting, TokensSeen, Unanswered};
use crate::shards::{Reread, shard_key};

/// Each shard's key and what this member knows of its record, indexed by shard number, and
/// what it saw of the set's other records (the roster, the members'), by key.
pub(super) struct ShardTable {
    /// The key of each shard, made once.
    pub(super) keys: Vec<String>,
    /// What every shard's key begins with.
    prefix: String,
    /// What this member saw of each shard.
    pub(super) seen: Vec<Option<Sighting>>,
    /// What this member saw of the set's other records (the roster, the members'), by key.
    others: HashMap<String, Sighting>,
    /// The largest fencing token this member saw of each shard (S5), by shard number, kept
    /// when the record goes and past a smaller count: a shard whose record was deleted, or
    /// that a resize took away and brings back, does not give out its old tokens again.
    tokens: Vec<TokensSeen>,
    /// The same of the set's other records, by key.
    other_tokens: HashMap<String, TokensSeen>,
    /// Each shard's record as the last read of every shard found it: a read passes their
    /// versions, and the store need not send a record still at its version again.
    pub(super) records: Vec<Option<Observed>>,
    /// Whether each shard was read yet (an absent record is known only then).
    pub(super) read: Vec<bool>,
    /// The shards whose record the store deleted under a holder (its lease run out, where the
    /// store keeps leases: etcd, ZooKeeper), with that holder, until the record is back: what
    /// a static member gone within its window still counts as its own.
    pub(super) vanished: BTreeMap<u32, String>,
    /// The shards whose record a read found gone under the holder last seen (its lease
    /// counted by the members), with that holder and until when the shard stays its own: a
    /// lease from that read, as a holder leads on until a renewal meets the deletion (S2,
    /// [`Sighting::lease_ends_at`]), or until the record is back.
    pub(super) gone: BTreeMap<u32, (String, Instant)>,
    /// The shards whose record the last read of every shard could not read: owned by nobody
    /// as far as this member knows, taken by nobody, and left out of the shares.
    pub(super) unreadable: BTreeSet<u32>,
    /// The last claim of each record (by key) sent without its answer coming, until a claim
    /// of it is answered: what it wrote is this member's own.
    pub(super) unanswered: HashMap<String, Unanswered>,
}

impl ShardTable {
    /// The table of set `name`'s `count` shards, none read yet.
    pub(super) fn new(name: &str, count: u32) -> Self {
        // The key of shard 0 less its number: every shard's key is it and the number.
        let mut prefix = shard_key(name, 0);
        prefix.pop();
        let mut table = Self {
            keys: Vec::new(),
            prefix,
            seen: Vec::new(),
            others: HashMap::new(),
            tokens: Vec::new(),
            other_tokens: HashMap::new(),
            records: Vec::new(),
            read: Vec::new(),
            vanished: BTreeMap::new(),
            gone: BTreeMap::new(),
            unreadable: BTreeSet::new(),
            unanswered: HashMap::new(),
        };
        table.resize(count);
        table
    }

    /// Follows the set's new `count`: the shards past it are forgotten, those added are known
    /// as nothing yet.
    pub(super) fn resize(&mut self, count: u32) {
        self.unreadable.retain(|&shard| shard < count);
        self.vanished.retain(|&shard, _| shard < count);
        self.gone.retain(|&shard, _| shard < count);
        let n = count as usize;
        self.keys.truncate(n);
        // Claims of shards the count leaves out, or of records that are not shards'.
        let keys = &self.keys;
        self.unanswered
            .retain(|key, _| keys.contains(key) || !key.starts_with(self.prefix.as_str()));
        let from = u32::try_from(self.keys.len()).unwrap_or(count);
        let prefix = &self.prefix;
        self.keys
            .extend((from..count).map(|shard| format!("{prefix}{shard}")));
        self.seen.resize_with(n, || None);
        self.records.resize_with(n, || None);
        self.read.resize(n, false);
        if self.tokens.len() < n {
            self.tokens.resize_with(n, TokensSeen::default);
        }
    }

    /// The shard whose key is `key`, if it is one of this set's shards.
    pub(super) fn index(&self, key: &str) -> Option<usize> {
        let index: usize = key.strip_prefix(&self.prefix)?.parse().ok()?;
        (self.keys.get(index)? == key).then_some(index)
    }

    /// Makes sure there is a record slot per shard: a round dropped while it acted (it holds
    /// the records meanwhile) took them along, and every shard is then read again in full.
    pub(super) fn restore_records(&mut self) {
        if self.records.len() != self.keys.len() {
            self.records = std::iter::repeat_with(|| None)
                .take(self.keys.len())
                .collect();
            self.read.fill(false);
        }
    }

    /// Notes what a read of every shard answered for `shard`: its record now (kept as it was
    /// when the store said it is unchanged), and the holder of a record the store deleted.
    pub(super) fn read_ok(&mut self, shard: usize, answer: Reread) {
        let index = u32::try_from(shard).unwrap_or(u32::MAX);
        if let Reread::Now(observed) = answer {
            let before = std::mem::replace(&mut self.records[shard], observed);
            if self.records[shard].is_some() {
                self.vanished.remove(&index);
                self.gone.remove(&index);
            } else {
                let holder = match before {
                    Some(before) => Some(before.record.holder_identity),
                    // No record kept (a read failed since, or a round dropped while it
                    // acted): the holder last seen, whose sighting outlives both.
                    None => (self.seen[shard].as_ref())
                        .and_then(Sighting::holder)
                        .map(str::to_owned),
                };
                if let Some(holder) = holder.filter(|h| !h.is_empty()) {
                    self.vanished.insert(index, holder);
                }
            }
            if self.records[shard].is_none()
                && let Some(seen) = &mut self.seen[shard]
                && let Some(holder) = seen.counted_holder().map(str::to_owned)
            {
                seen.see_gone(Instant::now());
                let until = seen.lease_ends_at(None);
                tracing::warn!(
                    shard = index,
                    holder = %holder,
                    "the shard's record is gone under its holder, which works on until a \
                     renewal meets that: waiting a lease before taking it"
                );
                self.gone.entry(index).or_insert((holder, until));
            }
        }
        self.read[shard] = true;
        if let Some(observed) = &self.records[shard] {
            self.tokens[shard].see(&observed.record);
        }
        note(&mut self.seen[shard], self.records[shard].as_ref());
        if !self.unreadable.is_empty() {
            self.unreadable.remove(&index);
        }
    }

    /// The holder of `shard`'s record found gone under its lease, while that lease still runs
    /// on this member's clock at `now` ([`ShardTable::gone`]).
    pub(super) fn gone_holder(&self, shard: u32, now: Instant) -> Option<&str> {
        self.gone
            .get(&shard)
            .filter(|(_, until)| now < *until)
            .map(|(holder, _)| holder.as_str())
    }

    /// Notes that `shard`'s record could not be read: known as nothing and read again in full.
    /// What was seen of it is kept, as the elector keeps it through a failed read: the same
    /// version read next runs on from its first sight (S2), and a record found gone next is
    /// waited out under the holder last seen, and counted among the shards the store deleted
    /// under it ([`ShardTable::vanished`]).
    pub(super) fn read_failed(&mut self, shard: usize) {
        self.records[shard] = None;
        self.read[shard] = false;
        self.unreadable
            .insert(u32::try_from(shard).unwrap_or(u32::MAX));
    }

    /// Notes a record read or written: the follower's clock for its lease starts when a
    /// version is first seen (S2).
    pub(super) fn observe(&mut self, key: &str, observed: Option<&Observed>) {
        if let Some(shard) = self.index(key) {
            if let Some(observed) = observed {
                self.tokens[shard].see(&observed.record);
            }
            note(&mut self.seen[shard], observed);
            return;
        }
        let Some(observed) = observed else {
            self.others.remove(key);
            return;
        };
        // Most keys are known: look them up without making a key.
        if let Some(seen) = self.others.get_mut(key) {
            seen.see(observed, Instant::now());
        } else {
            self.others
                .insert(key.to_owned(), Sighting::new(observed, Instant::now()));
        }
        self.note_token(key, &observed.record);
    }

    /// Notes the fencing token of `record`, a record of `key` read or written (S5).
    pub(super) fn note_token(&mut self, key: &str, record: &LeaderElectionRecord) {
        if let Some(shard) = self.index(key) {
            self.tokens[shard].see(record);
        } else if let Some(tokens) = self.other_tokens.get_mut(key) {
            tokens.see(record);
        } else {
            let mut tokens = TokensSeen::default();
            tokens.see(record);
            self.other_tokens.insert(key.to_owned(), tokens);
        }
    }

    /// The largest fencing tokens this member saw of record `key` (S5): for a shard, also
    /// those seen while a smaller count left it out of the set.
    pub(super) fn tokens(&self, key: &str) -> TokensSeen {
        let other = self.other_tokens.get(key).copied().unwrap_or_default();
        match self.index(key) {
            Some(shard) => self.tokens[shard].max(other),
            None => other,
        }
    }

    /// Notes what the store said of record `key`'s lease, as last observed: whether it keeps
    /// it alive itself (a lease it stopped keeping is counted from now).
    pub(super) fn store_keeps(&mut self, key: &str, kept: bool) {
        let now = Instant::now();
        let seen = match self.index(key) {
            Some(shard) => self.seen[shard].as_mut(),
            None => self.others.get_mut(key),
        };
        if let Some(seen) = seen {
            seen.store_keeps(kept, now);
        }
    }

    /// What this member saw of record `key`.
    pub(super) fn sighting(&self, key: &str) -> Option<&Sighting> {
        match self.index(key) {
            Some(shard) => self.seen[shard].as_ref(),
            None => self.others.get(key),
        }
    }
}

/// Notes a read or written record in what was seen of it: the follower's clock for its lease
/// starts when a version is first seen (S2), the stand-back clock when a handover request is;
/// no record empties the slot.
fn note(slot: &mut Option<Sighting>, observed: Option<&Observed>) {
    let now = Instant::now();
    match (slot.as_mut(), observed) {
        (_, None) => *slot = None,
        (Some(seen), Some(observed)) => {
            seen.see(observed, now);
        }
        (None, Some(observed)) => *slot = Some(Sighting::new(observed, now)),
    }
}
