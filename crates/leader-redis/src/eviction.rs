//! The server's eviction setting (S15): a Redis that evicts keys when its memory is full can
//! drop a held lock behind its holder's back, and with an `allkeys-*` policy the fencing
//! counter too (tokens would start over). Checked when the store is built and again at every
//! term's start, since `CONFIG SET` changes it on a running server.

use std::sync::Mutex;

use leader_core::LockError;
use leader_core::backend::SettingsCheck;
use redis::aio::ConnectionManager;

use crate::error::{BACKEND, map};

/// What the store last learned of the server's eviction setting.
#[derive(Debug, Default)]
pub(crate) struct EvictionCheck {
    /// The check, which stands for a second once it passed.
    passed: SettingsCheck,
    /// Whether the server refused to tell (an ACL without `INFO`), which is said once.
    unknown_said: Mutex<bool>,
}

/// The server's memory limit and what it does when it is reached, from `INFO memory`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Eviction {
    /// `maxmemory` in bytes; 0: no limit, so nothing is ever evicted.
    pub(crate) maxmemory: u64,
    /// `maxmemory-policy`.
    pub(crate) policy: String,
}

impl Eviction {
    /// Reads the two fields of an `INFO memory` answer; `None` when either is missing.
    pub(crate) fn parse(info: &str) -> Option<Self> {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.trim_end().strip_prefix(name)?.strip_prefix(':'))
        };
        Some(Self {
            maxmemory: field("maxmemory")?.parse().ok()?,
            policy: field("maxmemory_policy")?.to_owned(),
        })
    }

    /// Why this setting can take a held lock away, if it can: a memory limit with any policy
    /// but `noeviction`.
    pub(crate) fn refusal(&self, server: &str) -> Option<String> {
        if self.maxmemory == 0 || self.policy == "noeviction" {
            return None;
        }
        let what = if self.policy.starts_with("allkeys-") {
            "any key, a held lock and its fencing counter too (tokens would start over)"
        } else {
            "keys with a TTL, a held lock among them"
        };
        Some(format!(
            "{server} evicts {what} when its memory is full (maxmemory-policy {}, maxmemory {} \
             bytes): a lock there can vanish while its holder leads; set maxmemory-policy \
             noeviction (CONFIG SET maxmemory-policy noeviction, or in redis.conf), or use a \
             Redis that keeps every key",
            self.policy, self.maxmemory
        ))
    }
}

impl EvictionCheck {
    /// Checks the eviction setting of `server` (its redacted address) over `connection`:
    /// [`LockError::Misconfigured`] naming it when the server can evict the lock's keys. A
    /// server that will not tell (`INFO` denied by its ACL) is accepted with a warning, said
    /// once; an outage is returned as it is. A check that passed stands for a second.
    pub(crate) async fn run(
        &self,
        server: &str,
        connection: ConnectionManager,
    ) -> Result<(), LockError> {
        self.passed.run(self.read(server, connection)).await
    }

    /// [`run`](Self::run)'s reading, every time.
    async fn read(&self, server: &str, mut connection: ConnectionManager) -> Result<(), LockError> {
        let info: Result<String, _> = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut connection)
            .await;
        let eviction = match info {
            Ok(info) => Eviction::parse(&info),
            Err(err) if err.code() == Some("NOPERM") => None,
            Err(err) => return Err(map(server, err)),
        };
        let Some(eviction) = eviction else {
            let mut said = self.unknown_said.lock().unwrap_or_else(|p| p.into_inner());
            if !*said {
                *said = true;
                tracing::warn!(
                    server,
                    "could not read the server's maxmemory-policy (INFO memory): a Redis that \
                     evicts keys can drop a held lock; make sure it is noeviction"
                );
            }
            return Ok(());
        };
        match eviction.refusal(server) {
            Some(message) => Err(LockError::Misconfigured {
                backend: BACKEND,
                message,
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_memory_is_read() {
        let info = "# Memory\r\nused_memory:1000\r\nmaxmemory:1073741824\r\nmaxmemory_human:1.00G\r\nmaxmemory_policy:allkeys-lru\r\n";
        assert_eq!(
            Eviction::parse(info),
            Some(Eviction {
                maxmemory: 1 << 30,
                policy: "allkeys-lru".into()
            })
        );
        assert_eq!(Eviction::parse("# Memory\r\nused_memory:1\r\n"), None);
    }

    #[test]
    fn only_a_limit_with_an_evicting_policy_is_refused() {
        let setting = |maxmemory, policy: &str| Eviction {
            maxmemory,
            policy: policy.into(),
        };
        assert_eq!(setting(0, "allkeys-lru").refusal("s"), None, "no limit");
        assert_eq!(setting(1 << 30, "noeviction").refusal("s"), None);
        for policy in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
        ] {
            let message = setting(1 << 30, policy).refusal("s").expect(policy);
            assert!(message.contains(policy), "{message}");
            assert!(message.contains("noeviction"), "{message}");
        }
        assert!(
            setting(1, "allkeys-lru")
                .refusal("s")
                .unwrap()
                .contains("fencing counter")
        );
    }
}
