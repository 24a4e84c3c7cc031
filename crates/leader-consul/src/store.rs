//! The connection to a Consul agent: address, ACL token, datacenter, TLS and key prefix.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use leader_core::{LockError, redact_url};
use reqwest::{Method, RequestBuilder, StatusCode};

use crate::error::{BACKEND, status, transport};
use crate::key;

/// The key prefix when none is given: records live at `leader/NAME`.
pub const DEFAULT_PREFIX: &str = "leader/";

/// Builds a [`ConsulStore`]; see [`ConsulStore::builder`].
#[must_use = "builder does nothing itself, use `.build()` to build it"]
pub struct ConsulStoreBuilder {
    address: String,
    token: Option<String>,
    datacenter: Option<String>,
    prefix: String,
    timeout: Duration,
    tls: Option<rustls::ClientConfig>,
    session_node: Option<String>,
}

impl fmt::Debug for ConsulStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsulStoreBuilder")
            .field("address", &redact_url(&self.address))
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .field("datacenter", &self.datacenter)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("session_node", &self.session_node)
            .finish_non_exhaustive()
    }
}

impl ConsulStoreBuilder {
    /// The ACL token, sent as `X-Consul-Token` and never shown.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into()).filter(|t| !t.is_empty());
        self
    }

    /// The ACL token from `CONSUL_HTTP_TOKEN`, as Consul's own tools read it; none when it is
    /// unset or empty.
    pub fn token_from_env(self) -> Self {
        match std::env::var("CONSUL_HTTP_TOKEN") {
            Ok(token) => self.token(token),
            Err(_) => self,
        }
    }

    /// The datacenter (`?dc=`); by default the agent's own.
    pub fn datacenter(mut self, datacenter: impl Into<String>) -> Self {
        self.datacenter = Some(datacenter.into()).filter(|d| !d.is_empty());
        self
    }

    /// The node the holders' sessions belong to (default: the agent's own node). A client
    /// agent leaves the cluster when it stops (`leave_on_terminate`, on by default for
    /// clients), which deregisters its node and ends its sessions: every holder on that agent
    /// loses its term at an agent restart, and followers take over a lease later. Sessions on
    /// a node that does not restart with the agents (a server's, or one registered for the
    /// purpose through the catalog) outlive the restart, and a holder whose agent is back
    /// within its renew deadline goes on leading. The ACL token then needs `session:write` on
    /// that node. A node that is deregistered still ends its sessions.
    pub fn session_node(mut self, node: impl Into<String>) -> Self {
        self.session_node = Some(node.into()).filter(|n| !n.is_empty());
        self
    }

    /// The prefix of the records' keys (default [`DEFAULT_PREFIX`]): election `NAME` is the
    /// key `PREFIX` + `NAME`. Letters, digits and `,-_./` only, as Consul's KV API allows
    /// (checked by [`build`](Self::build)).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The timeout of each request (default 5 s); keep it below the elector's renew deadline.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The TLS configuration for an `https://` agent (a private CA, a client certificate); by
    /// default the web PKI roots.
    pub fn tls(mut self, config: rustls::ClientConfig) -> Self {
        self.tls = Some(config);
        self
    }

    /// Checks the settings and builds the client; nothing is sent yet.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] for an address that is not `http://` or `https://` with a
    /// host, a key prefix Consul's KV API would refuse, a zero timeout, or a client that cannot
    /// be built.
    pub fn build(self) -> Result<ConsulStore, LockError> {
        let bad = |message: String| LockError::Misconfigured {
            backend: BACKEND,
            message,
        };
        key::check_prefix(&self.prefix)?;
        if self.timeout.is_zero() {
            return Err(bad("the request timeout must be above zero".to_owned()));
        }
        let address = redact_url(&self.address);
        leader_core::backend::check_user_info(&self.address)
            .map_err(|err| bad(format!("the agent address {address:?}: {}", err.message)))?;
        let base = url::Url::parse(&self.address)
            .map_err(|err| bad(format!("the agent address {address:?}: {err}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.host_str().is_none() {
            return Err(bad(format!(
                "the agent address {address:?} must be http://HOST:PORT or https://HOST:PORT"
            )));
        }
        if !base.username().is_empty() || base.password().is_some() {
            return Err(bad(
                "the agent address must not hold credentials; give the ACL token with .token()"
                    .to_owned(),
            ));
        }
        let tls = match self.tls {
            Some(tls) => tls,
            None => default_tls().map_err(|err| bad(format!("TLS: {err}")))?,
        };
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .connect_timeout(self.timeout)
            .pool_idle_timeout(Duration::from_secs(60))
            .build()
            .map_err(|err| bad(format!("the HTTP client: {err}")))?;
        let address = base.as_str().trim_end_matches('/').to_owned();
        Ok(ConsulStore {
            inner: Arc::new(Inner {
                client,
                address,
                token: self.token,
                datacenter: self.datacenter,
                prefix: self.prefix,
                timeout: self.timeout,
                session_node: self.session_node,
                sweeper: crate::sweeper::Sweeper::default(),
            }),
        })
    }
}

fn default_tls() -> Result<rustls::ClientConfig, rustls::Error> {
    let roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

/// A Consul agent's HTTP API, shared by the locks made from it. Cheap to clone.
#[derive(Clone)]
pub struct ConsulStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    client: reqwest::Client,
    pub(crate) address: String,
    token: Option<String>,
    datacenter: Option<String>,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) session_node: Option<String>,
    /// The sessions left behind to destroy, for every lock of this store.
    pub(crate) sweeper: crate::sweeper::Sweeper,
}

impl fmt::Debug for ConsulStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsulStore")
            .field("address", &self.inner.address)
            .field("datacenter", &self.inner.datacenter)
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

/// An answer: its status, `X-Consul-Index` and body.
pub(crate) struct Answer {
    pub(crate) code: StatusCode,
    pub(crate) index: u64,
    pub(crate) body: String,
}

impl ConsulStore {
    /// A builder for the agent at `address` (`http://127.0.0.1:8500`, `https://consul:8501`).
    pub fn builder(address: impl Into<String>) -> ConsulStoreBuilder {
        ConsulStoreBuilder {
            address: address.into(),
            token: None,
            datacenter: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: Duration::from_secs(5),
            tls: None,
            session_node: None,
        }
    }

    /// A builder configured as Consul's own tools are: the agent at `CONSUL_HTTP_ADDR` (a URL,
    /// or `HOST:PORT`, taken as `https://` when `CONSUL_HTTP_SSL` is `true`; default
    /// `http://127.0.0.1:8500`), the ACL token from `CONSUL_HTTP_TOKEN`, the datacenter from
    /// `CONSUL_DATACENTER` if set.
    pub fn from_env() -> ConsulStoreBuilder {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let tls =
            var("CONSUL_HTTP_SSL").is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        let address = match var("CONSUL_HTTP_ADDR") {
            Some(address) if address.contains("://") => address,
            Some(address) => format!("{}://{address}", if tls { "https" } else { "http" }),
            None => "http://127.0.0.1:8500".to_owned(),
        };
        let builder = Self::builder(address).token_from_env();
        match var("CONSUL_DATACENTER") {
            Some(datacenter) => builder.datacenter(datacenter),
            None => builder,
        }
    }

    /// The agent's address.
    pub fn address(&self) -> &str {
        &self.inner.address
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    fn request(&self, method: Method, path: &str, query: &[(&str, String)]) -> RequestBuilder {
        let mut request = self
            .inner
            .client
            .request(method, format!("{}{path}", self.inner.address));
        if let Some(dc) = &self.inner.datacenter {
            request = request.query(&[("dc", dc)]);
        }
        if !query.is_empty() {
            request = request.query(query);
        }
        if let Some(token) = &self.inner.token {
            request = request.header("X-Consul-Token", token);
        }
        request
    }

    /// Sends a request within the store's timeout (plus `extra`, for a blocking query) and
    /// reads its answer; an error for no answer.
    pub(crate) async fn send(
        &self,
        context: &str,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Vec<u8>>,
        extra: Duration,
    ) -> Result<Answer, LockError> {
        let mut request = self
            .request(method, path, query)
            .timeout(self.inner.timeout + extra);
        if let Some(body) = body {
            request = request.body(body);
        }
        let response = request
            .send()
            .await
            .map_err(|err| transport(context, &err))?;
        let code = response.status();
        let index = response
            .headers()
            .get("x-consul-index")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let body = response
            .text()
            .await
            .map_err(|err| transport(context, &err))?;
        Ok(Answer { code, index, body })
    }

    /// The error for an answer that is not a success.
    pub(crate) fn refused(&self, context: &str, answer: &Answer) -> LockError {
        status(context, &self.inner.prefix, answer.code, &answer.body)
    }

    /// Runs `ops` as one `PUT /v1/txn`: `Ok(results)` when Consul applied them, `Err(body)`
    /// with its refusal's body when it rolled them back (409: a check failed, a session it
    /// does not know, an ACL denial), and an error for every other answer.
    pub(crate) async fn txn(
        &self,
        context: &str,
        ops: &[serde_json::Value],
    ) -> Result<Result<Vec<serde_json::Value>, String>, LockError> {
        let body = serde_json::Value::Array(ops.to_vec())
            .to_string()
            .into_bytes();
        let answer = self
            .send(
                context,
                Method::PUT,
                "/v1/txn",
                &[],
                Some(body),
                Duration::ZERO,
            )
            .await?;
        match answer.code {
            StatusCode::OK => {
                let result: serde_json::Value =
                    serde_json::from_str(&answer.body).map_err(|err| {
                        LockError::invalid_record(
                            BACKEND,
                            format!("{context}: a transaction answer: {err}"),
                        )
                    })?;
                Ok(Ok(result["Results"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()))
            }
            StatusCode::CONFLICT => Ok(Err(answer.body)),
            _ => Err(self.refused(context, &answer)),
        }
    }
}
