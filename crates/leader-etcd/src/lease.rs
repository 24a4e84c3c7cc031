//! The kept etcd lease: granted with a TTL of the lease duration, kept alive one message at a
//! time, revoked in the background when given up.

use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use tokio::time::Instant;

/// The etcd lease TTL for a lease duration: whole seconds, rounded up, at least 1.
pub(crate) fn ttl(lease_duration: Duration) -> i64 {
    i64::try_from(lease_duration.as_millis().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

/// An etcd lease with its keep-alive stream.
pub(crate) struct KeptLease {
    pub(crate) id: i64,
    pub(crate) ttl: i64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
    /// When etcd last confirmed it alive for its whole TTL: the sending of that request (etcd
    /// restarts the TTL when the request arrives, later).
    pub(crate) alive_since: Instant,
    /// Keep-alives sent whose answers were not read (their callers gave up waiting).
    unanswered: usize,
}

impl KeptLease {
    /// Grants a lease for `lease_duration` and opens its keep-alive stream.
    pub(crate) async fn grant(
        client: &mut Client,
        lease_duration: Duration,
    ) -> Result<Self, etcd_client::Error> {
        let ttl = ttl(lease_duration);
        let sent = Instant::now();
        let granted = client.lease_grant(ttl, None).await?;
        let (keeper, stream) = client.lease_keep_alive(granted.id()).await?;
        Ok(Self {
            id: granted.id(),
            ttl,
            keeper,
            stream,
            alive_since: sent,
            unanswered: 0,
        })
    }

    /// One keep-alive: `true` if the lease is still alive.
    ///
    /// Answers carry no request id, so the answers to keep-alives whose callers gave up (a
    /// timeout) are read and dropped first: an answer is never taken for a later request's.
    pub(crate) async fn keep_alive(&mut self) -> Result<bool, etcd_client::Error> {
        while self.unanswered > 0 {
            self.stream.message().await?;
            self.unanswered -= 1;
        }
        let sent = Instant::now();
        // A send that does not complete sends nothing (the channel's send is cancel-safe).
        self.keeper.keep_alive().await?;
        self.unanswered += 1;
        let answer = self.stream.message().await?;
        self.unanswered -= 1;
        let alive = answer.is_some_and(|r| r.ttl() > 0);
        if alive {
            self.alive_since = sent;
        }
        Ok(alive)
    }

    /// Revokes the lease in the background, best effort (a lease not revoked runs out on its
    /// own); the keys on it go with it.
    pub(crate) fn revoke_later(&self, client: &Client) {
        let (mut client, lease) = (client.clone(), self.id);
        tokio::spawn(async move {
            let _ = client.lease_revoke(lease).await;
        });
    }
}
