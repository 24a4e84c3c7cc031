//! The store: one etcd cluster and its client.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, TlsOptions};
use leader_core::LockError;

use crate::error::map;

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
}

impl fmt::Debug for EtcdStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStoreBuilder")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("user", &self.user.as_ref().map(|(user, _)| user))
            .field("tls", &self.tls.is_some())
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

    /// Connects to the cluster (authenticating, when a user is set).
    pub async fn build(self) -> Result<EtcdStore, LockError> {
        let context = self.endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.timeout)
            .with_timeout(self.timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let Some((user, password)) = &self.user {
            options = options.with_user(user, password);
        }
        let https = self.endpoints.iter().any(|e| e.starts_with("https://"));
        if let Some(tls) = self.tls {
            options = options.with_tls(tls);
        } else if https {
            options = options.with_tls(TlsOptions::new().with_webpki_roots());
        }
        let client = Client::connect(&self.endpoints, Some(options))
            .await
            .map_err(|err| map(&context, err))?;
        Ok(EtcdStore {
            inner: Arc::new(Inner {
                client,
                endpoints: context,
                prefix: self.prefix,
            }),
        })
    }
}

/// An etcd cluster holding elections: make [`EtcdLock`](crate::EtcdLock)s from it. Cheap to clone; its locks share
/// one client (gRPC connections balanced over the endpoints).
#[derive(Clone)]
pub struct EtcdStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) endpoints: String,
    pub(crate) prefix: String,
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
        }
    }

    /// Connects to the cluster at `endpoints` with the default prefix.
    pub async fn connect<E: AsRef<str>>(
        endpoints: impl IntoIterator<Item = E>,
    ) -> Result<Self, LockError> {
        Self::builder(endpoints).build().await
    }

    /// The client, for requests of your own.
    pub fn client(&self) -> Client {
        self.inner.client.clone()
    }
}
