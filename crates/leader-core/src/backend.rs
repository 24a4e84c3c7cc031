//! What a lock implementation needs and a service using the elector does not: the plumbing shared
//! by the backend crates (change notification, SQL columns of a record, batched shard-set
//! requests, key naming, back-off, the checks every lock URL and answer goes through).
//!
//! A service names [`ResourceLock`](crate::ResourceLock) and [`LockSet`](crate::LockSet) as
//! bounds and opens a backend's lock; it implements neither, and needs nothing from here.

use crate::{BoxError, LockError, Observed, UrlError, Version};

pub use crate::backoff::{Backoff, Jitter};
pub use crate::hub::ChangeHub;
pub use crate::lock::HolderCheck;
pub use crate::record::{RENEWAL_STEP, RecordColumns};
pub use crate::shards::{
    KeyedLocks, Known, LockCache, Renewal, RenewedAndRead, Reread, common_prefix, member_key,
    roster_key, shard_key,
};

/// What a batched request makes of one failure: the same error for each record it covered.
pub trait LockErrorExt: Sized {
    /// The same failure again, of the same kind and saying the same (a driver's error becomes
    /// its message): what each record of a batch that failed as a whole reports
    /// ([`for_each`](Self::for_each)).
    #[must_use]
    fn duplicate(&self) -> Self;

    /// This error for each of `n` records: the results of a batch request that failed as a
    /// whole ([`LockSet::get_many`](crate::LockSet::get_many),
    /// [`LockSet::renew_many`](crate::LockSet::renew_many)), each of the same kind.
    fn for_each<T>(&self, n: usize) -> Vec<Result<T, Self>> {
        (0..n).map(|_| Err(self.duplicate())).collect()
    }
}

impl LockErrorExt for LockError {
    fn duplicate(&self) -> Self {
        self.duplicated()
    }
}

/// A write the server refused because the connection takes none: the server is a standby or a
/// replica, or a primary that a failover demoted or fenced read-only, reached through a name
/// or address that still leads to it. Made by [`read_only`], the source of the
/// [`LockError::Unavailable`] it returns; a lock closes the connection that answered so
/// ([`is_read_only`]), and the next request opens another, which the name may lead elsewhere.
#[derive(Debug)]
pub struct ReadOnly {
    source: BoxError,
    advice: &'static str,
}

impl std::fmt::Display for ReadOnly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; the server takes no writes on this connection (a standby or a replica, or a primary demoted or fenced by a failover): the connection is given up, and the next request opens another{}",
            self.source, self.advice
        )
    }
}

impl std::error::Error for ReadOnly {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.source()
    }
}

/// [`LockError::Unavailable`] for a write the server refused as read-only ([`ReadOnly`]), with
/// the driver's error as `source`; `advice`, empty or beginning with `"; "`, ends its message.
pub fn read_only(
    backend: &'static str,
    source: impl Into<BoxError>,
    advice: &'static str,
) -> LockError {
    LockError::unavailable(
        backend,
        ReadOnly {
            source: source.into(),
            advice,
        },
    )
}

/// Whether `err` is a write the server refused as read-only ([`read_only`]): the connection
/// that answered it is of no more use to the lock.
pub fn is_read_only(err: &LockError) -> bool {
    match err {
        LockError::Unavailable { source, .. } => source.is::<ReadOnly>(),
        _ => false,
    }
}

/// A [`LockError::Unmoved`] unless `stored` moved on from `sent`: what a lock whose store can
/// skip an identical write makes of the answer to an `operation` sent at version `sent`.
///
/// # Errors
/// The version did not move.
pub fn unless_moved(
    backend: &'static str,
    operation: &'static str,
    sent: &Version,
    stored: Observed,
) -> Result<Observed, LockError> {
    if stored.version == *sent {
        return Err(LockError::Unmoved {
            backend,
            operation,
            version: sent.as_str().to_owned(),
        });
    }
    Ok(stored)
}

/// S15 at a term's start: what a check of the store's settings answered (`checked`) just after
/// `lock` took `taken`. A refusal ([`LockError::Misconfigured`]) releases the lease at once, so
/// that the term never starts, and is returned; an outage lets the term go on, and the next
/// term checks again.
///
/// # Errors
/// The refusal, as `checked` had it.
pub async fn refuse_at_term_start(
    lock: &dyn crate::ResourceLock,
    taken: &Observed,
    checked: Result<(), LockError>,
) -> Result<(), LockError> {
    let Err(err) = checked else {
        return Ok(());
    };
    if !matches!(err, LockError::Misconfigured { .. }) {
        tracing::debug!(error = %err, "could not check the store's settings at a term's start");
        return Ok(());
    }
    let mut free = taken.record.clone();
    free.holder_identity.clear();
    if let Err(release) = lock.update(&taken.version, &free).await {
        tracing::debug!(error = %release, "could not release a lease refused at its start");
    }
    Err(err)
}

/// A check of the store's settings (S15) whose pass stands for [`SettingsCheck::STANDS_FOR`]:
/// run before an elector starts and again at each term's start. One check runs at a time, and
/// callers that waited for it take its answer, so a shard set's member that takes a thousand
/// shards at once asks the server once, not a thousand times. A refusal or an outage stands
/// only for those who waited for it: the next term asks again.
#[derive(Debug, Default)]
pub struct SettingsCheck {
    /// When the last check ended, and its answer (tokio's clock, paused in tests).
    last: std::sync::Mutex<Option<(tokio::time::Instant, Result<(), LockError>)>>,
    /// Held while a check runs.
    running: tokio::sync::Mutex<()>,
}

impl SettingsCheck {
    /// How long a check that passed stands.
    pub const STANDS_FOR: std::time::Duration = std::time::Duration::from_secs(1);

    /// `check`'s answer, unless a check passed within [`STANDS_FOR`](Self::STANDS_FOR) (then
    /// `Ok` without asking), or one ended while this call waited for it (then its answer).
    ///
    /// # Errors
    /// What `check`, or the check this call waited for, returned.
    pub async fn run<F>(&self, check: F) -> Result<(), LockError>
    where
        F: std::future::Future<Output = Result<(), LockError>>,
    {
        let asked = tokio::time::Instant::now();
        if let Some(answer) = self.answer_since(None) {
            return answer;
        }
        let _turn = self.running.lock().await;
        if let Some(answer) = self.answer_since(Some(asked)) {
            return answer;
        }
        let answer = check.await;
        let kept = answer.as_ref().map_err(LockErrorExt::duplicate).copied();
        *self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((tokio::time::Instant::now(), kept));
        answer
    }

    /// The last check's answer when it passed within [`STANDS_FOR`](Self::STANDS_FOR), or
    /// ended after `asked`, whatever it answered.
    fn answer_since(&self, asked: Option<tokio::time::Instant>) -> Option<Result<(), LockError>> {
        let last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (ended, answer) = last.as_ref()?;
        let stands = answer.is_ok() && ended.elapsed() < Self::STANDS_FOR;
        let waited_for = asked.is_some_and(|asked| *ended > asked);
        (stands || waited_for).then(|| answer.as_ref().map_err(LockErrorExt::duplicate).copied())
    }
}

/// Refuses `url` when an `@` follows the end of its authority (the first `/`, `?` or `#` after
/// `://`). A URL parser ends the user-info there, so such a URL holds one of those characters
/// unencoded in its password (read as the host, port, path or parameters, and shown as them),
/// or an `@` in its path or parameters, which cannot be told apart.
///
/// # Errors
/// Such a URL, with a message asking to percent-encode them.
pub fn check_user_info(url: &str) -> Result<(), UrlError> {
    UrlError::check_user_info(url)
}

/// Whether `name` is a SQL identifier that its quotes alone make safe: 1 to `max_len` bytes of
/// ASCII letters, digits, `_` and `$`, starting with a letter or `_`.
pub fn is_plain_sql_identifier(name: &str, max_len: usize) -> bool {
    !name.is_empty()
        && name.len() <= max_len
        && name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
}

/// 64-bit FNV-1a over `parts`, each followed by a zero byte (so that `["a", "bc"]` and
/// `["ab", "c"]` differ): the same in every build, for the lock keys and names that processes
/// built apart must agree on.
pub fn fnv1a<P: AsRef<[u8]>>(parts: &[P]) -> u64 {
    use crate::shards::assign::{FNV_OFFSET, fnv1a};
    parts.iter().fold(FNV_OFFSET, |hash, part| {
        fnv1a(&[0], fnv1a(part.as_ref(), hash))
    })
}

/// Parses `lock` as a URL of one of `schemes`, after [`check_user_info`]: the start of every
/// backend whose lock URL is a standard URL.
///
/// # Errors
/// A URL [`check_user_info`] refuses, a malformed URL (the parser's message), or another
/// scheme (saying `not_ours`, like `not a postgres:// URL`).
#[cfg(feature = "url")]
#[cfg_attr(docsrs, doc(cfg(feature = "url")))]
pub fn parse_lock_url(lock: &str, schemes: &[&str], not_ours: &str) -> Result<url::Url, UrlError> {
    check_user_info(lock)?;
    let url = url::Url::parse(lock).map_err(|err| UrlError::new(lock, err.to_string()))?;
    if !schemes.contains(&url.scheme()) {
        return Err(UrlError::new(lock, not_ours));
    }
    Ok(url)
}

/// Hands each query parameter of `url` to `own`, which answers `true` for the lock's own, and
/// leaves only the others in the query, in their order: the connection string a driver gets.
///
/// # Errors
/// The first error of `own`, with `url` left as it was.
#[cfg(feature = "url")]
#[cfg_attr(docsrs, doc(cfg(feature = "url")))]
pub fn take_lock_params<E>(
    url: &mut url::Url,
    mut own: impl FnMut(&str, &str) -> Result<bool, E>,
) -> Result<(), E> {
    let mut kept = Vec::new();
    for (key, value) in url.query_pairs() {
        if !own(&key, &value)? {
            kept.push((key.into_owned(), value.into_owned()));
        }
    }
    if kept.is_empty() {
        url.set_query(None);
    } else {
        url.query_pairs_mut().clear().extend_pairs(&kept);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The keys and names made from it must never change (processes of two releases share
    /// them): the values of the FNV-1a specification, and parts kept apart.
    #[test]
    fn hashes_are_stable() {
        assert_eq!(super::fnv1a::<&str>(&[]), 0xcbf2_9ce4_8422_2325);
        // FNV-1a 64 of "a" then a zero byte, by the published algorithm.
        assert_eq!(super::fnv1a(&["a"]), 0x089b_e207_b544_f1e4);
        assert_ne!(super::fnv1a(&["a", "bc"]), super::fnv1a(&["ab", "c"]));
    }

    /// A read-only refusal is an outage that says so and what to do, and is told apart from every other outage, also once a batch
    /// duplicated it (a duplicate's connection was settled already).
    #[test]
    fn read_only_refusals_are_outages_told_apart() {
        use super::{LockErrorExt, is_read_only, read_only};
        use crate::LockError;
        let driver = std::io::Error::other("cannot execute UPDATE in a read-only transaction");
        let err = read_only("db", driver, "; add target_session_attrs=read-write");
        assert!(is_read_only(&err), "{err:?}");
        let message = err.to_string();
        for words in [
            "read-only transaction",
            "connection is given up",
            "read-write",
        ] {
            assert!(message.contains(words), "{words}: {message}");
        }
        assert!(!is_read_only(&LockError::unavailable(
            "db",
            "connection refused"
        )));
        assert!(!is_read_only(&err.duplicate()));
    }

    /// The settings check of a store: its pass stands for a second; one check runs at a time,
    /// and whoever waited for it takes its answer, a refusal too; a refusal or an outage is
    /// not kept for those who come after it.
    #[tokio::test(start_paused = true)]
    async fn a_settings_check_runs_once_for_those_who_wait_and_a_pass_stands_a_second() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::time::Duration;

        use super::SettingsCheck;
        use crate::LockError;

        let check = SettingsCheck::default();
        let asked = AtomicUsize::new(0);
        let refuse = std::sync::atomic::AtomicBool::new(false);
        let read = || async {
            asked.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(100)).await;
            if refuse.load(Ordering::SeqCst) {
                Err(LockError::Misconfigured {
                    backend: "test",
                    message: "refused".to_owned(),
                })
            } else {
                Ok(())
            }
        };
        let many = |n: usize| futures_util::future::join_all((0..n).map(|_| check.run(read())));

        let answers = many(32).await;
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        assert_eq!(asked.load(Ordering::SeqCst), 1, "one check for 32 callers");
        tokio::time::sleep(Duration::from_millis(800)).await;
        check.run(read()).await.expect("stands");
        assert_eq!(
            asked.load(Ordering::SeqCst),
            1,
            "a pass stands for a second"
        );

        tokio::time::sleep(SettingsCheck::STANDS_FOR).await;
        refuse.store(true, Ordering::SeqCst);
        let answers = many(8).await;
        assert!(
            answers
                .iter()
                .all(|answer| matches!(answer, Err(LockError::Misconfigured { .. }))),
            "{answers:?}"
        );
        assert_eq!(asked.load(Ordering::SeqCst), 2, "one check for 8 callers");
        assert!(check.run(read()).await.is_err());
        assert_eq!(asked.load(Ordering::SeqCst), 3, "a refusal is asked again");

        refuse.store(false, Ordering::SeqCst);
        check.run(read()).await.expect("passes again");
        assert_eq!(asked.load(Ordering::SeqCst), 4);
    }
}
