//! The cluster's members, one client each, and the member requests go to now.
//!
//! A client balanced over every endpoint keeps sending to a member that is frozen, cut off or
//! still catching up after a restart: its requests and keep-alive streams hang there until the
//! request timeout, longer than a renew deadline. So the lock talks to one member at a time, and a
//! request that member does not answer within the member timeout (or fails with a transport error,
//! or `etcdserver: no leader`) is abandoned, and the lock moves on to the next member. Requests
//! that may be repeated (reads, keep-alives, lease grants and revocations, registrations, watches)
//! are repeated there at once; a write whose outcome is unknown is not, and the elector's next
//! attempt goes to the next member.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, Error};
use tokio::sync::OnceCell;
use tonic::Code;

/// One member: its endpoint and its client, connected on first use.
struct Member {
    endpoint: String,
    client: OnceCell<Client>,
}

/// The members of one cluster.
pub(crate) struct Members {
    members: Vec<Member>,
    options: ConnectOptions,
    /// The member requests go to now (an index into `members`).
    current: AtomicUsize,
    /// How long a request may wait for one member before it goes to the next.
    member_timeout: Duration,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Members")
            .field(
                "endpoints",
                &self.members.iter().map(|m| &m.endpoint).collect::<Vec<_>>(),
            )
            .field("current", &self.current.load(Ordering::Relaxed))
            .field("member_timeout", &self.member_timeout)
            .finish()
    }
}

/// The error of a request that member `endpoint` did not answer within `after`.
pub(crate) fn timed_out(endpoint: &str, after: Duration) -> Error {
    Error::GRpcStatus(tonic::Status::deadline_exceeded(format!(
        "member {endpoint} did not answer within {after:?}"
    )))
}

/// Whether `err` says that the member, not the request, failed: a broken or refused connection,
/// a member without a raft leader, a request the member gave up on.
pub(crate) fn member_failed(err: &Error) -> bool {
    match err {
        Error::GRpcStatus(status) => {
            let text = status.message().to_ascii_lowercase();
            matches!(
                status.code(),
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted
            ) || (status.code() == Code::Unknown
                && ["transport", "connection", "broken pipe", "h2 protocol"]
                    .iter()
                    .any(|t| text.contains(t)))
        }
        Error::TransportError(_)
        | Error::IoError(_)
        | Error::LeaseKeepAliveError(_)
        | Error::WatchError(_) => true,
        _ => false,
    }
}

impl Members {
    /// The members at `endpoints`, connected with `options` when first used. The first member
    /// used is picked at random, so that the replicas of a service spread over the cluster.
    pub(crate) fn new(
        endpoints: &[String],
        options: ConnectOptions,
        member_timeout: Duration,
    ) -> Self {
        let members: Vec<Member> = endpoints
            .iter()
            .map(|endpoint| Member {
                endpoint: endpoint.clone(),
                client: OnceCell::new(),
            })
            .collect();
        let first = fastrand::usize(..members.len().max(1));
        Self {
            members,
            options,
            current: AtomicUsize::new(first),
            member_timeout,
        }
    }

    /// How many members there are.
    pub(crate) fn len(&self) -> usize {
        self.members.len()
    }

    /// How long one member has to answer.
    pub(crate) fn member_timeout(&self) -> Duration {
        self.member_timeout
    }

    /// The member requests go to now.
    pub(crate) fn current(&self) -> usize {
        self.current.load(Ordering::Acquire) % self.members.len()
    }

    /// Moves on from member `failed` to the next one, unless another request already did.
    pub(crate) fn skip(&self, failed: usize) {
        let next = (failed + 1) % self.members.len();
        if self
            .current
            .compare_exchange(failed, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            && self.members.len() > 1
        {
            tracing::info!(
                from = %self.members[failed].endpoint,
                to = %self.members[next].endpoint,
                "etcd member did not answer in time or failed: moving to the next member"
            );
        }
    }

    /// The client of member `index`, connected (and authenticated) on first use, within the
    /// member timeout.
    pub(crate) async fn client(&self, index: usize) -> Result<Client, Error> {
        let member = &self.members[index];
        let connect = member.client.get_or_try_init(|| async {
            Client::connect([member.endpoint.as_str()], Some(self.options.clone())).await
        });
        match tokio::time::timeout(self.member_timeout, connect).await {
            Ok(client) => client.cloned(),
            Err(_) => Err(timed_out(&member.endpoint, self.member_timeout)),
        }
    }

    /// The current member's index and client; on a failure to connect, the next member's (once
    /// round the cluster).
    pub(crate) async fn current_client(&self) -> Result<(usize, Client), Error> {
        let mut last = None;
        for _ in 0..self.members.len() {
            let index = self.current();
            match self.client(index).await {
                Ok(client) => return Ok((index, client)),
                Err(err) => {
                    self.skip(index);
                    last = Some(err);
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::InvalidArgs("no etcd endpoint".to_owned())))
    }

    /// `op` on the current member, given up after the member timeout. When the member fails
    /// (see [`member_failed`]), the lock moves on to the next member, and, when `repeatable`,
    /// `op` is sent there at once, once round the cluster.
    pub(crate) async fn call<T, F, Fut>(&self, repeatable: bool, mut op: F) -> Result<T, Error>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let attempts = if repeatable { self.members.len() } else { 1 };
        let mut last = None;
        for _ in 0..attempts {
            let (index, client) = match self.current_client().await {
                Ok(current) => current,
                Err(err) => return Err(err),
            };
            let outcome = match tokio::time::timeout(self.member_timeout, op(client)).await {
                Ok(outcome) => outcome,
                Err(_) => Err(timed_out(
                    &self.members[index].endpoint,
                    self.member_timeout,
                )),
            };
            match outcome {
                Err(err) if member_failed(&err) => {
                    self.skip(index);
                    last = Some(err);
                }
                other => return other,
            }
        }
        Err(last.unwrap_or_else(|| Error::InvalidArgs("no etcd endpoint".to_owned())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize) -> Members {
        let endpoints: Vec<String> = (0..n).map(|i| format!("http://127.0.0.1:{i}")).collect();
        Members::new(&endpoints, ConnectOptions::new(), Duration::from_secs(1))
    }

    #[test]
    fn skipping_moves_round_the_cluster_once_per_failure() {
        let members = members(3);
        let first = members.current();
        members.skip(first);
        let second = members.current();
        assert_eq!(second, (first + 1) % 3);
        // A second report of the same failure (another request on the same member) does not
        // skip the member the first one moved to.
        members.skip(first);
        assert_eq!(members.current(), second);
        members.skip(second);
        members.skip((first + 2) % 3);
        assert_eq!(members.current(), first);
    }

    #[test]
    fn what_counts_as_a_failed_member() {
        let status = |code, text: &str| Error::GRpcStatus(tonic::Status::new(code, text));
        assert!(member_failed(&status(
            Code::Unavailable,
            "etcdserver: no leader"
        )));
        assert!(member_failed(&timed_out(
            "http://a:2379",
            Duration::from_secs(1)
        )));
        assert!(member_failed(&status(Code::Unknown, "transport error")));
        assert!(!member_failed(&status(
            Code::PermissionDenied,
            "etcdserver: permission denied"
        )));
        assert!(!member_failed(&status(
            Code::InvalidArgument,
            "etcdserver: requested lease not found"
        )));
    }
}
