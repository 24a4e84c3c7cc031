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
/// followers subscribe again.
#[derive(Clone, Debug, Default)]
pub struct ChangeHub {
    channels: Arc<Mutex<HashMap<String, broadcast::Sender<()>>>>,
}

impl ChangeHub {
    /// An empty hub.
    pub fn new() -> Self {
        Self::default()
    }

    fn channels(&self) -> MutexGuard<'_, HashMap<String, broadcast::Sender<()>>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True when someone subscribed to `channel` since the last [`close`](Self::close): the
    /// backend need not subscribe on the server again.
    pub fn contains(&self, channel: &str) -> bool {
        self.channels().contains_key(channel)
    }

    /// A stream of the notifications on `channel`.
    pub fn subscribe(&self, channel: &str) -> ChangeStream {
        let rx = self
            .channels()
            .entry(channel.to_owned())
            .or_insert_with(|| broadcast::channel(16).0)
            .subscribe();
        Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
            match rx.recv().await {
                Ok(()) | Err(broadcast::error::RecvError::Lagged(_)) => Some(((), rx)),
                Err(broadcast::error::RecvError::Closed) => None,
            }
        }))
    }

    /// Wakes the followers of `channel`.
    pub fn notify(&self, channel: &str) {
        if let Some(tx) = self.channels().get(channel) {
            let _ = tx.send(());
        }
    }

    /// Wakes every follower, for when the backend may have missed messages.
    pub fn notify_all(&self) {
        for tx in self.channels().values() {
            let _ = tx.send(());
        }
    }

    /// Ends every stream: the subscription is gone.
    pub fn close(&self) {
        self.channels().clear();
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
        assert!(!hub.contains("a"));
    }
}
