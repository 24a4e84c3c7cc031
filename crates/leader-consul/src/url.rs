//! `consul://` and `consuls://` lock URLs: the agent, the key prefix and the datacenter; the ACL
//! token from the environment, never from the URL.

use leader_core::{LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait};

use crate::store::{ConsulStore, ConsulStoreBuilder};

/// A Consul lock URL: `consul://HOST:8500/PREFIX?dc=DC&session_node=NODE` (or `consuls://`,
/// TLS, port 8501 by default; see [`ConsulStoreBuilder::session_node`]). The path is the key prefix; the ACL token comes from `CONSUL_HTTP_TOKEN`, as
/// Consul's own tools read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockUrl {
    address: String,
    prefix: Option<String>,
    datacenter: Option<String>,
    session_node: Option<String>,
}

impl LockUrl {
    /// Parses a `consul://` or `consuls://` URL.
    ///
    /// # Errors
    /// Another scheme, credentials in the URL (the token belongs in `CONSUL_HTTP_TOKEN`), no
    /// host, or an unknown parameter.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: String| UrlError::new(lock, message);
        let url = leader_core::backend::parse_lock_url(
            lock,
            &["consul", "consuls"],
            "not a consul:// URL",
        )?;
        let tls = url.scheme() == "consuls";
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid(
                "a consul:// URL takes no credentials; set CONSUL_HTTP_TOKEN".to_owned(),
            ));
        }
        let host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| invalid("consul://HOST:PORT needs a host".to_owned()))?;
        let port = url.port().unwrap_or(if tls { 8501 } else { 8500 });
        let http = if tls { "https" } else { "http" };
        let mut datacenter = None;
        let mut session_node = None;
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "dc" => datacenter = Some(value.into_owned()),
                "session_node" => session_node = Some(value.into_owned()),
                other => {
                    return Err(invalid(format!(
                        "unknown parameter {other:?}; consul:// takes dc and session_node (the \
                         token comes from CONSUL_HTTP_TOKEN)"
                    )));
                }
            }
        }
        let prefix = url.path().trim_start_matches('/');
        Ok(Self {
            address: format!("{http}://{host}:{port}"),
            prefix: (!prefix.is_empty()).then(|| prefix.to_owned()),
            datacenter,
            session_node,
        })
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// A store builder with the URL's agent, prefix and datacenter, and the token from
    /// `CONSUL_HTTP_TOKEN`.
    pub fn store(&self) -> ConsulStoreBuilder {
        let mut builder = ConsulStore::builder(&self.address).token_from_env();
        if let Some(prefix) = &self.prefix {
            builder = builder.prefix(prefix);
        }
        if let Some(node) = &self.session_node {
            builder = builder.session_node(node);
        }
        if let Some(datacenter) = &self.datacenter {
            builder = builder.datacenter(datacenter);
        }
        builder
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        format!(
            "consul:{}/{}",
            self.address,
            self.prefix.as_deref().unwrap_or_default()
        )
    }

    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        Ok(Box::new(self.store().build()?.lock(name, identity)?))
    }

    /// A key per record, on one client, read and renewed in batches
    /// ([`ConsulLockSet`](crate::ConsulLockSet)). The set's keys are checked here.
    async fn open_set(&self, name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        Ok(Box::new(self.store().build()?.lock_set(name, identity)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_prefix_and_datacenter() {
        let url = LockUrl::parse("consuls://consul.internal/app/locks/?dc=eu1").expect("valid");
        assert_eq!(url.address, "https://consul.internal:8501");
        assert_eq!(url.prefix.as_deref(), Some("app/locks/"));
        assert_eq!(url.datacenter.as_deref(), Some("eu1"));
        let url = LockUrl::parse("consul://127.0.0.1:8500").expect("valid");
        assert_eq!((url.prefix, url.datacenter), (None, None));
        leader_test_support::secrets::assert_refused(
            LockUrl::parse,
            &[
                ("consul://u:secret@host:8500", "CONSUL_HTTP_TOKEN"),
                ("consul://host:8500/?token=secret", "unknown parameter"),
            ],
        );
    }
}
