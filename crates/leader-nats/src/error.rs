//! Mapping of client errors onto the core's error kinds, with credentials removed.

use std::error::Error as StdError;
use std::time::{Duration, Instant};

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use leader_core::LockError;

pub(crate) const BACKEND: &str = "nats";

/// What the server last refused this client, from its asynchronous error events: a
/// permissions violation or a failed login is reported that way, and the request it concerns
/// only times out.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    last: std::sync::Mutex<Option<(Instant, String)>>,
}

/// How long after a refusal a timed-out request is taken to be what was refused.
const REFUSAL_WINDOW: Duration = Duration::from_secs(30);

impl Refusals {
    pub(crate) fn record(&self, message: String) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), message));
    }

    pub(crate) fn clear(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn recent(&self) -> Option<String> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.as_ref()
            .filter(|(at, _)| at.elapsed() < REFUSAL_WINDOW)
            .map(|(_, message)| message.clone())
    }
}

/// The JetStream API error code and HTTP-like status the server answered with, if it did: the
/// client keeps them in its error kinds (not as a source), so they are read from the messages
/// of `err`'s chain, which end in "(code 404, error code 10059)".
fn api_error(err: &(dyn StdError + 'static)) -> Option<(u64, u64)> {
    let mut current = Some(err);
    while let Some(err) = current {
        if let Some(api) = err.downcast_ref::<async_nats::jetstream::Error>() {
            return Some((api.code() as u64, api.error_code().0));
        }
        let text = err.to_string();
        if let Some(at) = text.rfind("(code ") {
            let numbers: Vec<u64> = text[at..]
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|n| n.parse().ok())
                .collect();
            if let [status, code, ..] = numbers[..] {
                return Some((status, code));
            }
        }
        current = err.source();
    }
    None
}

/// Whether the server answered that the stream does not exist (not a write nobody answered).
fn stream_answered_not_found(err: &(dyn StdError + 'static)) -> bool {
    api_error(err).is_some_and(|(_, code)| ErrorCode(code) == ErrorCode::STREAM_NOT_FOUND)
}

/// The JetStream API's "wrong last sequence" without the sequence (10164, nats-server 2.11 and
/// later): a replicated stream refuses a compare-and-swap on a key while another write to it is
/// in flight (`jetstream_batching.go`), which the client does not read as a lost race.
const WRONG_LAST_SEQUENCE_CONSTANT: ErrorCode = ErrorCode(10164);

/// Whether the server refused a compare-and-swap because the key's last revision was not the
/// one expected, however it said so: the client's own kind covers 10071 alone.
pub(crate) fn lost_race(err: &(dyn StdError + 'static)) -> bool {
    api_error(err).is_some_and(|(_, code)| {
        let code = ErrorCode(code);
        code == ErrorCode::STREAM_WRONG_LAST_SEQUENCE || code == WRONG_LAST_SEQUENCE_CONSTANT
    })
}

/// Whether `err` says that the bucket's stream does not exist: the JetStream API's "stream not
/// found" (10059), or a write to the bucket's subjects that no stream takes (the client's
/// `StreamNotFound`, from the server's "no responders").
pub(crate) fn stream_not_found(err: &(dyn StdError + 'static)) -> bool {
    if stream_answered_not_found(err) {
        return true;
    }
    let mut current = Some(err);
    while let Some(err) = current {
        if err
            .downcast_ref::<PublishError>()
            .is_some_and(|err| err.kind() == PublishErrorKind::StreamNotFound)
        {
            return true;
        }
        current = err.source();
    }
    false
}

/// The whole chain of `err`'s messages, for errors whose kind alone says little.
fn chain(err: &(dyn StdError + 'static)) -> String {
    let mut message = err.to_string();
    let mut current = err.source();
    while let Some(source) = current {
        let next = source.to_string();
        if !message.contains(&next) {
            message.push_str(": ");
            message.push_str(&next);
        }
        current = source.source();
    }
    message
}

/// Maps a client error onto a [`LockError`] kind. `timed_out` says whether the client gave up
/// waiting (no answer), which a recent refusal by the server explains.
pub(crate) fn map(
    context: &str,
    refusals: &Refusals,
    timed_out: bool,
    err: impl StdError + Send + Sync + 'static,
) -> LockError {
    if stream_answered_not_found(&err) {
        return LockError::Misconfigured {
            backend: BACKEND,
            message: format!(
                "{context}: {}; the bucket's stream is gone (deleted?): create the bucket (`nats kv add BUCKET --history 1`, or NatsStoreBuilder::create_bucket(true))",
                chain(&err)
            ),
        };
    }
    // A write that no stream answered: the bucket's stream deleted, or only between leaders
    // (its leader being elected, its one server restarting), which a routine failover of a
    // cluster is. The lookup that follows tells them apart, as the server answers it.
    if stream_not_found(&err) {
        return LockError::unavailable(
            BACKEND,
            format!(
                "{context}: {}; no stream answered for the bucket: its leader is being elected or its server is down, or the bucket was deleted (the next request says which)",
                chain(&err)
            ),
        );
    }
    if let Some((status, code)) = api_error(&err) {
        let message = format!("{context}: {}", chain(&err));
        return match ErrorCode(code) {
            ErrorCode::JETSTREAM_NOT_ENABLED | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT => {
                LockError::Misconfigured {
                    backend: BACKEND,
                    message: format!(
                        "{message}; enable JetStream on the server (`nats-server -js`) and for the account"
                    ),
                }
            }
            // Not enough servers for the stream, no leader yet (a cluster electing one), the
            // server shutting down or out of resources: transient.
            _ if matches!(status, 500 | 503) => {
                LockError::unavailable(BACKEND, Context::new(context, &err))
            }
            _ => LockError::other(BACKEND, Context::new(context, &err)),
        };
    }
    if timed_out && let Some(refused) = refusals.recent() {
        return LockError::Forbidden {
            backend: BACKEND,
            message: format!(
                "{context}: no answer, and the server refused this client: {refused}; grant the user publish rights on $JS.API.>, $KV.<bucket>.> and $JS.FC.KV_<bucket>.> (the watch's flow control) and subscribe rights on _INBOX.> (in the server's authorization block or the account's user)"
            ),
        };
    }
    LockError::unavailable(BACKEND, Context::new(context, &err))
}

/// A client error with the lock's context, for `source` fields. The client never puts
/// passwords or tokens in its errors; `context` is a redacted URL, a bucket or a key.
#[derive(Debug)]
pub(crate) struct Context {
    message: String,
}

impl Context {
    pub(crate) fn new(context: &str, err: &(dyn StdError + 'static)) -> Self {
        Self {
            message: format!("{context}: {}", chain(err)),
        }
    }
}

impl std::fmt::Display for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl StdError for Context {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write no stream answered (the client's `StreamNotFound`, from "no responders") is
    /// what a stream between leaders gives as well as a deleted one: an outage that says both,
    /// not a misconfiguration telling the operator to create the bucket.
    #[test]
    fn a_write_no_stream_answered_is_an_outage() {
        let unanswered = PublishError::new(PublishErrorKind::StreamNotFound);
        let err = map("ctx", &Refusals::default(), false, unanswered);
        assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains("leader is being elected") && message.contains("deleted"),
            "{message}"
        );
    }

    /// A compare-and-swap refused for the key's last revision is a lost race however the
    /// server says so: 10071 with the sequence, or 10164 without it (a replicated stream on
    /// nats-server 2.11 and later, while another write to the key is in flight), as the
    /// client hands them on in an update's error chain. Other refusals are not.
    #[test]
    fn both_wrong_last_sequence_answers_are_lost_races() {
        use async_nats::jetstream::kv::UpdateError;
        let answer = |code: u64| -> UpdateError {
            let api: async_nats::jetstream::Error = serde_json::from_value(serde_json::json!({
                "code": 400,
                "err_code": code,
                "description": "wrong last sequence",
            }))
            .expect("an API error");
            PublishError::with_source(PublishErrorKind::Other, api).into()
        };
        assert!(lost_race(&answer(10164)));
        assert!(lost_race(&answer(10071)));
        assert!(!lost_race(&answer(10059)), "stream not found");
        assert!(!lost_race(&PublishError::new(
            PublishErrorKind::StreamNotFound
        )));
    }
}
