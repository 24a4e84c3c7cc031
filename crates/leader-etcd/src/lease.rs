//! The kept etcd lease: granted with a TTL of the lease duration, kept alive one message at a
//! time on the member the store talks to (moving to the next member when that one does not
//! answer in time), revoked in the background when given up.

use std::time::Duration;

use etcd_client::{Error, LeaseKeepAliveStream, LeaseKeeper};
use tokio::time::Instant;

use crate::members::{member_failed, timed_out};
use crate::store::EtcdStore;

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
    /// The keep-alive stream, on one member; opened on the first keep-alive, and again on the
    /// next member when that one fails.
    stream: Option<KeepAlive>,
    /// When etcd last confirmed it alive for its whole TTL: the sending of that request (etcd
    /// restarts the TTL when the request arrives, later).
    pub(crate) alive_since: Instant,
}

/// A keep-alive stream on member `member`.
struct KeepAlive {
    member: usize,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
    /// Keep-alives sent whose answers were not read (their callers gave up waiting).
    unanswered: usize,
}

impl KeepAlive {
    /// One keep-alive on this stream: `true` if the lease is still alive, with when it was sent.
    ///
    /// Answers carry no request id, so the answers to keep-alives whose callers gave up (a
    /// timeout) are read and dropped first: an answer is never taken for a later request's.
    async fn once(&mut self) -> Result<(bool, Instant), Error> {
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
        Ok((answer.is_some_and(|r| r.ttl() > 0), sent))
    }
}

impl KeptLease {
    /// Grants a lease for `lease_duration` (on the next member if the current one fails: a
    /// lease granted twice is harmless, the unused one runs out).
    pub(crate) async fn grant(store: &EtcdStore, lease_duration: Duration) -> Result<Self, Error> {
        let ttl = ttl(lease_duration);
        let sent = Instant::now();
        let granted = store
            .inner
            .members
            .call(true, |mut client| async move {
                client.lease_grant(ttl, None).await
            })
            .await?;
        Ok(Self {
            id: granted.id(),
            ttl,
            stream: None,
            alive_since: sent,
        })
    }

    /// One keep-alive: `true` if the lease is still alive. Sent to the member the store talks
    /// to; when that member does not answer within the member timeout, or fails, the stream is
    /// opened again on the next member and the keep-alive sent there (once round the cluster).
    pub(crate) async fn keep_alive(&mut self, store: &EtcdStore) -> Result<bool, Error> {
        let members = &store.inner.members;
        let mut last = None;
        for _ in 0..members.len() {
            let index = members.current();
            let attempt =
                tokio::time::timeout(members.member_timeout(), self.keep_alive_on(store, index));
            let err = match attempt.await {
                Ok(Ok(alive)) => return Ok(alive),
                Ok(Err(err)) if !member_failed(&err) => return Err(err),
                Ok(Err(err)) => err,
                Err(_) => timed_out(&store.inner.endpoints, members.member_timeout()),
            };
            self.stream = None;
            members.skip(index);
            last = Some(err);
        }
        Err(last.unwrap_or_else(|| Error::InvalidArgs("no etcd endpoint".to_owned())))
    }

    async fn keep_alive_on(&mut self, store: &EtcdStore, index: usize) -> Result<bool, Error> {
        let stream = match &mut self.stream {
            Some(stream) if stream.member == index => stream,
            _ => {
                let mut client = store.inner.members.client(index).await?;
                let (keeper, stream) = client.lease_keep_alive(self.id).await?;
                self.stream.insert(KeepAlive {
                    member: index,
                    keeper,
                    stream,
                    unanswered: 0,
                })
            }
        };
        let (alive, sent) = stream.once().await?;
        if alive {
            self.alive_since = sent;
        }
        Ok(alive)
    }

    /// Revokes the lease in the background, best effort (a lease not revoked runs out on its
    /// own); the keys on it go with it.
    pub(crate) fn revoke_later(&self, store: &EtcdStore) {
        let (store, lease) = (store.clone(), self.id);
        tokio::spawn(async move {
            let _ = store
                .inner
                .members
                .call(true, |mut client| async move {
                    client.lease_revoke(lease).await
                })
                .await;
        });
    }
}
