//! What a store keeps of the sweeps it has to make (the sweeping itself is in the session
//! module), apart from the store so that the store holds it without depending on sessions.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use tokio::time::Instant;

/// The sweeps a store has to make: sessions left behind for a key, destroyed a lease into a
/// term of this process on that key (see [`sweep_later`](crate::session::sweep_later)). One task per store makes them, a
/// few at a time: a shard set's member that takes a thousand shards schedules a thousand
/// sweeps, which cost one list of the node's sessions and one read of the keys per batch due,
/// instead of a list of every session of the datacenter per shard.
#[derive(Debug, Default)]
pub(crate) struct Sweeper {
    pending: Mutex<Pending>,
}

impl Sweeper {
    /// The sweeps due, locked; a panic while another held them leaves them usable.
    pub(crate) fn lock_pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The sweeps due, and the sweeping task's state.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// By key: this process's session that locked it, the raft index it locked it at, and
    /// when to sweep.
    pub(crate) keys: HashMap<String, Due>,
    /// Whether the store's sweeping task runs.
    pub(crate) running: bool,
    /// The node of the store's sessions, once known.
    pub(crate) node: Option<String>,
}

/// One key's sweep: the session of this process that locked it, at which raft index, and
/// when to sweep.
#[derive(Debug)]
pub(crate) struct Due {
    pub(crate) ours: String,
    pub(crate) locked_at: u64,
    pub(crate) at: Instant,
}
