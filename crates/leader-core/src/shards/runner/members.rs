//! The roster and the member records: the set's count checked, this member's record held,
//! another process with this identity noticed, live members found (and probed when their
//! records stand still), dead ones pruned, and the leave at shutdown.

use std::collections::{BTreeSet, HashMap};

use tokio::time::Instant;

use super::{ROSTER_LEASE, ROSTER_REFRESH, Runner};
use crate::leadership::StepDownReason;
use crate::lock::Acquisition;
use crate::metrics as m;
use crate::record::{LeaderElectionRecord, Observed, Version};
use crate::rules::{self, OtherTerm};
use crate::shards::{
    COUNT_EXTENSION, FENCED_EXTENSION, INCARNATION_EXTENSION, MEMBER_PREFIX, ShardsError,
    WEIGHT_EXTENSION, WINDOW_PREFIX, drained, member_key, roster_key, stored_count, windows,
};
use crate::status::IdentityConflict;

/// What a member knows of its own membership, and of the others' records.
pub(super) struct Membership {
    /// This process among those that ever ran with its identity: a random number drawn at its
    /// start, which its member record names under static membership.
    incarnation: String,
    /// The member record's term this process started, if any (S13).
    token: Option<u64>,
    /// A term of this identity's member record that this process did not start (S13).
    conflict: Option<OtherTerm>,
    /// The incarnation this process fenced last (static membership): written once.
    fenced: Option<String>,
    /// Whether a newer process of this identity fenced this one: it leaves the roster entry,
    /// which is that process's too.
    pub(super) stopped_by_fence: bool,
    /// When each other member's record was last found alive by the store's own word, where
    /// renewals leave the record as it is (see [`Runner::probe`]).
    probed: HashMap<String, Instant>,
    /// When this member first found each static member of the roster gone without leaving
    /// (its record's lease run out), for the member's window ([`Runner::absent`]).
    gone_since: HashMap<String, Instant>,
    /// Whether this member has seen the roster with its count (or created it): a count that
    /// differs afterwards is a resize, which it follows.
    counted: bool,
}

impl Membership {
    pub(super) fn new() -> Self {
        Self {
            incarnation: format!("{:016x}", fastrand::u64(..)),
            token: None,
            conflict: None,
            fenced: None,
            stopped_by_fence: false,
            probed: HashMap::new(),
            gone_since: HashMap::new(),
            counted: false,
        }
    }
}

impl Runner {
    /// Checks the roster (creates it, or joins it): the roster when this member may go on.
    pub(super) async fn check_roster(
        &mut self,
        roster: Option<Observed>,
    ) -> Result<Option<Observed>, ShardsError> {
        let name = self.cx.config.name.clone();
        let key = roster_key(&name);
        let my_entry = format!("{MEMBER_PREFIX}{}", member_key(&name, &self.cx.me));
        let Some(roster) = roster else {
            let now = self.cx.config.lease.wall_clock.now();
            // A roster this member has read and finds gone (deleted by hand, or dropped by the
            // store) is created again as last read, not with this member alone: its members,
            // its drains, its count, and what a later release wrote into it (S16).
            let last = self.roster.last().map(|last| &last.record);
            let recreating = last.is_some();
            let mut record = match last {
                Some(last) => LeaderElectionRecord {
                    holder_identity: String::new(),
                    lease_duration: ROSTER_LEASE,
                    acquire_time: now,
                    renew_time: now,
                    ..last.clone()
                },
                None => LeaderElectionRecord::new("", ROSTER_LEASE, now, 0),
            };
            record
                .extensions
                .insert(COUNT_EXTENSION.into(), self.cx.config.count.to_string());
            record.extensions.insert(my_entry, self.cx.me.clone());
            let (window_key, window) = self.window_entry();
            enter(&mut record, window_key, window);
            match self
                .request("create", &key, self.cx.lock(&key).create(&record))
                .await
            {
                Ok(created) if recreating => {
                    let members: Vec<&String> = created
                        .record
                        .extensions
                        .iter()
                        .filter(|(k, _)| k.starts_with(MEMBER_PREFIX))
                        .map(|(_, identity)| identity)
                        .collect();
                    tracing::warn!(
                        shards = name,
                        count = self.cx.config.count,
                        ?members,
                        drained = ?drained(&created.record),
                        roster = key,
                        "the shard set's roster was gone: created it again as this member last \
                         read it, with its members, drains and count"
                    );
                    self.roster.note_members(&created, &self.table.keys);
                }
                Ok(created) => {
                    self.membership.counted = true;
                    tracing::info!(
                        shards = name,
                        count = self.cx.config.count,
                        "created the shard set's roster"
                    );
                    self.roster.note_members(&created, &self.table.keys);
                }
                Err(err) if err.is_conflict() => {}
                Err(err) => self.cx.report("create", &err),
            }
            return Ok(None);
        };
        let stored = match stored_count(&name, &roster.record) {
            Ok(stored) => stored,
            Err(err) => {
                if self.problem.as_ref() != Some(&err) {
                    tracing::error!("{err}");
                }
                self.problem = Some(err);
                return Ok(None);
            }
        };
        if stored != self.cx.config.count {
            // A count that differs at the first sight of the roster is this replica's
            // mistake; once it has taken part, the set was resized.
            if !self.membership.counted {
                return Err(ShardsError::CountMismatch {
                    name,
                    stored,
                    ours: self.cx.config.count,
                    roster: key,
                });
            }
            // The shards are read again, at the new count, before anything is decided.
            self.roster.note_members(&roster, &self.table.keys);
            self.resize(stored);
            return Ok(None);
        }
        self.membership.counted = true;
        if matches!(self.problem, Some(ShardsError::InvalidRoster { .. })) {
            self.problem = None;
        }
        self.roster.note_members(&roster, &self.table.keys);
        let stale =
            self.cx.config.lease.wall_clock.now() - roster.record.renew_time > ROSTER_REFRESH;
        let joining = !roster.record.extensions.contains_key(&my_entry);
        let (window_key, window) = self.window_entry();
        let window_changed = roster.record.extensions.get(&window_key) != window.as_ref();
        if joining || stale || window_changed {
            let mut record = roster.record.clone();
            enter(&mut record, window_key, window);
            record.extensions.insert(my_entry, self.cx.me.clone());
            record.lease_duration = ROSTER_LEASE;
            record.renew_time = self.cx.config.lease.wall_clock.now();
            let stored = self.write_roster(&roster.version, &record).await;
            if stored.is_some() && joining {
                tracing::info!(shards = name, "joined the shard set's roster");
            }
            return Ok(stored);
        }
        Ok(Some(roster))
    }

    /// This member's static membership window as the roster holds it beside its entry: the
    /// key, and the value (none without static membership).
    fn window_entry(&self) -> (String, Option<String>) {
        let key = format!(
            "{WINDOW_PREFIX}{}",
            member_key(&self.cx.config.name, &self.cx.me)
        );
        let window = self.cx.config.static_membership.then(|| {
            self.cx
                .config
                .static_membership_window
                .as_millis()
                .to_string()
        });
        (key, window)
    }

    /// Takes this member's record when it does not hold it: a record of its identity that it
    /// did not write is another process's (S13), waited out as any other holder's.
    pub(super) async fn hold_member_record(&mut self, current: Option<Observed>) {
        if self.terms.member.is_some() {
            return;
        }
        let key = member_key(&self.cx.config.name, &self.cx.me);
        if let Some(current) = &current
            && self.check_identity(current)
        {
            self.fence(&key, current).await;
        }
        let claim = self.claim(&key, current).await;
        match self.note_claim(&key, claim) {
            Ok(Some((observed, started))) => {
                self.membership.token = Some(observed.record.leader_transitions);
                if self.membership.conflict.take().is_some() {
                    self.problem = None;
                    tracing::info!(
                        shards = self.cx.config.name,
                        "the other process with this identity is gone"
                    );
                }
                self.terms.member = Some(self.start_term(key, None, observed, started));
            }
            Ok(None) => {}
            Err(err) if err.is_conflict() => {}
            Err(err) => self.cx.report("acquire", &err),
        }
    }

    /// Writes this member's weight into its member record when the record holds another
    /// (none for the default of 1), so that the others read it: as the record's holder, since
    /// an acquisition in one request keeps the stored extensions, and a record taken by
    /// compare-and-swap carries the last holder's. Once; again on the next round if the
    /// write fails.
    pub(super) async fn publish_weight(&mut self) {
        let Some(term) = &self.terms.member else {
            return;
        };
        let wanted = [
            (
                WEIGHT_EXTENSION,
                (self.cx.config.weight != 1).then(|| self.cx.config.weight.to_string()),
            ),
            (
                INCARNATION_EXTENSION,
                self.cx
                    .config
                    .static_membership
                    .then(|| self.membership.incarnation.clone()),
            ),
        ];
        let stored = &term.observed.record.extensions;
        if wanted
            .iter()
            .all(|(key, value)| stored.get(*key) == value.as_ref())
        {
            return;
        }
        let mut record = rules::renewal(&term.observed.record, &self.cx.config.lease);
        for (key, value) in wanted {
            enter(&mut record, key.into(), value);
        }
        let (key, version) = (term.key.clone(), term.observed.version.clone());
        let result = self
            .request("update", &key, self.cx.lock(&key).update(&version, &record))
            .await;
        match (result, self.terms.member.as_mut()) {
            (Ok(stored), Some(term)) if term.observed.version == version => {
                term.observed = stored;
            }
            (Ok(_), _) => {}
            (Err(err), _) if err.is_conflict() => {}
            (Err(err), _) => self.cx.report("update", &err),
        }
    }

    /// S13: this identity's member record held by a term this process did not start, and seen
    /// renewed (or outliving its lease), is another process's: say so once. True when it is
    /// seen alive: under static membership this process then fences it ([`fence`](Self::fence)).
    pub(super) fn check_identity(&mut self, current: &Observed) -> bool {
        let record = &current.record;
        let key = member_key(&self.cx.config.name, &self.cx.me);
        // What a claim whose answer was lost wrote is this process's: the claim takes it.
        if !rules::started_elsewhere(record, &self.cx.me, self.membership.token)
            || self.wrote_unanswered(&key, record)
        {
            return false;
        }
        let token = record.leader_transitions;
        let now = Instant::now();
        match &mut self.membership.conflict {
            Some(other) if other.is(current) => {
                if other.seen_alive(
                    current,
                    self.learned.renews_in_store,
                    self.cx.config.lease.retry_period,
                    now,
                ) {
                    let conflict = IdentityConflict {
                        lock: format!(
                            "{} {}",
                            self.cx.set.describe(),
                            member_key(&self.cx.config.name, &self.cx.me)
                        ),
                        identity: self.cx.me.clone(),
                        fencing_token: token,
                    };
                    tracing::error!(shards = self.cx.config.name, "{conflict}");
                    m::identity_conflict(&self.cx.config.name);
                    self.problem = Some(ShardsError::IdentityConflict(conflict));
                }
                other.reported()
            }
            _ => {
                tracing::warn!(
                    shards = self.cx.config.name,
                    identity = self.cx.me,
                    fencing_token = token,
                    "this identity's member record is held by a term this process did not start: \
                     waiting for it as for another member's (another process may run with the same identity)"
                );
                self.membership.conflict = Some(OtherTerm::new(current, now, None));
                false
            }
        }
    }

    /// Under static membership, the older process holding this identity's member record (seen
    /// alive) is fenced, as Kafka fences the older consumer of a `group.instance.id`: the
    /// incarnation its record names is written into the record as fenced (a compare-and-swap
    /// that changes nothing else), and that process, on its next read, hands its shards to
    /// this identity and stops ([`ShardsError::Fenced`]). Once per incarnation; a process
    /// that names none (a release before static membership fenced) is waited out as before.
    async fn fence(&mut self, key: &str, current: &Observed) {
        let record = &current.record;
        let Some(older) = record.extensions.get(INCARNATION_EXTENSION) else {
            return;
        };
        if !self.cx.config.static_membership
            || *older == self.membership.incarnation
            || record.extensions.get(FENCED_EXTENSION) == Some(older)
            || self.membership.fenced.as_ref() == Some(older)
        {
            return;
        }
        let mut fenced = record.clone();
        fenced
            .extensions
            .insert(FENCED_EXTENSION.into(), older.clone());
        match self
            .request(
                "update",
                key,
                self.cx.lock(key).update(&current.version, &fenced),
            )
            .await
        {
            Ok(_) => {
                tracing::warn!(
                    shards = self.cx.config.name,
                    identity = self.cx.me,
                    fenced = older,
                    "another process holds this member's identity: static membership fences \
                     it, and it hands its shards to this one"
                );
                self.membership.fenced = Some(older.clone());
            }
            Err(err) if err.is_conflict() => {}
            Err(err) => self.cx.report("update", &err),
        }
    }

    /// Whether a newer process of this identity fenced this one ([`fence`](Self::fence)): the
    /// identity's member record, which this process held, names its incarnation as fenced.
    ///
    /// Whether this process still holds its term of the record does not matter: where the
    /// store ties a record to its writer's lease (etcd), the fence's write ends the older
    /// process's term before it reads the record, and that process, no longer holding it,
    /// would otherwise fence the newer in turn. Its incarnation is its own (drawn at its
    /// start), so only a process that fenced it names it.
    pub(super) fn check_fenced(&mut self, own: Option<&Observed>) -> Result<(), ShardsError> {
        let Some(own) = own else {
            return Ok(());
        };
        let record = &own.record;
        let fenced = self.cx.config.static_membership
            && self.membership.token.is_some()
            && record.is_held_by(&self.cx.me)
            && record.extensions.get(FENCED_EXTENSION) == Some(&self.membership.incarnation);
        if !fenced {
            return Ok(());
        }
        let err = ShardsError::Fenced {
            name: self.cx.config.name.clone(),
            identity: self.cx.me.clone(),
        };
        tracing::error!(shards = self.cx.config.name, "{err}");
        self.membership.stopped_by_fence = true;
        self.problem = Some(err.clone());
        Err(err)
    }

    /// The members alive: named by the roster, holding their member record, and not seen
    /// unchanged past its lease where renewals change the version. This member once it holds
    /// its own.
    pub(super) fn live_members(
        &self,
        members: &HashMap<String, Option<Observed>>,
    ) -> BTreeSet<String> {
        let mut live: BTreeSet<String> = members
            .iter()
            .filter(|(identity, observed)| {
                observed.as_ref().is_some_and(|o| {
                    o.record.is_held_by(identity)
                        && !(self.learned.renews_in_store == Some(false)
                            && self.expired(&member_key(&self.cx.config.name, identity), o))
                })
            })
            .map(|(identity, _)| identity.clone())
            .collect();
        live.remove(&self.cx.me);
        if self.terms.member.is_some() {
            live.insert(self.cx.me.clone());
        }
        live
    }

    /// The static members of `roster` found gone without leaving (a crash: their lease ran out
    /// while the roster still names them), within their window from when this member first
    /// found them so: their shards are kept for them, as a shutdown's are reserved, so that a
    /// process started again with their identity takes them back and none moves.
    pub(super) fn absent(
        &mut self,
        roster: &LeaderElectionRecord,
        live: &BTreeSet<String>,
    ) -> BTreeSet<String> {
        let now = Instant::now();
        let windows = windows(roster);
        let mut gone_since = HashMap::new();
        let mut absent = BTreeSet::new();
        for (key, identity) in self.roster.members() {
            let Some(&window) = windows.get(key.as_str()) else {
                continue;
            };
            if *identity == self.cx.me || live.contains(identity) {
                continue;
            }
            let since = self
                .membership
                .gone_since
                .get(identity)
                .copied()
                .unwrap_or(now);
            gone_since.insert(identity.clone(), since);
            if now < since + window {
                absent.insert(identity.clone());
            }
        }
        self.membership.gone_since = gone_since;
        absent
    }

    /// Where the store renews leases without changing the record, a record that looks held may
    /// belong to a member long dead, whose lease only the store knows ran out: asks the store
    /// ([`try_acquire`](ResourceLock::try_acquire)) about each other member at most once per
    /// lease, and lets go at once of a record it was given that way. Returns the members
    /// found dead.
    pub(super) async fn probe(
        &mut self,
        members: &HashMap<String, Option<Observed>>,
    ) -> BTreeSet<String> {
        let mut dead = BTreeSet::new();
        if self.learned.renews_in_store != Some(true)
            || self.cx.set.reads_show_expiry()
            || self.terms.member.is_none()
            || !self.learned.try_acquire
        {
            return dead;
        }
        let now = Instant::now();
        let lease = self.cx.config.lease.lease_duration;
        let due: Vec<(String, Observed)> = members
            .iter()
            .filter(|(identity, _)| **identity != self.cx.me)
            .filter_map(|(identity, observed)| {
                let observed = observed
                    .as_ref()
                    .filter(|o| o.record.is_held_by(identity))?;
                let last = self
                    .membership
                    .probed
                    .entry(identity.clone())
                    .or_insert(now);
                (now >= *last + lease).then(|| (identity.clone(), observed.clone()))
            })
            .collect();
        for (identity, observed) in due {
            let key = member_key(&self.cx.config.name, &identity);
            let lock = self.cx.lock(&key);
            // Above the record's token and every one seen of it (S5).
            let desired = match self.table.tokens(&key).next(&observed.record) {
                Ok(token) => self.desired(token, Some(&observed.record)),
                Err(err) => {
                    self.cx.report("try_acquire", &err);
                    continue;
                }
            };
            match self
                .request("try_acquire", &key, lock.try_acquire(&desired))
                .await
            {
                Ok(Some(
                    Acquisition::Acquired(taken)
                    | Acquisition::Handed {
                        observed: taken, ..
                    },
                )) => {
                    tracing::info!(
                        shards = self.cx.config.name,
                        member = identity,
                        "a member's lease ran out: it left or died"
                    );
                    self.table.note_token(&key, &taken.record);
                    let freed = LeaderElectionRecord {
                        holder_identity: String::new(),
                        ..taken.record.clone()
                    };
                    let _ = self
                        .request("release", &key, lock.update(&taken.version, &freed))
                        .await;
                    self.membership.probed.remove(&identity);
                    dead.insert(identity);
                }
                Ok(_) => {
                    self.membership.probed.insert(identity, Instant::now());
                }
                Err(err) => self.cx.report("try_acquire", &err),
            }
        }
        self.membership
            .probed
            .retain(|identity, _| members.contains_key(identity));
        dead
    }

    /// Removes from the roster the members whose record is gone, free, or (where renewals
    /// change the version) unchanged for twice its lease: members that left or died.
    pub(super) async fn prune(
        &mut self,
        roster: &Observed,
        members: &HashMap<String, Option<Observed>>,
        live: &BTreeSet<String>,
    ) {
        if self.terms.member.is_none() || self.learned.renews_in_store.is_none() {
            return;
        }
        let name = self.cx.config.name.clone();
        let gone: Vec<String> = members
            .iter()
            .filter(|(identity, observed)| {
                !live.contains(*identity)
                    && match observed {
                        None => true,
                        Some(o) => {
                            o.record.is_free()
                                || !o.record.is_held_by(identity)
                                || self
                                    .table
                                    .sighting(&member_key(&name, identity))
                                    .is_some_and(|s| {
                                        Instant::now() >= s.since() + o.record.lease_duration * 2
                                    })
                        }
                    }
            })
            .map(|(identity, _)| identity.clone())
            .collect();
        if gone.is_empty() {
            return;
        }
        let mut record = roster.record.clone();
        for identity in &gone {
            let key = member_key(&name, identity);
            record.extensions.remove(&format!("{MEMBER_PREFIX}{key}"));
            record.extensions.remove(&format!("{WINDOW_PREFIX}{key}"));
        }
        if self.write_roster(&roster.version, &record).await.is_some() {
            tracing::info!(shards = name, members = ?gone, "removed members that left from the roster");
        }
    }

    /// Writes the roster by compare-and-swap: the roster as stored, or `None` when another
    /// member wrote it first or the store failed (reported).
    pub(super) async fn write_roster(
        &mut self,
        version: &Version,
        record: &LeaderElectionRecord,
    ) -> Option<Observed> {
        let key = roster_key(&self.cx.config.name);
        match self
            .request("update", &key, self.cx.lock(&key).update(version, record))
            .await
        {
            Ok(stored) => {
                self.roster.note_members(&stored, &self.table.keys);
                Some(stored)
            }
            Err(err) => {
                if !err.is_conflict() {
                    self.cx.report("update", &err);
                }
                None
            }
        }
    }

    /// Shutdown: every shard's work stopped and its shard released (S6), reserved for this
    /// identity for the static membership window under static membership, then the member record and the roster entry.
    pub(super) async fn leave(&mut self) {
        let shards: Vec<u32> = self.terms.owned().keys().copied().collect();
        for shard in shards {
            if !self.cx.config.lease.release_on_cancel {
                self.end(shard, StepDownReason::Shutdown);
            } else if self.cx.config.static_membership {
                self.reserve(shard);
            } else {
                self.give(shard, None, StepDownReason::Shutdown);
            }
        }
        // A release is at most three requests, each within a request timeout: its write, a
        // read after a lost compare-and-swap, and its write again ([`rules::release_term`]).
        let bound = self.cx.config.lease.stop_grace + self.cx.config.lease.request_timeout * 3;
        self.releases.finish(bound).await;
        if !self.cx.config.lease.release_on_cancel {
            return;
        }
        // Fenced: the roster entry is the newer process's too.
        if self.membership.stopped_by_fence {
            self.release_member_record().await;
            return;
        }
        let name = self.cx.config.name.clone();
        let key = roster_key(&name);
        let member = member_key(&name, &self.cx.me);
        let entries = [
            format!("{MEMBER_PREFIX}{member}"),
            format!("{WINDOW_PREFIX}{member}"),
        ];
        for _ in 0..2 {
            let Ok(Some(roster)) = self.request("get", &key, self.cx.lock(&key).get()).await else {
                break;
            };
            let mut record = roster.record.clone();
            let removed = entries
                .iter()
                .filter(|entry| record.extensions.remove(*entry).is_some())
                .count();
            if removed == 0 {
                break;
            }
            if self.write_roster(&roster.version, &record).await.is_some() {
                break;
            }
        }
        self.release_member_record().await;
    }

    /// Releases this member's record (at shutdown).
    async fn release_member_record(&mut self) {
        if let Some(member) = self.terms.member.take() {
            member.cancel.cancel();
            // Released as a shard is (sent again after a passing failure, and over the
            // version read when a renewal whose answer was lost had moved it on): a member
            // record left held keeps this member counted, and its share of the shards
            // unclaimed, for a lease.
            let lock = &*self.cx.lock(&member.key);
            let key = member.key.as_str();
            let runner = &*self;
            let term_of = (runner.cx.me.as_str(), member.token());
            rules::release_term(
                Some(member.observed.clone()),
                term_of,
                self.cx.config.lease.request_timeout,
                |held| LeaderElectionRecord {
                    holder_identity: String::new(),
                    ..held.clone()
                },
                |version, record| async move {
                    runner
                        .request("release", key, lock.update(&version, &record))
                        .await
                },
                || runner.request("get", key, lock.get()),
            )
            .await;
        }
    }
}

/// Sets extension `key` of `record` to `value`, or removes it for none.
fn enter(record: &mut LeaderElectionRecord, key: String, value: Option<String>) {
    match value {
        Some(value) => record.extensions.insert(key, value),
        None => record.extensions.remove(&key),
    };
}
