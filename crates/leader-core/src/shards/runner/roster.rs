//! The roster as this member last read it: the members it names, the roster itself (what an
//! unreadable roster is taken as meanwhile), and the keys a read of the set asks for.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::record::Observed;
use crate::shards::{MEMBER_PREFIX, roster_key};

/// The roster as last read, and the keys a read asks for (the roster, the members it names,
/// then every shard), made again only when the roster's members or the shard count change.
pub(super) struct RosterRead {
    /// The roster's key.
    key: String,
    /// Members named by the last roster read: identity by member key.
    members: BTreeMap<String, String>,
    /// The roster as last read and checked.
    last: Option<Observed>,
    /// What a read asks for. Shared, so that a round reads it while it notes what it found.
    keys: Arc<[String]>,
}

impl RosterRead {
    /// Nothing read yet of set `name`, whose shards have `shard_keys`.
    pub(super) fn new(name: &str, shard_keys: &[String]) -> Self {
        let mut read = Self {
            key: roster_key(name),
            members: BTreeMap::new(),
            last: None,
            keys: Arc::new([]),
        };
        read.shards_are(shard_keys);
        read
    }

    /// Notes the members `roster` names; when they are not those named before, the keys a read
    /// asks for are made again (with `shard_keys`).
    pub(super) fn note_members(&mut self, roster: &Observed, shard_keys: &[String]) {
        let members = roster
            .record
            .extensions
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(MEMBER_PREFIX).map(|key| (key, v)));
        if members
            .clone()
            .eq(self.members.iter().map(|(k, v)| (k.as_str(), v)))
        {
            return;
        }
        self.members = members.map(|(k, v)| (k.to_owned(), v.clone())).collect();
        self.shards_are(shard_keys);
    }

    /// The shards' keys changed (a resize): the keys a read asks for are made again.
    pub(super) fn shards_are(&mut self, shard_keys: &[String]) {
        let mut keys = Vec::with_capacity(1 + self.members.len() + shard_keys.len());
        keys.push(self.key.clone());
        keys.extend(self.members.keys().cloned());
        keys.extend(shard_keys.iter().cloned());
        self.keys = keys.into();
    }

    /// The keys a read asks for: the roster, its members, then every shard.
    pub(super) fn keys(&self) -> Arc<[String]> {
        self.keys.clone()
    }

    /// Where the shards begin among [`keys`](Self::keys).
    pub(super) fn first_shard(&self) -> usize {
        1 + self.members.len()
    }

    /// The members named by the last roster read: identity by member key.
    pub(super) fn members(&self) -> &BTreeMap<String, String> {
        &self.members
    }

    /// The roster as last read and checked.
    pub(super) fn last(&self) -> Option<&Observed> {
        self.last.as_ref()
    }

    /// Keeps `roster`, read and checked, as the last.
    pub(super) fn checked(&mut self, roster: &Observed) {
        self.last = Some(roster.clone());
    }
}
