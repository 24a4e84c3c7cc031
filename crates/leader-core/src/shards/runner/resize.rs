//! A change of the shard count while the set runs ([`resize_shard_set`](crate::resize_shard_set)): the
//! shards added are taken as any free shard, those removed have their work stopped and are
//! released, and nobody takes them again while it follows the new count.

use super::Runner;
use crate::leadership::StepDownReason;

impl Runner {
    /// Follows the roster's new `count`: ends and releases the shards owned past it (their
    /// work stopped first, S6) and reads the set again at the new count before acting.
    pub(super) fn resize(&mut self, count: u32) {
        tracing::info!(
            shards = self.cx.config.name,
            from = self.cx.config.count,
            to = count,
            "the shard set was resized"
        );
        let removed: Vec<u32> = self.terms.owned().range(count..).map(|(&s, _)| s).collect();
        for shard in removed {
            self.give(shard, None, StepDownReason::Resized);
        }
        self.work_requests.forget_give_ups_from(count);
        self.table.resize(count);
        self.cx.config.count = count;
        // Told after the terms past the count were ended: work that sees the new count finds
        // the removed shards' work already told to stop.
        self.cx.count.send_replace(count);
        self.roster.shards_are(&self.table.keys);
        self.unsettle();
        self.terms.republish();
    }
}
