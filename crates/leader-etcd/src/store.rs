//! The store: one etcd cluster and its client.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, TlsOptions};
use leader_core::{LockError, redact_url};

use crate::error::map;
use crate::members::Members;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "leader/";

/// Builds an [`EtcdStore`]; start with [`EtcdStore::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct EtcdStoreBuilder {
    endpoints: Vec<String>,
    prefix: String,
    user: Option<(String, String)>,
    tls: Option<TlsOptions>,
    timeout: Duration,
    member_timeout: Duration,
}

impl fmt::Debug for EtcdStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStoreBuilder")
            .field("endpoints", &redact_url(&self.endpoints.join(",")))
            .field("prefix", &self.prefix)
            .field("user", &self.user.as_ref().map(|(user, _)| user))
            .field("tls", &self.tls.is_some())
            .field("timeout", &self.timeout)
            .field("member_timeout", &self.member_timeout)
            .finish()
    }
}

impl EtcdStoreBuilder {
    /// The prefix of every key (default `leader/`): election `jobs` lives in `leader/jobs`, its
    /// fencing key in `leader/jobs.fence`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Authenticate as `user` (etcd's user/password auth). The password appears in no error,
    /// log or `Debug` output.
    pub fn user(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// TLS settings, for `https://` endpoints (verified against the Mozilla roots unless the
    /// options name a CA of your own).
    pub fn tls(mut self, tls: TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Timeout for connecting and for each request (default 5 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// With several members: how long a request waits for the member it went to before the
    /// lock gives up on that member and moves on to the next (default 1 s). A keep-alive or a
    /// read is sent to the next member at once; a write whose outcome is unknown is not, and
    /// the elector's next attempt, a retry period later, goes to the next member. So a frozen,
    /// cut-off or restarting member costs the leader at most about this long plus a retry
    /// period: keep it well under the renew deadline (a third of it, or less). With one
    /// endpoint (a load balancer, say) a request waits the whole [`timeout`](Self::timeout).
    pub fn member_timeout(mut self, member_timeout: Duration) -> Self {
        self.member_timeout = member_timeout;
        self
    }

    /// Connects to the cluster (authenticating, when a user is set): one client per member,
    /// connected when first used, and the lock talks to one member at a time (see
    /// [`member_timeout`](Self::member_timeout)).
    pub async fn build(self) -> Result<EtcdStore, LockError> {
        let context = redact_url(&self.endpoints.join(","));
        if self.endpoints.is_empty() {
            return Err(LockError::Misconfigured {
                backend: crate::error::BACKEND,
                message: "no etcd endpoint".to_owned(),
            });
        }
        // A member without a raft leader (cut off from the others) fails requests and watches
        // at once with `etcdserver: no leader` instead of letting them hang.
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.timeout)
            .with_timeout(self.timeout)
            .with_require_leader(true)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            // Pings only while a request or a watch runs, as etcd's own client: etcd lets a
            // client ping without one at most twice (its keep-alive enforcement, `MinTime` 5 s,
            // `PermitWithoutStream` false) and then closes the connection, so the idle ones to
            // the members the lock does not talk to now would be gone when it moves to one.
            .with_keep_alive_while_idle(false);
        if let Some((user, password)) = &self.user {
            // A token etcd no longer takes (a simple token unused for `--auth-token-ttl`, a JWT
            // past its TTL, a token lost in a restart) is replaced by logging in again and
            // sending the request once more: the server refused it before doing anything.
            options = options
                .with_user(user, password)
                .with_auto_token_refresh(true);
        }
        let https = self.endpoints.iter().any(|e| e.starts_with("https://"));
        if let Some(tls) = self.tls {
            options = options.with_tls(tls);
        } else if https {
            options = options.with_tls(TlsOptions::new().with_webpki_roots());
        }
        let member_timeout = if self.endpoints.len() > 1 {
            self.member_timeout.min(self.timeout)
        } else {
            self.timeout
        };
        let members = Members::new(&self.endpoints, options, member_timeout);
        members
            .current_client()
            .await
            .map_err(|err| map(&context, err))?;
        Ok(EtcdStore {
            inner: Arc::new(Inner {
                members,
                endpoints: context,
                prefix: self.prefix,
                release_checked: AtomicBool::new(false),
            }),
        })
    }
}

impl EtcdStore {
    /// Once per store, when its first term starts (where it matters, not in a command that
    /// only reads): asks the member for its release, and warns of one whose keep-alives a
    /// stalled leader answers ([`keep_alives_unconfirmed`]). In the background, on a best
    /// effort: the term waits for nothing, and a member that does not say is not held against
    /// the store.
    pub(crate) fn check_release(&self) {
        if self.inner.release_checked.swap(true, Ordering::AcqRel) {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            let members = &store.inner.members;
            let Ok((_, mut client)) = members.current_client().await else {
                return;
            };
            let Ok(Ok(status)) =
                tokio::time::timeout(members.member_timeout(), client.status()).await
            else {
                return;
            };
            if keep_alives_unconfirmed(status.version()) {
                tracing::warn!(
                    etcd = store.inner.endpoints,
                    version = status.version(),
                    "this etcd answers lease keep-alives without confirming that it still leads \
                     the cluster (etcd-io/etcd#15247, fixed in 3.4.31 and 3.5.13): a raft \
                     leader stalled on its disk can keep a holder's lease alive while the other \
                     members expire it, and another candidate leads beside the holder until the \
                     stall ends; upgrade etcd, and pass the fencing token downstream"
                );
            }
        });
    }
}

/// Whether etcd `version` answers a lease keep-alive on a member that believes it leads
/// without asking the others (etcd-io/etcd#15247): every release before 3.4.31, and 3.5
/// before 3.5.13. A version it cannot read is not.
fn keep_alives_unconfirmed(version: &str) -> bool {
    let mut parts = version.split(['.', '-', '+']).map(str::parse::<u32>);
    let (Some(Ok(major)), Some(Ok(minor)), Some(Ok(patch))) =
        (parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    match (major, minor) {
        (3, 4) => patch < 31,
        (3, 5) => patch < 13,
        (3, minor) => minor < 4,
        (major, _) => major < 3,
    }
}

/// An etcd cluster holding elections: make [`EtcdLock`](crate::EtcdLock)s from it. Cheap to
/// clone; its locks share one client per member, and talk to one member at a time, moving on to
/// the next when it does not answer in time (see [`EtcdStoreBuilder::member_timeout`]).
#[derive(Clone)]
pub struct EtcdStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) members: Members,
    pub(crate) endpoints: String,
    pub(crate) prefix: String,
    /// Set once a term asked the member for its release ([`EtcdStore::check_release`]).
    release_checked: AtomicBool,
}

impl fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.inner.endpoints)
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

impl EtcdStore {
    /// A builder for the cluster at `endpoints` (`http://127.0.0.1:2379`, `https://...`).
    pub fn builder<E: AsRef<str>>(endpoints: impl IntoIterator<Item = E>) -> EtcdStoreBuilder {
        EtcdStoreBuilder {
            endpoints: endpoints
                .into_iter()
                .map(|e| e.as_ref().to_owned())
                .collect(),
            prefix: DEFAULT_PREFIX.to_owned(),
            user: None,
            tls: None,
            timeout: Duration::from_secs(5),
            member_timeout: Duration::from_secs(1),
        }
    }

    /// Connects to the cluster at `endpoints` with the default prefix.
    pub async fn connect<E: AsRef<str>>(
        endpoints: impl IntoIterator<Item = E>,
    ) -> Result<Self, LockError> {
        Self::builder(endpoints).build().await
    }

    /// The requests this store's locks sent so far, on any member: each unary request,
    /// keep-alive message and watch opened, once per member it went to (a request hedged to
    /// every member counts once for each). For measuring what elections cost the cluster.
    pub fn requests_sent(&self) -> u64 {
        self.inner.members.sent()
    }

    /// A client of the member the store talks to now, for requests of your own.
    ///
    /// # Errors
    /// No member could be connected to.
    pub async fn client(&self) -> Result<Client, LockError> {
        self.inner
            .members
            .current_client()
            .await
            .map(|(_, client)| client)
            .map_err(|err| map(&self.inner.endpoints, err))
    }
}

#[cfg(test)]
mod tests {
    use super::keep_alives_unconfirmed;

    /// The releases whose keep-alives a stalled leader answers, by etcd's changelog.
    #[test]
    fn releases_before_the_keep_alive_fix_are_told_apart() {
        for affected in ["3.4.23", "3.4.30", "3.5.0", "3.5.12", "3.3.27", "2.3.8"] {
            assert!(keep_alives_unconfirmed(affected), "{affected}");
        }
        for fixed in [
            "3.4.31",
            "3.5.13",
            "3.5.21",
            "3.6.0",
            "3.6.0-rc.1",
            "4.0.0",
            "",
            "x",
        ] {
            assert!(!keep_alives_unconfirmed(fixed), "{fixed}");
        }
    }
}
