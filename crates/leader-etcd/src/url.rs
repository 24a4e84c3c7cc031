//! `etcd://` and `etcds://` lock URLs: several members in the authority, an optional user, and
//! the key prefix.

use leader_core::{LockError, LockSet, LockTarget, ResourceLock, UrlError, async_trait};
use percent_encoding::percent_decode_str;

use crate::store::{EtcdStore, EtcdStoreBuilder};

/// An etcd lock URL: `etcd://user:pass@host1:2379,host2:2379/?prefix=P&member_timeout=1s` (or
/// `etcds://` for TLS, with the system's roots). Give every member, so that the lock can move to
/// another when one fails; `prefix` sets the key prefix, `member_timeout` how long a request
/// waits for one member before it goes to the next
/// ([`EtcdStoreBuilder::member_timeout`]).
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    endpoints: Vec<String>,
    user: Option<(String, String)>,
    prefix: Option<String>,
    member_timeout: Option<std::time::Duration>,
}

impl std::fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl LockUrl {
    /// Parses an `etcd://` or `etcds://` URL.
    ///
    /// # Errors
    /// Another scheme, no host, or a malformed URL.
    pub fn parse(lock: &str) -> Result<Self, UrlError> {
        let invalid = |message: String| UrlError::new(lock, message);
        leader_core::backend::check_user_info(lock)?;
        let (scheme, rest) = lock
            .split_once("://")
            .filter(|(scheme, _)| matches!(*scheme, "etcd" | "etcds"))
            .ok_or_else(|| invalid("not an etcd:// URL".to_owned()))?;
        // Several hosts in the authority, which URL parsers do not take: split them by hand,
        // and parse the rest (user, password, query) as a URL with the first host alone.
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        let (user_info, hosts) = match authority.rsplit_once('@') {
            Some((user_info, hosts)) => (Some(user_info), hosts),
            None => (None, authority),
        };
        if hosts.is_empty() || hosts.split(',').any(str::is_empty) {
            return Err(invalid("no etcd host".to_owned()));
        }
        let first = hosts.split(',').next().unwrap_or_default();
        let single = format!(
            "{scheme}://{}{first}{}",
            user_info.map(|u| format!("{u}@")).unwrap_or_default(),
            &rest[authority_end..]
        );
        let url = url::Url::parse(&single).map_err(|err| invalid(err.to_string()))?;
        let http = if scheme == "etcds" { "https" } else { "http" };
        // A user-info is percent-encoded, not form data: `+`, `&` and `=` stand for themselves.
        let decode = |part: &str| {
            percent_decode_str(part)
                .decode_utf8()
                .map(|decoded| decoded.into_owned())
                .map_err(|_| {
                    invalid("the user or password is not UTF-8 once percent-decoded".to_owned())
                })
        };
        let user = match url.username() {
            "" => None,
            user => Some((
                decode(user)?,
                url.password().map(decode).transpose()?.unwrap_or_default(),
            )),
        };
        let mut prefix = None;
        let mut member_timeout = None;
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "prefix" => prefix = Some(value.into_owned()),
                "member_timeout" => {
                    let timeout = humantime::parse_duration(&value)
                        .ok()
                        .filter(|t| !t.is_zero())
                        .ok_or_else(|| {
                            invalid(format!(
                                "member_timeout {value:?} is not a duration above zero (say 500ms or 1s)"
                            ))
                        })?;
                    member_timeout = Some(timeout);
                }
                other => {
                    return Err(invalid(format!(
                        "unknown parameter {other:?}; etcd:// takes prefix and member_timeout"
                    )));
                }
            }
        }
        Ok(Self {
            endpoints: hosts
                .split(',')
                .map(|host| format!("{http}://{host}"))
                .collect(),
            user,
            prefix,
            member_timeout,
        })
    }

    /// Parses `lock` into a [`LockTarget`], for the `leader` facade's scheme table.
    ///
    /// # Errors
    /// As [`parse`](Self::parse).
    pub fn target(lock: &str) -> Result<Box<dyn LockTarget>, UrlError> {
        Ok(Box::new(Self::parse(lock)?))
    }

    /// The members' endpoints, `http://host:port` or `https://...`.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// A store builder with the URL's members, user and prefix.
    pub fn store(&self) -> EtcdStoreBuilder {
        let mut builder = EtcdStore::builder(&self.endpoints);
        if let Some((user, password)) = &self.user {
            builder = builder.user(user, password);
        }
        if let Some(prefix) = &self.prefix {
            builder = builder.prefix(prefix);
        }
        if let Some(timeout) = self.member_timeout {
            builder = builder.member_timeout(timeout);
        }
        builder
    }
}

#[async_trait]
impl LockTarget for LockUrl {
    fn describe(&self) -> String {
        format!("etcd:{}", self.endpoints.join(","))
    }

    async fn open(&self, name: &str, identity: &str) -> Result<Box<dyn ResourceLock>, LockError> {
        Ok(Box::new(self.store().build().await?.lock(name, identity)))
    }

    /// A key per record, on one client; the set read in one range request, a member's records
    /// on one etcd lease.
    async fn open_set(&self, name: &str, identity: &str) -> Result<Box<dyn LockSet>, LockError> {
        Ok(Box::new(
            self.store().build().await?.lock_set(name, identity),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_user_and_prefix() {
        let url = LockUrl::parse("etcds://u:p@a:2379,b:2379/?prefix=x/").expect("valid");
        assert_eq!(url.endpoints(), ["https://a:2379", "https://b:2379"]);
        assert_eq!(url.user, Some(("u".into(), "p".into())));
        assert_eq!(url.prefix.as_deref(), Some("x/"));
        assert_eq!(url.describe(), "etcd:https://a:2379,https://b:2379");
        let url = LockUrl::parse("etcd://a:1,b:2/?member_timeout=300ms").expect("valid");
        assert_eq!(
            url.member_timeout,
            Some(std::time::Duration::from_millis(300))
        );
        for bad in ["member_timeout=0s", "member_timeout=soon"] {
            let err = LockUrl::parse(&format!("etcd://a:1/?{bad}")).expect_err(bad);
            assert!(err.to_string().contains("member_timeout"), "{err}");
        }
        let err = LockUrl::parse("etcd://u:secret@/x").expect_err("no host");
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    /// The user and password are percent-decoded and nothing else: `+` is no space, `&` and
    /// `=` end nothing.
    #[test]
    fn user_info_is_percent_decoded_only() {
        for (user_info, user, password) in [
            ("app:a+b", "app", "a+b"),
            ("app:a&b=c", "app", "a&b=c"),
            ("app:x=1&y=2+3", "app", "x=1&y=2+3"),
            ("app:a%2Bb", "app", "a+b"),
            ("app:a%26b%3Dc%25d", "app", "a&b=c%d"),
            ("app:p%40ss%2Fw%3Ford%23", "app", "p@ss/w?ord#"),
            ("app:%C3%A9t%C3%A9+", "app", "\u{e9}t\u{e9}+"),
            ("a+p%2Bp:pw", "a+p+p", "pw"),
            ("app:", "app", ""),
            ("app", "app", ""),
        ] {
            let url = LockUrl::parse(&format!("etcd://{user_info}@a:2379,b:2379/?prefix=x/"))
                .expect(user_info);
            assert_eq!(
                url.user,
                Some((user.to_owned(), password.to_owned())),
                "{user_info}"
            );
        }
        let err = LockUrl::parse("etcd://app:s3cret%FF@a:2379/").expect_err("not UTF-8");
        assert!(err.message.contains("not UTF-8"), "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
}
