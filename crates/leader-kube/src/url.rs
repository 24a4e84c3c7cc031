//! `kubernetes://NAMESPACE` lock URLs: a Lease in a namespace, with the client from the
//! environment, and optionally a candidate in coordinated leader election.

use std::time::Duration;

use leader_core::backend::roster_key;
use leader_core::{LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait};

use crate::candidate::Coordination;
use crate::lock::LeaseLock;
use crate::names;

/// The request timeout of a lock opened from a URL or with [`LeaseLock::from_env`] when the
/// caller names none: half of client-go's default renew deadline (10 s), as the elector's own
/// default request timeout is.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A Kubernetes lock URL: `kubernetes://NAMESPACE` names the Lease NAME in NAMESPACE, with the
/// in-cluster configuration or the kubeconfig; `?binary_version=V` (and `&emulation_version=E`,
/// by default the same) makes the candidate take part in coordinated leader election.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockUrl {
    namespace: String,
    /// Binary and emulation version, for coordinated leader election.
    coordinated: Option<(String, String)>,
}

impl LockUrl {
    /// Parses a `kubernetes://` URL.
    ///
    /// # Errors
    /// Another scheme, a namespace the API server would refuse, an unknown parameter, or an
    /// emulation version without a binary version.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: String| UrlError::new(lock, message);
        let rest = lock
            .strip_prefix("kubernetes://")
            .ok_or_else(|| invalid("not a kubernetes:// URL".to_owned()))?;
        let (namespace, query) = rest.split_once('?').unwrap_or((rest, ""));
        let namespace = namespace.trim_end_matches('/');
        if !names::is_dns_label(namespace) {
            return Err(invalid(
                "kubernetes://NAMESPACE needs a namespace name (at most 63 lowercase letters, \
                 digits and '-', starting and ending with a letter or digit)"
                    .to_owned(),
            ));
        }
        let (mut binary, mut emulation) = (None, None);
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            match key.as_ref() {
                "binary_version" => binary = Some(value.into_owned()),
                "emulation_version" => emulation = Some(value.into_owned()),
                other => {
                    return Err(invalid(format!(
                        "unknown parameter {other:?}; kubernetes:// takes binary_version and \
                         emulation_version"
                    )));
                }
            }
        }
        let coordinated = match (binary, emulation) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(invalid(
                    "emulation_version needs binary_version (coordinated leader election)"
                        .to_owned(),
                ));
            }
            (Some(binary), emulation) => {
                let emulation = emulation.unwrap_or_else(|| binary.clone());
                Some((binary, emulation))
            }
        };
        Ok(Self {
            namespace: namespace.to_owned(),
            coordinated,
        })
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// The namespace of the Lease.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        match &self.coordinated {
            None => format!("kubernetes:{}", self.namespace),
            Some((binary, emulation)) => format!(
                "kubernetes:{} (coordinated, {binary}/{emulation})",
                self.namespace
            ),
        }
    }

    /// Builds the client from the environment (in-cluster, else the kubeconfig) with
    /// [`DEFAULT_REQUEST_TIMEOUT`], and checks the Lease name and the coordination settings.
    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        let lock =
            LeaseLock::from_env(&self.namespace, name, identity, DEFAULT_REQUEST_TIMEOUT).await?;
        Ok(match &self.coordinated {
            None => Box::new(lock),
            Some((binary, emulation)) => Box::new(
                lock.coordinated(Coordination::oldest_emulation_version(binary, emulation))?,
            ),
        })
    }

    /// A Lease per record in the namespace, through one client, read with one list
    /// ([`LeaseSet`](crate::LeaseSet)). Coordinated election assigns one Lease to one candidate
    /// and has no place in a set: refused. The set's names are checked here.
    async fn open_set(&self, name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        if self.coordinated.is_some() {
            return Err(LockError::Misconfigured {
                backend: "kubernetes",
                message: "a shard set cannot use coordinated leader election (binary_version)"
                    .into(),
            });
        }
        let roster = LeaseLock::from_env(
            &self.namespace,
            roster_key(name),
            identity,
            DEFAULT_REQUEST_TIMEOUT,
        )
        .await?;
        Ok(Box::new(roster.lock_set(name, identity)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordination_comes_from_the_parameters() {
        let url = LockUrl::parse("kubernetes://jobs/?binary_version=1.4.0").expect("valid");
        assert_eq!(url.coordinated, Some(("1.4.0".into(), "1.4.0".into())));
        let url = LockUrl::parse("kubernetes://jobs?binary_version=1.5.0&emulation_version=1.4.0")
            .expect("valid");
        assert_eq!(url.coordinated, Some(("1.5.0".into(), "1.4.0".into())));
        assert_eq!(
            LockUrl::parse("kubernetes://jobs")
                .expect("valid")
                .coordinated,
            None
        );
        for (lock, expected) in [
            ("kubernetes://Not_A_Namespace", "needs a namespace name"),
            ("kubernetes://jobs?binary=1.0.0", "unknown parameter"),
            (
                "kubernetes://jobs?emulation_version=1.0.0",
                "needs binary_version",
            ),
        ] {
            let err = LockUrl::parse(lock).expect_err(lock).to_string();
            assert!(err.contains(expected), "{lock}: {err}");
        }
    }
}
