//! The cluster's members, one client each, and the member requests go to now.
//!
//! A client balanced over every endpoint keeps sending to a member that is frozen, cut off or
//! still catching up after a restart: its requests and keep-alive streams hang there until the
//! request timeout, longer than a renew deadline. So the lock talks to one member at a time (the
//! one that answered last). A request that may be repeated (a read, a keep-alive, a lease grant
//! or revocation, a registration, a watch) goes to the other members too, at once, when that
//! member has not answered within the member timeout or failed (a transport error, `etcdserver:
//! no leader`), or when a request went unanswered since the last answer; the first answer wins.
//! A write whose outcome is unknown is not repeated: it is abandoned after the member timeout,
//! and the elector's next attempt goes to the next member.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, Error};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::OnceCell;
use tonic::Code;

/// One member: its endpoint and its client, connected on first use.
struct Member {
    endpoint: String,
    /// The endpoint with its password hidden, for messages and logs.
    shown: String,
    client: OnceCell<Client>,
}

/// The members of one cluster.
pub(crate) struct Members {
    members: Vec<Member>,
    options: ConnectOptions,
    /// The member requests go to now (an index into `members`).
    current: AtomicUsize,
    /// How long a request may wait for one member before it goes to the others too.
    member_timeout: Duration,
    /// A request went unanswered, or a member failed, since the last answer: the next
    /// repeatable request goes to every member at once.
    degraded: AtomicBool,
    /// Requests sent, on any member.
    sent: AtomicU64,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Members")
            .field(
                "endpoints",
                &self.members.iter().map(|m| &m.shown).collect::<Vec<_>>(),
            )
            .field("current", &self.current.load(Ordering::Relaxed))
            .field("member_timeout", &self.member_timeout)
            .finish()
    }
}

/// The error of a request that member `endpoint` (as shown: its password hidden) did not answer
/// within `after`.
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
                shown: leader_core::redact_url(endpoint),
                client: OnceCell::new(),
            })
            .collect();
        let first = fastrand::usize(..members.len().max(1));
        Self {
            members,
            options,
            current: AtomicUsize::new(first),
            member_timeout,
            degraded: AtomicBool::new(false),
            sent: AtomicU64::new(0),
        }
    }

    /// How many members there are.
    pub(crate) fn len(&self) -> usize {
        self.members.len()
    }

    /// The requests sent so far, on any member: each unary request, keep-alive message and
    /// watch opened, once per member it went to.
    pub(crate) fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Counts a request sent (by [`call`](Self::call), [`hedged`](Self::hedged), or a watch).
    pub(crate) fn note_sent(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
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
        self.degraded.store(true, Ordering::Release);
        let next = (failed + 1) % self.members.len();
        if self
            .current
            .compare_exchange(failed, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            && self.members.len() > 1
        {
            tracing::info!(
                from = %self.members[failed].shown,
                to = %self.members[next].shown,
                "etcd member did not answer in time or failed: moving to the next member"
            );
        }
    }

    /// Marks a request to member `index` as under way: if it is abandoned before it ends (the
    /// elector gave up waiting: its own timeout is shorter than a round of the cluster), the
    /// next request goes to the next member instead of waiting on this one again.
    pub(crate) fn attempt(&self, index: usize) -> Attempt<'_> {
        Attempt {
            members: self,
            index,
            ended: false,
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
            Err(_) => Err(timed_out(&member.shown, self.member_timeout)),
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

    /// `op` on the members, as [`hedged`](Self::hedged) when `repeatable`; otherwise once, on
    /// the current member, given up after the member timeout (a write whose outcome is unknown is
    /// not repeated: when the member failed, the next request goes to the next member).
    pub(crate) async fn call<T, F, Fut>(&self, repeatable: bool, op: F) -> Result<T, Error>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        if repeatable {
            return self
                .hedged(|index| {
                    let op = &op;
                    async move { op(self.client(index).await?).await }
                })
                .await;
        }
        let (index, client) = self.current_client().await?;
        self.note_sent();
        let mut attempt = self.attempt(index);
        let outcome = match tokio::time::timeout(self.member_timeout, op(client)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(timed_out(&self.members[index].shown, self.member_timeout)),
        };
        attempt.ended();
        match &outcome {
            Err(err) if member_failed(err) => self.skip(index),
            _ => self.answered(index),
        }
        outcome
    }

    /// `op(index)` for the members, the first answer winning: on the current member first; on
    /// every other member too, at once, when the current one has not answered within the member
    /// timeout or failed, or when the cluster was degraded at the last request (a request went
    /// unanswered or a member failed since the last answer). So a request waits neither for a
    /// frozen member nor for a round of the members one after the other: when the raft leader
    /// is lost, requests sent to the others answer as soon as they have elected a new one. The
    /// member that answered becomes the current one. A member's failure is returned only when
    /// every member failed; any other error is the answer.
    pub(crate) async fn hedged<T, F, Fut>(&self, op: F) -> Result<T, Error>
    where
        F: Fn(usize) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let count = self.members.len();
        let first = self.current();
        let (go, started) = tokio::sync::watch::channel(self.degraded.load(Ordering::Acquire));
        let mut running = FuturesUnordered::new();
        for k in 0..count {
            let index = (first + k) % count;
            let mut started = started.clone();
            let op = &op;
            let wait = self.member_timeout;
            running.push(async move {
                if k > 0 {
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        _ = started.wait_for(|go| *go) => {}
                    }
                }
                self.note_sent();
                (index, op(index).await)
            });
        }
        // A request its caller abandons before any answer leaves the cluster degraded.
        let mut abandoned = Abandoned {
            degraded: &self.degraded,
            answered: false,
        };
        let mut last = None;
        while let Some((index, outcome)) = running.next().await {
            match outcome {
                Err(err) if member_failed(&err) => {
                    let _ = go.send(true);
                    last = Some(err);
                }
                answer => {
                    abandoned.answered = true;
                    self.answered(index);
                    return answer;
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::InvalidArgs("no etcd endpoint".to_owned())))
    }

    /// Member `index` answered: it is the current member, and the cluster is not degraded.
    fn answered(&self, index: usize) {
        let before = self.current.swap(index, Ordering::AcqRel);
        self.degraded.store(false, Ordering::Release);
        if before % self.members.len() != index && self.members.len() > 1 {
            tracing::info!(
                to = %self.members[index].shown,
                "etcd requests go to another member: the one they went to did not answer in time"
            );
        }
    }
}

/// Marks the cluster degraded when a hedged request is dropped before any member answered.
struct Abandoned<'a> {
    degraded: &'a AtomicBool,
    answered: bool,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.degraded.store(true, Ordering::Release);
        }
    }
}

/// A request under way to one member; see [`Members::attempt`].
pub(crate) struct Attempt<'a> {
    members: &'a Members,
    index: usize,
    ended: bool,
}

impl Attempt<'_> {
    /// The request ended (answered, failed or timed out): the caller decides what follows.
    pub(crate) fn ended(&mut self) {
        self.ended = true;
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.members.skip(self.index);
        }
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
        // A request abandoned before it ended moves on too; one that ended does not.
        let mut ended = members.attempt(first);
        ended.ended();
        drop(ended);
        assert_eq!(members.current(), first);
        drop(members.attempt(first));
        assert_eq!(members.current(), (first + 1) % 3);
    }

    /// The members' `Debug`, and the error of one that did not answer, show an endpoint's
    /// password hidden, where both once showed the endpoint as given.
    #[test]
    fn members_are_shown_without_their_passwords() {
        let members = Members::new(
            &["http://app:pw-of-a@127.0.0.1:1".to_owned()],
            ConnectOptions::new(),
            Duration::from_secs(1),
        );
        let shown = format!(
            "{members:?} {}",
            timed_out(&members.members[0].shown, Duration::from_secs(1))
        );
        assert!(!shown.contains("pw-of-a"), "{shown}");
        assert!(shown.contains("app:***@127.0.0.1:1"), "{shown}");
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
