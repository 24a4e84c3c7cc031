//! The kept etcd lease: granted with a TTL of the lease duration, kept alive one message at a
//! time on the member the store talks to (and on the others when that one does not answer in
//! time), revoked in the background when given up.

use std::time::Duration;

use etcd_client::{Error, LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::store::EtcdStore;

/// The etcd lease TTL for a lease duration: whole seconds, rounded up, at least 1.
pub(crate) fn ttl(lease_duration: Duration) -> i64 {
    i64::try_from(lease_duration.as_millis().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

/// An etcd lease with its keep-alive streams.
pub(crate) struct KeptLease {
    pub(crate) id: i64,
    pub(crate) ttl: i64,
    /// A keep-alive stream per member, opened when first used there (and again after it broke).
    streams: Vec<Mutex<Option<KeepAlive>>>,
    /// When etcd last confirmed it alive for its whole TTL: the sending of that request (etcd
    /// restarts the TTL when the request arrives, later).
    pub(crate) alive_since: Instant,
}

/// A keep-alive stream on one member.
struct KeepAlive {
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
    /// Keep-alives sent whose answers were not read (their callers gave up waiting): 0 or 1,
    /// since such a stream is replaced.
    unanswered: usize,
}

impl KeepAlive {
    /// One keep-alive on this stream: `true` if the lease is still alive, with when it was sent.
    ///
    /// Answers carry no request id, so the answers to keep-alives whose callers gave up (a
    /// timeout) are read and dropped first: an answer is never taken for a later request's.
    ///
    /// A stream that ended (its member went away) is a failure of the member, not an answer
    /// that the lease is gone: the keep-alive goes to the other members.
    async fn once(&mut self) -> Result<(bool, Instant), Error> {
        while self.unanswered > 0 {
            self.answer().await?;
            self.unanswered -= 1;
        }
        let sent = Instant::now();
        // A send that does not complete sends nothing (the channel's send is cancel-safe).
        self.keeper.keep_alive().await?;
        self.unanswered += 1;
        let answer = self.answer().await?;
        self.unanswered -= 1;
        Ok((answer.ttl() > 0, sent))
    }

    /// The stream's next answer.
    async fn answer(&mut self) -> Result<etcd_client::LeaseKeepAliveResponse, Error> {
        self.stream
            .message()
            .await?
            .ok_or_else(|| Error::LeaseKeepAliveError("the keep-alive stream ended".to_owned()))
    }
}

impl KeptLease {
    /// Grants a lease for `lease_duration` (on another member if the current one fails: a
    /// lease granted twice is harmless, the unused one runs out).
    pub(crate) async fn grant(store: &EtcdStore, lease_duration: Duration) -> Result<Self, Error> {
        let ttl = ttl(lease_duration);
        let sent = Instant::now();
        let members = &store.inner.members;
        let granted = members
            .call(true, |mut client| async move {
                client.lease_grant(ttl, None).await
            })
            .await?;
        Ok(Self {
            id: granted.id(),
            ttl,
            streams: (0..members.len()).map(|_| Mutex::new(None)).collect(),
            alive_since: sent,
        })
    }

    /// One keep-alive: `true` if the lease is still alive. Sent on the current member's stream,
    /// and on the other members' too when that one does not answer within the member timeout
    /// (see [`Members::hedged`](crate::members::Members::hedged)); the first answer counts.
    pub(crate) async fn keep_alive(&mut self, store: &EtcdStore) -> Result<bool, Error> {
        let members = &store.inner.members;
        let (id, streams) = (self.id, &self.streams);
        let (alive, sent) = members
            .hedged(|index| async move {
                let mut slot = streams[index].lock().await;
                // etcd answers a stream's keep-alives one after the other: behind one that is
                // stuck (a member forwarding it to a raft leader that is gone) a new one would
                // wait too, so a stream with an answer outstanding is replaced.
                let outcome = match slot.as_mut().filter(|open| open.unanswered == 0) {
                    Some(open) => open.once().await,
                    None => {
                        let mut client = members.client(index).await?;
                        let sent = Instant::now();
                        let (keeper, stream) = match client.lease_keep_alive(id).await {
                            Ok(opened) => opened,
                            // The client reads the first answer itself, and says "lease not
                            // found" for a lease that ran out or was revoked: an answer (the
                            // member asked the raft leader), not a failure of the member.
                            Err(Error::LeaseKeepAliveError(message))
                                if message.contains("not found") =>
                            {
                                return Ok((false, sent));
                            }
                            Err(err) => return Err(err),
                        };
                        slot.insert(KeepAlive {
                            keeper,
                            stream,
                            unanswered: 0,
                        })
                        .once()
                        .await
                    }
                };
                if outcome.is_err() {
                    // A broken stream is opened again next time.
                    *slot = None;
                }
                outcome
            })
            .await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease that ran out, kept alive on a stream opened afresh (after a move to another
    /// member, say): not alive, an answer rather than a failed member, so that the holder steps
    /// down at once instead of at its renew deadline.
    #[tokio::test]
    async fn a_lease_gone_is_not_alive_on_a_new_stream() {
        let endpoints = leader_test_support::etcd_endpoints();
        let Ok(store) = EtcdStore::builder(endpoints.clone()).build().await else {
            assert!(
                !leader_test_support::in_ci(),
                "CI=true and no etcd at {endpoints:?}"
            );
            return;
        };
        let Ok(mut lease) = KeptLease::grant(&store, Duration::from_secs(5)).await else {
            assert!(
                !leader_test_support::in_ci(),
                "CI=true and no etcd at {endpoints:?}"
            );
            return;
        };
        assert!(lease.keep_alive(&store).await.expect("keep-alive"), "alive");
        store
            .client()
            .await
            .expect("client")
            .lease_revoke(lease.id)
            .await
            .expect("revoke");
        // Every stream opened afresh.
        for stream in &lease.streams {
            *stream.lock().await = None;
        }
        assert!(
            !lease.keep_alive(&store).await.expect("an answer"),
            "a revoked lease is not alive"
        );
    }
}
