//! The watches: the holder's of its own key and of the waiting candidates during its term, and
//! the followers' change stream of the key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Event, EventType, GetOptions, GetResponse, WatchOptions, WatchResponse, WatchStream,
};
use futures_util::StreamExt;
use leader_core::backend::{Backoff, Jitter};
use leader_core::{ChangeStream, LeaderElectionRecord};

use crate::error::BACKEND;
use crate::queue::Successor;
use crate::seen::Seen;
use crate::store::EtcdStore;

/// The largest watch answer taken. A watch that starts again from a past revision (after its
/// stream failed, or on another member) is sent the events it missed, up to a thousand
/// revisions in one answer (etcd's `syncWatchers`), which a set's records with their
/// extensions, each written every round while the watch was down, take past gRPC's default of
/// 4 MiB: the answer would fail to decode, and the watch start again from the same revision,
/// for ever. etcd's own client takes answers of any size.
const WATCH_BYTES: usize = i32::MAX as usize;

/// A watch client of `client` that takes answers up to [`WATCH_BYTES`].
pub(crate) fn watch_client(client: &Client) -> etcd_client::WatchClient {
    client.watch_client().max_decoding_message_size(WATCH_BYTES)
}

/// The holder's watch of its own key and of the waiting candidates: the highest revision of
/// any event on the key, whether the watch runs, and the candidates as last reported. A renewal
/// may skip the record while nothing was written after the holder's last write, and a release
/// picks its successor without a read.
pub(crate) struct TermWatch {
    latest: Arc<AtomicI64>,
    healthy: Arc<AtomicBool>,
    /// The waiting candidates by identity; `None` until read, or once the watch stopped.
    waiting: Arc<Mutex<Option<HashMap<String, Successor>>>>,
    task: tokio::task::AbortHandle,
}

impl TermWatch {
    /// Watches `key` from `revision + 1`, and the candidates under `prefix` from a read of
    /// them, in the background, on one watch stream to the member the store talks to. When the
    /// stream fails, or the store moved to another member (this one did not answer a request in
    /// time: it may be frozen or cut off, and its watch silent), the watch starts again on the
    /// member the store talks to now, after a read of the key.
    pub(crate) fn start(store: EtcdStore, key: String, prefix: String, revision: i64) -> Self {
        let latest = Arc::new(AtomicI64::new(revision));
        let healthy = Arc::new(AtomicBool::new(false));
        let waiting = Arc::new(Mutex::new(None));
        let task = tokio::spawn({
            let (latest, healthy, waiting) = (latest.clone(), healthy.clone(), waiting.clone());
            async move {
                let members = &store.inner.members;
                let mut resume = revision + 1;
                let mut restarting = false;
                let mut reconnects = Reconnects::new(members.member_timeout());
                loop {
                    // A watch that starts again reads the key first, and goes on after that
                    // read: what the writes since its last event did to the key is in its
                    // last write. Started from that event instead, it would have etcd read
                    // every revision of the whole store since, for each restart of each term.
                    if restarting {
                        match members
                            .call(true, |mut client| {
                                let key = key.clone();
                                async move { client.get(key, None).await }
                            })
                            .await
                        {
                            Ok(read) => {
                                let at = read.header().map_or(0, |h| h.revision());
                                let written = read.kvs().first().map_or(at, |kv| kv.mod_revision());
                                latest.fetch_max(written, Ordering::AcqRel);
                                resume = at + 1;
                            }
                            Err(_) => {
                                tokio::time::sleep(members.member_timeout()).await;
                                continue;
                            }
                        }
                    }
                    let index = members.current();
                    let started = tokio::time::Instant::now();
                    let from = resume.max(latest.load(Ordering::Acquire) + 1);
                    let outcome = match members.client(index).await {
                        Ok(client) => {
                            members.note_sent();
                            watch_term(
                                client,
                                (&key, &prefix),
                                from,
                                (&latest, &healthy, &waiting),
                                || members.current() != index,
                            )
                            .await
                        }
                        Err(_) => Ended::Failed,
                    };
                    let came_up = healthy.swap(false, Ordering::AcqRel);
                    *waiting.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    restarting = true;
                    match outcome {
                        // The revisions it needs are compacted away: the read above tells.
                        Ended::Compacted(_) => {}
                        Ended::Failed => {
                            members.skip(index);
                            tokio::time::sleep(reconnects.failed(started, came_up)).await;
                        }
                        Ended::Moved => {}
                    }
                }
            }
        })
        .abort_handle();
        Self {
            latest,
            healthy,
            waiting,
            task,
        }
    }

    /// Whether the watch runs and has seen no write of the key after revision `written`.
    pub(crate) fn clean(&self, written: i64) -> bool {
        self.healthy.load(Ordering::Acquire) && self.latest.load(Ordering::Acquire) <= written
    }

    /// The waiting candidates as the watch knows them, `None` when it does not.
    pub(crate) fn waiting(&self) -> Option<Vec<Successor>> {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.as_ref().map(|w| w.values().cloned().collect())
    }
}

impl Drop for TermWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The waits between a watch's attempts to run again (S9): from a quarter of the member
/// timeout, doubling up to eight member timeouts, a fifth longer at most at random, so that a
/// cluster that is down is not asked four times a second by every watch. A watch that ran
/// for a member timeout once its stream opened starts again from the shortest wait.
pub(crate) struct Reconnects {
    backoff: Backoff,
    steady: Duration,
}

impl Reconnects {
    pub(crate) fn new(member_timeout: Duration) -> Self {
        Self {
            backoff: Backoff::new(member_timeout / 4, member_timeout * 8)
                .jitter(Jitter::Longer(0.2)),
            steady: member_timeout,
        }
    }

    /// The wait after a watch that started at `started` ended in failure; `came_up`: it ran
    /// (its stream opened), which an attempt that hung on a silent member did not.
    pub(crate) fn failed(&mut self, started: tokio::time::Instant, came_up: bool) -> Duration {
        if came_up && started.elapsed() >= self.steady {
            self.backoff.succeeded();
        }
        self.backoff.failed()
    }
}

/// How a watch on one member ended.
pub(crate) enum Ended {
    /// The stream failed or ended.
    Failed,
    /// The store moved to another member.
    Moved,
    /// The revisions it needed were compacted: the oldest one left.
    Compacted(i64),
}

/// The next message of a watch on one member, or how the watch ended: every half second (on
/// `check`) it gives up when `moved` says the store talks to another member now, so that a
/// silent stream on a frozen member is not waited on.
pub(crate) async fn next_message(
    stream: &mut WatchStream,
    check: &mut tokio::time::Interval,
    moved: &impl Fn() -> bool,
) -> Result<WatchResponse, Ended> {
    loop {
        let message = tokio::select! {
            message = stream.message() => message,
            _ = check.tick() => {
                if moved() {
                    return Err(Ended::Moved);
                }
                continue;
            }
        };
        let Ok(Some(message)) = message else {
            return Err(Ended::Failed);
        };
        if message.compact_revision() > 0 {
            return Err(Ended::Compacted(message.compact_revision()));
        }
        if message.canceled() {
            return Err(Ended::Failed);
        }
        return Ok(message);
    }
}

/// A half-second timer for [`next_message`].
pub(crate) fn member_check() -> tokio::time::Interval {
    tokio::time::interval(std::time::Duration::from_millis(500))
}

type Shared<'a> = (
    &'a AtomicI64,
    &'a AtomicBool,
    &'a Mutex<Option<HashMap<String, Successor>>>,
);

/// One term watch on `client`'s member, from revision `from`, until it fails or `moved` says the
/// store talks to another member now (checked every half second, so that a silent stream on a
/// frozen member is given up).
async fn watch_term(
    mut client: Client,
    (key, prefix): (&str, &str),
    from: i64,
    (latest, healthy, waiting): Shared<'_>,
    moved: impl Fn() -> bool,
) -> Ended {
    let options = WatchOptions::new().with_start_revision(from);
    let Ok(mut stream) = watch_client(&client).watch(key, Some(options)).await else {
        return Ended::Failed;
    };
    healthy.store(true, Ordering::Release);
    let known = |read: &GetResponse| -> HashMap<String, Successor> {
        Successor::all_in(prefix, read)
            .map(|c| (c.identity.clone(), c))
            .collect()
    };
    // The candidates as read, then every change after that read.
    if let Ok(read) = client
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await
    {
        let from = read.header().map_or(0, |h| h.revision()) + 1;
        let options = WatchOptions::new().with_prefix().with_start_revision(from);
        if stream.watch(prefix, Some(options)).await.is_ok() {
            *waiting.lock().unwrap_or_else(|e| e.into_inner()) = Some(known(&read));
        }
    }
    let mut check = member_check();
    loop {
        let message = match next_message(&mut stream, &mut check, &moved).await {
            Ok(message) => message,
            Err(ended) => return ended,
        };
        for event in message.events() {
            let Some(kv) = event.kv() else { continue };
            if kv.key() == key.as_bytes() {
                latest.fetch_max(kv.mod_revision(), Ordering::AcqRel);
                continue;
            }
            let mut waiting = waiting.lock().unwrap_or_else(|e| e.into_inner());
            let (Some(waiting), Some(identity)) = (
                waiting.as_mut(),
                kv.key_str().ok().and_then(|k| k.strip_prefix(prefix)),
            ) else {
                continue;
            };
            match Successor::registered(prefix, kv) {
                Some(candidate) if event.event_type() == EventType::Put => {
                    waiting.insert(identity.to_owned(), candidate);
                }
                _ => {
                    waiting.remove(identity);
                }
            }
        }
    }
}

/// A follower's change stream from a watch of the record key: only what the candidate
/// `identity` acts on (the key deleted, released or expired on etcd's clock; a free record; a
/// handover request; the lease handed to it). Renewals wake nobody, nor do the lock's own writes
/// of the record (the holder's, of what it keeps in the extensions). What the
/// watch reports is remembered in `seen`, so that a takeover is one transaction (or none).
///
/// The stream ends when the watch does: on an error, and when etcd cancels it (a watcher that
/// fell behind the compacted revisions, say), after which the gRPC stream stays open but
/// reports nothing more; the elector then watches again.
pub(crate) fn changes(
    stream: WatchStream,
    seen: Arc<Mutex<Seen>>,
    identity: String,
) -> ChangeStream {
    let changes = stream
        .take_while(|message| std::future::ready(message.as_ref().is_ok_and(|m| !m.canceled())))
        .filter(move |message| {
            let fire = message.as_ref().is_ok_and(|m| {
                let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                let mut fire = false;
                for event in m.events() {
                    // The lock's own write was answered to its caller already: the holder's
                    // own writes of its record wake nobody.
                    if !seen.wrote_it(event) {
                        fire |= acts_on(event, &identity);
                        seen.learn(event);
                    }
                }
                fire
            });
            std::future::ready(fire)
        })
        .map(|_| ());
    Box::pin(changes)
}

/// A watch event the candidate `identity` acts on: a deletion, or a record that is free, asks
/// for a handover, names `identity` (a release handed it the lease), or cannot be read (which
/// the next read reports).
fn acts_on(event: &Event, identity: &str) -> bool {
    match (event.event_type(), event.kv()) {
        (EventType::Put, Some(kv)) => LeaderElectionRecord::from_json(BACKEND, "", kv.value())
            .map_or(true, |r| {
                r.is_free() || r.handover_to().is_some() || r.holder_identity == identity
            }),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watch from a past revision is sent what it missed in one answer, here 6 MiB of a
    /// key's history: taken whole, where gRPC's default of 4 MiB failed every answer.
    #[tokio::test]
    async fn a_watch_takes_a_catch_up_larger_than_four_mebibytes() {
        let endpoints = leader_test_support::etcd_endpoints();
        let Ok(mut client) = Client::connect(&endpoints, None).await else {
            assert!(
                !leader_test_support::in_ci(),
                "CI=true and no etcd at {endpoints:?}"
            );
            return;
        };
        let key = leader_test_support::unique("leader-watch-catch-up");
        let value = vec![b'x'; 64 << 10];
        let mut first = 0;
        for i in 0..96 {
            let put = client
                .put(key.as_str(), value.clone(), None)
                .await
                .expect("put");
            if i == 0 {
                first = put.header().expect("header").revision();
            }
        }
        let options = || Some(WatchOptions::new().with_start_revision(first));
        let mut stream = watch_client(&client)
            .watch(key.as_str(), options())
            .await
            .expect("watch");
        let mut events = 0;
        while events < 96 {
            let answer = tokio::time::timeout(Duration::from_secs(10), stream.message())
                .await
                .expect("an answer")
                .expect("an answer taken whole")
                .expect("the stream goes on");
            events += answer.events().len();
        }
        assert_eq!(events, 96);
        // gRPC's default refuses it: the case at hand.
        let mut stream = client.watch(key.as_str(), options()).await.expect("watch");
        let refused = loop {
            match stream.message().await {
                Ok(Some(answer)) if answer.events().is_empty() => {}
                other => break other,
            }
        };
        assert!(refused.is_err(), "{refused:?}");
        client.delete(key.as_str(), None).await.expect("delete");
    }
}
