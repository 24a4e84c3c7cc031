//! A round's read of the set (its roster, the member records, the shards, or only what changed)
//! and what the member does about it: take, give, hold or leave.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use tokio::time::Instant;

use super::{Runner, Unreadable, View};
use crate::error::LockError;
use crate::leadership::StepDownReason;
use crate::rules;
use crate::shards::assign::{gifts, shares};
use crate::shards::{Known, Reread, ShardsError, drained, weight_in};

/// A read of every shard is followed by at least this many times as long without one: a
/// member that has not settled spends a tenth of its time at most reading the whole set, and
/// a loaded store, whose reads take longer, is read less. Reading at once on every change
/// instead (each shard given is one) ended terms by their deadline on two busy cores.
const FULL_READ_PACE: u32 = 10;

/// When a member reads every shard again: what the last such read found, and when the next
/// is due and allowed.
pub(super) struct Pace {
    /// True while the last read of every shard found nothing to do, here or anywhere (see
    /// [`Runner::act`]), and nothing changed since: rounds read the roster and the members
    /// alone, and the shards once per half a lease.
    settled: bool,
    /// The members present (alive, or static members gone within their window) as of the
    /// last read of every shard.
    settled_live: BTreeSet<String>,
    /// The members the roster drains, as last read.
    drains: Vec<String>,
    /// When the shards must be read again, settled or not.
    full_read_due: Instant,
    /// The earliest the shards may be read again: the last read of every shard paced by what
    /// it took ([`FULL_READ_PACE`]).
    full_read_floor: Instant,
}

impl Pace {
    /// Nothing read yet: every shard is read on the first round.
    pub(super) fn new() -> Self {
        let now = Instant::now();
        Self {
            settled: false,
            settled_live: BTreeSet::new(),
            drains: Vec::new(),
            full_read_due: now,
            full_read_floor: now,
        }
    }
}

impl Runner {
    /// Whether this round reads every shard: half a lease after the last such read, or sooner
    /// while the set is not settled and the claims that read called for are made; never
    /// before the pace of these reads allows ([`FULL_READ_PACE`]).
    pub(super) fn full_read_wanted(&self) -> bool {
        let now = Instant::now();
        now >= self.pace.full_read_floor
            && (now >= self.pace.full_read_due || (!self.pace.settled && self.plan.is_none()))
    }

    /// The set is no longer as the last read of every shard found it (a shard given or ended
    /// here, say): the claims that read called for are dropped, and the next round allowed by
    /// the pace of these reads ([`FULL_READ_PACE`]) reads every shard again.
    pub(super) fn unsettle(&mut self) {
        self.pace.settled = false;
        self.plan = None;
    }

    /// Reads the roster, the member records it named last time and (`full`) every shard, in
    /// one batch; the shards with the versions last read, so that the store may answer those
    /// unchanged without sending them ([`LockSet::get_changed`]). With `renew`, this round's
    /// renewals go first, in the same request where the store allows it
    /// ([`LockSet::renew_and_read`]).
    pub(super) async fn read(&mut self, full: bool, renew: bool) -> Result<View, LockError> {
        let (renewals, whose) = if renew {
            self.renewals()
        } else {
            Default::default()
        };
        let keys = self.roster.keys();
        // A round dropped while it acted (see `act`) took the records along.
        self.table.restore_records();
        let first_shard = self.roster.first_shard();
        let asked = if full {
            &keys[..]
        } else {
            &keys[..first_shard]
        };
        let known: Vec<Known<'_>> = std::iter::repeat_n(Known::Nothing, first_shard)
            .chain(
                self.table
                    .records
                    .iter()
                    .zip(&self.table.read)
                    .map(|(record, &read)| match record {
                        _ if !read => Known::Nothing,
                        None => Known::Absent,
                        Some(observed) => Known::Version(&observed.version),
                    })
                    .take(asked.len() - first_shard),
            )
            .collect();
        let started = Instant::now();
        let renewing = !renewals.is_empty();
        let results = if !renewing {
            // A read alone waits no longer than the terms can: the next round's renewals go
            // out a retry period before the first deadline, whatever a slow store makes of a
            // read of every shard (the read fails and backs off; the set rebalances later).
            let mut until = started + self.cx.config.lease.request_timeout;
            if let Some(first) = self.terms.first_deadline() {
                until = until.min(first - self.cx.config.lease.retry_period);
            }
            tokio::time::timeout_at(until, self.cx.set.get_changed(asked, &known)).await
        } else {
            let answer = tokio::time::timeout(
                self.cx.config.lease.request_timeout,
                self.cx.set.renew_and_read(&renewals, asked, &known),
            )
            .await;
            drop(known);
            match answer {
                Ok(answer) => {
                    self.renewed(whose, answer.renewed, started).await;
                    Ok(answer.read)
                }
                Err(elapsed) => {
                    // Reported once, below, as the one request it was.
                    self.renewals_took = started.elapsed();
                    Err(elapsed)
                }
            }
        };
        if full {
            // The next read of every shard waits as many times as long as this one took.
            let now = Instant::now();
            self.pace.full_read_floor = now + (now - started) * FULL_READ_PACE;
        }
        let results = match results {
            Ok(results) if results.len() == asked.len() => results,
            Ok(_) => return Err(self.cx.miscounted()),
            Err(_) => {
                return Err(LockError::Timeout {
                    lock: self.cx.set.describe(),
                    operation: if renewing { "renew and read" } else { "get" },
                    after: started.elapsed(),
                });
            }
        };
        // A store that fails as a whole answers every key with the same error: the read
        // failed (and backs off). Otherwise each record stands on its own: one that cannot be
        // read is reported and left alone, and the rest of the set goes on (S8).
        if results
            .iter()
            .all(|r| matches!(r, Err(e) if !matches!(e, LockError::InvalidRecord { .. })))
        {
            let err = results.into_iter().find_map(Result::err);
            return Err(err.unwrap_or_else(|| {
                LockError::unavailable("shards", "a batch read answered nothing".to_owned())
            }));
        }
        let identities: Vec<String> = self.roster.members().values().cloned().collect();
        let mut roster = Err(Unreadable);
        let mut members = HashMap::with_capacity(identities.len());
        let mut unreadable_members = BTreeSet::new();
        for (i, (key, result)) in asked.iter().zip(results).enumerate() {
            let answer = match (result, i < first_shard) {
                // Never asked with a version: a store that says so anyway is read again next
                // round.
                (Ok(Reread::Same), true) => Err(LockError::unavailable(
                    "shards",
                    format!(
                        "{}: {key} answered unchanged unasked",
                        self.cx.set.describe()
                    ),
                )),
                (result, _) => result,
            };
            match (i.checked_sub(first_shard), answer) {
                // The shards come in order, after the roster and the members.
                (Some(shard), Ok(answer)) => {
                    self.table.read_ok(shard, answer);
                    self.cx.note_readable(key);
                }
                (Some(shard), Err(err)) => {
                    self.table.read_failed(shard);
                    self.cx.report_unreadable(key, &err);
                }
                (None, Ok(answer)) => {
                    let observed = match answer {
                        Reread::Now(observed) => observed,
                        Reread::Same => None,
                    };
                    self.table.observe(key, observed.as_ref());
                    self.cx.note_readable(key);
                    match i.checked_sub(1).and_then(|m| identities.get(m)) {
                        None => roster = Ok(observed),
                        Some(identity) => {
                            members.insert(identity.clone(), observed);
                        }
                    }
                }
                (None, Err(err)) => {
                    self.cx.report_unreadable(key, &err);
                    if let Some(identity) = i.checked_sub(1).and_then(|m| identities.get(m)) {
                        unreadable_members.insert(identity.clone());
                    }
                }
            }
        }
        Ok(View {
            roster,
            members,
            unreadable_members,
            shards: full,
        })
    }

    /// Acts on a read: the roster, this member's record, then the shares.
    pub(super) async fn act(&mut self, view: View) -> Result<(), ShardsError> {
        // An unreadable roster is taken as last read, and never written meanwhile (no join,
        // no prune): the members go on with what they knew.
        let (roster, roster_read) = match view.roster {
            Ok(roster) => {
                let Some(roster) = self.check_roster(roster).await? else {
                    self.unsettle();
                    return Ok(());
                };
                self.roster.checked(&roster);
                (roster, true)
            }
            Err(Unreadable) => match self.roster.last().cloned() {
                Some(roster) => (roster, false),
                None => {
                    self.unsettle();
                    return Ok(());
                }
            },
        };
        // This member's own record unreadable: left alone, as any other.
        if !view.unreadable_members.contains(&self.cx.me) {
            let own = view.members.get(&self.cx.me).cloned().flatten();
            self.check_fenced(own.as_ref())?;
            self.hold_member_record(own).await;
        }
        self.publish_weight().await;
        // A member whose record cannot be read is not known alive: its shards are taken once
        // their own leases run out, as a dead member's (S2 on each shard).
        let dead = self.probe(&view.members).await;
        let mut live = self.live_members(&view.members);
        live.retain(|m| !dead.contains(m));
        self.balance.live = live.len();
        // Static members gone without leaving, within their window: in the shares with the
        // shards they hold, which nobody takes meanwhile; given nothing.
        let absent = self.absent(&roster.record, &live);
        let present: BTreeSet<String> = live.union(&absent).cloned().collect();
        if roster_read {
            self.prune(&roster, &view.members, &present).await;
        }
        if self.terms.member.is_none() {
            self.unsettle();
            return Ok(());
        }
        self.releases.reap();
        // A member drained or undrained changes the shares: the shards are read at once.
        let drained = drained(&roster.record);
        if !drained
            .iter()
            .copied()
            .eq(self.pace.drains.iter().map(String::as_str))
        {
            self.pace.drains = drained.iter().map(|&d| d.to_owned()).collect();
            self.unsettle();
        }
        if !view.shards {
            // A member that died is seen by its record (read every round); its shards' last
            // versions by the next full read, half a lease at most after its last renewal.
            if present != self.pace.settled_live {
                self.unsettle();
            }
            // The claims the last read of every shard called for go on while the members
            // stay as it found them.
            if self.plan.is_some() {
                let shards = std::mem::take(&mut self.table.records);
                self.claim_planned(&shards).await;
                self.table.records = shards;
            }
            return Ok(());
        }
        // Out of `self` while this round acts on it (put back below; nothing returns early).
        let view_shards = std::mem::take(&mut self.table.records);
        let count = self.cx.config.count;
        let mut owners: BTreeMap<String, Vec<u32>> =
            present.iter().map(|m| (m.clone(), Vec::new())).collect();
        // One pass over the shards sorts them out: a live member's; this member's though it holds
        // no term of them (lapsed: a term that ended by its deadline, say; the others count them as
        // this member's, so it does too, and takes them again, since nobody else would: once their
        // lease has run out, counted as any holder's (S13: the member keeps no token of the terms
        // it started), or at once where they hold what a claim of its own whose answer was lost
        // wrote); or open (absent, free, or held by a member not alive), which this member may
        // take. A shard this member gave up, or whose term ended, is none of these until its
        // release ends or its work stopped: counted as lapsed, it would be given or taken again
        // beside the work still running. A shard whose work gave it up here is not taken again
        // before its back-off ends (held back, if its record still names this member).
        let now = Instant::now();
        self.work_requests.forget_old_give_ups(now);
        let mut lapsed: Vec<u32> = Vec::new();
        let mut held_back: Vec<u32> = Vec::new();
        let mut open: Vec<u32> = Vec::new();
        // Free shards reserved for a live member (handed to it, or kept for it across its
        // restart) count as its own where the shares are ranked: the member about to take
        // them back keeps the place in the shares their number gives it.
        let mut reserved: BTreeMap<&str, usize> = BTreeMap::new();
        // Shards whose record cannot be read: nobody's as far as this read shows, left out of
        // the shares, so that the others settle around them.
        let mut unknown = 0u32;
        for (shard, observed) in (0..count).zip(&view_shards) {
            if self.terms.owned().contains_key(&shard) || self.releases.contains(shard) {
                continue;
            }
            if self.table.unreadable.contains(&shard) {
                unknown += 1;
                continue;
            }
            let holder = observed
                .as_ref()
                .map(|o| o.record.holder_identity.as_str())
                .filter(|h| !h.is_empty());
            // Deleted by the store under a static member gone within its window: its own.
            if observed.is_none()
                && let Some(list) = self
                    .table
                    .vanished
                    .get(&shard)
                    .filter(|holder| absent.contains(*holder))
                    .and_then(|holder| owners.get_mut(holder))
            {
                list.push(shard);
                continue;
            }
            // S2: a record found gone under another member's lease is still that member's
            // until the lease ends on this member's clock, unless the store deletes records
            // when their lease runs out (that deletion is the expiry, by the store's clock) or
            // no claim can take a live holder's shard, record or not ([`rules::reads_first`]).
            if observed.is_none()
                && !self.store_keeps_leases()
                && let Some(gone) = self.table.gone_holder(shard, now)
                && rules::reads_first(
                    self.cx
                        .lock(&self.table.keys[shard as usize])
                        .holder_check(),
                )
            {
                if let Some(list) = owners.get_mut(gone) {
                    list.push(shard);
                }
                continue;
            }
            let backing_off = self.backing_off(shard);
            match holder {
                Some(holder) if holder == self.cx.me && backing_off => held_back.push(shard),
                Some(holder) if holder == self.cx.me => lapsed.push(shard),
                Some(holder) => match owners.get_mut(holder) {
                    Some(list) => list.push(shard),
                    None if backing_off => {}
                    None => open.push(shard),
                },
                None => {
                    if let Some(to) = observed.as_ref().and_then(|o| o.record.handover_to()) {
                        *reserved.entry(to).or_default() += 1;
                    }
                    if !backing_off {
                        open.push(shard);
                    }
                }
            }
        }
        let mine = self
            .terms
            .owned()
            .keys()
            .chain(&lapsed)
            .chain(&held_back)
            .copied();
        owners.insert(self.cx.me.clone(), mine.collect());
        let counts = owners
            .iter()
            .filter(|(m, _)| !absent.contains(*m))
            .map(|(m, s)| {
                let reserved = reserved.get(m.as_str()).copied().unwrap_or(0);
                (m.clone(), s.len() + reserved)
            })
            .collect();
        // Each member's weight: 0 when the roster drains it, else as its record says (this
        // member's own from its configuration).
        let weight_of = |member: &str| -> u32 {
            if drained.contains(member) {
                0
            } else if member == self.cx.me {
                self.cx.config.weight
            } else {
                view.members
                    .get(member)
                    .and_then(Option::as_ref)
                    .map_or(1, |o| weight_in(&o.record))
            }
        };
        let drained_here = weight_of(&self.cx.me) == 0;
        // An absent member's share is what it holds; the live share the rest.
        let kept_for_absent: usize = absent
            .iter()
            .filter_map(|m| owners.get(m))
            .map(Vec::len)
            .sum();
        let mut shares = shares(
            (count - unknown).saturating_sub(u32::try_from(kept_for_absent).unwrap_or(u32::MAX)),
            &counts,
            weight_of,
        );
        shares.extend(
            absent
                .iter()
                .map(|m| (m.clone(), owners.get(m).map_or(0, Vec::len))),
        );
        let counts = owners
            .iter()
            .filter(|(m, _)| !absent.contains(*m))
            .map(|(_, owned)| owned.len());
        self.balance.imbalance = counts.clone().max().unwrap_or(0) - counts.min().unwrap_or(0);
        let at_shares = owners
            .iter()
            .all(|(member, owned)| shares.get(member) == Some(&owned.len()));
        // Only a shard this member holds a term of can be handed over (its work stopped, then
        // its record released to the receiver). A lapsed shard counts towards this member's
        // surplus but is retaken first, and given in a later round if still surplus.
        let mut gifts = gifts(&self.cx.me, &owners, &shares);
        gifts.retain(|(shard, _)| self.terms.owned().contains_key(shard));
        let share = shares.get(&self.cx.me).copied().unwrap_or(0);
        // Distinct shards, all owned: no more gifts than shards owned.
        let kept = self.terms.owned().len() - gifts.len() + lapsed.len() + held_back.len();
        let room = share.saturating_sub(kept);
        // Nothing to do, here or (as far as this read shows) anywhere: every shard owned by a
        // live member, each at its share. Until the members or this member's shards change,
        // the next rounds read the roster and the members alone.
        let idle = gifts.is_empty()
            && room == 0
            && lapsed.is_empty()
            && open.is_empty()
            && self.releases.is_empty()
            && !self.work_requests.any_backing_off(now);
        self.pace.settled = idle && at_shares;
        self.pace.settled_live = present;
        self.pace.full_read_due = Instant::now() + self.cx.config.lease.lease_duration / 2;
        for (shard, to) in gifts {
            self.give(shard, Some(&to), StepDownReason::HandedOver);
        }
        let drained = drained_here && share == 0;
        self.take(room, &lapsed, &open, &view_shards, drained).await;
        self.table.records = view_shards;
        Ok(())
    }
}
