//! The terms a member holds: its member record's and its shards', with whether the shards it
//! owns changed since its state was last published.

use std::collections::BTreeMap;

use tokio::time::Instant;

use super::Term;

/// The member record's term and each shard's, by shard number. A shard's term goes in and out
/// only through [`insert`](Self::insert) and [`remove`](Self::remove), which note that the
/// shards owned changed: the state published next shows them.
pub(super) struct Terms {
    /// The member record's term, while this member holds its record.
    pub(super) member: Option<Term>,
    /// Each shard's term.
    owned: BTreeMap<u32, Term>,
    /// Whether the shards owned changed since the state was last published.
    changed: bool,
}

impl Terms {
    /// No term yet; the first state published shows no shard.
    pub(super) fn new() -> Self {
        Self {
            member: None,
            owned: BTreeMap::new(),
            changed: true,
        }
    }

    /// The shards' terms.
    pub(super) fn owned(&self) -> &BTreeMap<u32, Term> {
        &self.owned
    }

    /// The shards' terms, each to change (none comes or goes).
    pub(super) fn owned_mut(&mut self) -> impl Iterator<Item = (u32, &mut Term)> {
        self.owned.iter_mut().map(|(&shard, term)| (shard, term))
    }

    /// `shard`'s term begins.
    pub(super) fn insert(&mut self, shard: u32, term: Term) {
        self.owned.insert(shard, term);
        self.changed = true;
    }

    /// `shard`'s term ends: taken out, if it was held.
    pub(super) fn remove(&mut self, shard: u32) -> Option<Term> {
        let term = self.owned.remove(&shard)?;
        self.changed = true;
        Some(term)
    }

    /// Publishes the shards owned with the next state, changed or not.
    pub(super) fn republish(&mut self) {
        self.changed = true;
    }

    /// Whether the shards owned changed since this was last asked.
    pub(super) fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The term of `whose`: a shard's, or (`None`) the member record's.
    pub(super) fn get(&self, whose: Option<u32>) -> Option<&Term> {
        match whose {
            Some(shard) => self.owned.get(&shard),
            None => self.member.as_ref(),
        }
    }

    /// The term of `whose`, to change.
    pub(super) fn get_mut(&mut self, whose: Option<u32>) -> Option<&mut Term> {
        match whose {
            Some(shard) => self.owned.get_mut(&shard),
            None => self.member.as_mut(),
        }
    }

    /// Every term with whose it is (`None`: the member record's), the member record's first.
    pub(super) fn iter(&self) -> impl Iterator<Item = (Option<u32>, &Term)> {
        let member = self.member.iter().map(|term| (None, term));
        member.chain(self.owned.iter().map(|(&shard, term)| (Some(shard), term)))
    }

    /// The earliest deadline of the terms held, if any is.
    pub(super) fn first_deadline(&self) -> Option<Instant> {
        self.iter().map(|(_, term)| *term.deadline.borrow()).min()
    }
}
