//! Fan-out of change notifications, for backends that share one subscription among many locks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::broadcast;

use crate::lock::ChangeStream;

/// Hands the notifications of one subscription connection (Postgres `LISTEN`, Redis pub/sub) to
/// the followers of each channel, as [`ChangeStream`]s.
///
/// The backend's reader calls [`notify`](Self::notify) for every message and
/// [`close`](Self::close) when its connection is gone, which ends every stream so that the
/// followers subscribe again. A closed hub stays closed: a stream asked of it afterwards ends at
/// once, so that no follower waits on a hub nobody notifies any more, however its subscription
/// raced with the close. A backend makes a new hub for each new connection.
#[derive(Clone, Debug)]
pub struct ChangeHub {
    /// The channels' senders; `None` once closed.
    channels: Arc<Mutex<Option<Channels>>>,
}

/// Each channel's sender.
type Channels = HashMap<String, broadcast::Sender<()>>;

impl Default for ChangeHub {
    fn default() -> Self {
        Self::new()
    }
}

impl ChangeHub {
    /// An empty hub.
    pub fn new() -> Self {
        Self {
            channels: Arc::new(Mutex::new(Some(HashMap::new()))),
        }
    }

    fn channels(&self) -> MutexGuard<'_, Option<Channels>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True when someone subscribed to `channel` and the hub is open: the backend need not
    /// subscribe on the server again.
    pub fn contains(&self, channel: &str) -> bool {
        self.channels()
            .as_ref()
            .is_some_and(|channels| channels.contains_key(channel))
    }

    /// True once [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.channels().is_none()
    }

    /// A stream of the notifications on `channel`; one that ends at once when the hub is
    /// closed.
    pub fn subscribe(&self, channel: &str) -> ChangeStream {
        let rx = match self.channels().as_mut() {
            Some(channels) => channels
                .entry(channel.to_owned())
                .or_insert_with(|| broadcast::channel(16).0)
                .subscribe(),
            None => return Box::pin(futures_util::stream::empty()),
        };
        Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
            match rx.recv().await {
                Ok(()) | Err(broadcast::error::RecvError::Lagged(_)) => Some(((), rx)),
                Err(broadcast::error::RecvError::Closed) => None,
            }
        }))
    }

    /// Wakes the followers of `channel`.
    pub fn notify(&self, channel: &str) {
        if let Some(tx) = self.channels().as_ref().and_then(|c| c.get(channel)) {
            let _ = tx.send(());
        }
    }

    /// Wakes every follower, for when the backend may have missed messages.
    pub fn notify_all(&self) {
        for tx in self.channels().iter().flat_map(HashMap::values) {
            let _ = tx.send(());
        }
    }

    /// Ends every stream, for good: the subscription is gone.
    pub fn close(&self) {
        self.channels().take();
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::ChangeHub;

    #[tokio::test]
    async fn notifications_reach_their_channel_and_close_ends_streams() {
        let hub = ChangeHub::new();
        let mut a = hub.subscribe("a");
        let mut b = hub.subscribe("b");
        assert!(hub.contains("a") && !hub.contains("c"));
        hub.notify("a");
        assert_eq!(a.next().await, Some(()));
        hub.notify_all();
        assert_eq!(a.next().await, Some(()));
        assert_eq!(b.next().await, Some(()));
        hub.close();
        assert_eq!(a.next().await, None);
        assert!(!hub.contains("a") && hub.is_closed());
        // A subscription that raced with the close ends too, instead of waiting for good.
        let mut late = hub.subscribe("a");
        hub.notify("a");
        assert_eq!(late.next().await, None);
    }
}
