//! The task behind a lock's watch: it waits in `GET_LOCK` (and reads the record) until the
//! holder changes.

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::Duration;

use leader_core::backend::{Backoff, ChangeHub};
use mysql_async::Conn;
use mysql_async::prelude::Queryable;

use super::{CHANNEL, FIRST_FREE_PAUSE, Shared, Summary, WATCH_SILENCE_MARGIN, held};
use crate::store::MysqlStore;

/// The task behind a lock's watch.
pub(super) struct Follower {
    pub(super) lock: Weak<Shared>,
    pub(super) store: MysqlStore,
    pub(super) name: String,
    pub(super) key: String,
    pub(super) interval: Duration,
    pub(super) hub: ChangeHub,
    pub(super) last: Summary,
}

impl Follower {
    /// Until the lock is dropped or closed, or the connection fails or goes silent (its streams
    /// then end, and the elector subscribes again).
    pub(super) async fn run(mut self, mut conn: Conn) {
        if let Err(err) = self.follow(&mut conn).await {
            tracing::debug!(error = %err, "the GET_LOCK lock's watch ended");
        }
        self.hub.close();
        // A silent connection may not take the goodbye either.
        let _ = tokio::time::timeout(WATCH_SILENCE_MARGIN, conn.disconnect()).await;
    }

    async fn follow(&mut self, conn: &mut Conn) -> Result<(), String> {
        // The server drops the watch's session after this long of silence (see
        // `session_timeouts`): a statement unanswered for as long is on a connection that is
        // gone, which no error reports when a NAT or firewall dropped its state.
        let limit = self.interval + WATCH_SILENCE_MARGIN;
        let statements = &self.store.inner().named_statements;
        let seconds = i64::try_from(self.interval.as_secs().max(1)).unwrap_or(i64::MAX);
        // The record as it was when the holder's session was last found gone: the lock is not
        // waited for again until the record changes (the lease may still run for a while).
        let mut gone_at: Option<Summary> = None;
        // How long to wait before reading a free record again: a release is usually followed
        // by a takeover within milliseconds, and the new holder's lock is the one to wait for
        // (the next handover may come at once), so a free record is read again soon, then
        // less and less often: each read that finds it still free counts as a failure.
        let mut free_pause = Backoff::new(FIRST_FREE_PAUSE, self.interval);
        loop {
            let Some(lock) = self.lock.upgrade() else {
                return Ok(());
            };
            let holding = lock.holding.load(Ordering::Acquire);
            drop(lock);
            let wait = !holding && held(&self.last) && gone_at.as_ref() != Some(&self.last);
            let mut let_go = false;
            if wait {
                // A follower never keeps the lock: the statement that gets it lets go of it,
                // so a follower that stops while it waits holds up nobody.
                let key = self.key.as_str();
                let got: Option<Option<i64>> = answered(
                    limit,
                    conn.exec_first(&statements.wait, (key, seconds, key)),
                )
                .await?;
                let_go = got.flatten() == Some(1);
            } else if !holding && !held(&self.last) {
                tokio::time::sleep(free_pause.failed()).await;
            } else {
                tokio::time::sleep(Duration::from_secs(seconds.unsigned_abs())).await;
            }
            let now: Summary = answered(
                limit,
                conn.exec_first(&statements.summary, (self.name.as_str(),)),
            )
            .await?;
            if held(&now) {
                free_pause.succeeded();
            }
            if let_go {
                // Still the record of the holder whose session let go: its lease may run on, so
                // the lock is not waited for until the record changes. A record that changed
                // meanwhile names a holder that took the lock before writing it, or nobody.
                gone_at = (now == self.last).then(|| now.clone());
            }
            if let_go || now != self.last {
                self.hub.notify(CHANNEL);
            }
            self.last = now;
        }
    }
}

/// `statement`'s answer, or an error when it failed or went unanswered for `limit`.
async fn answered<T>(
    limit: Duration,
    statement: impl Future<Output = Result<T, mysql_async::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, statement).await {
        Ok(answer) => answer.map_err(|err| err.to_string()),
        Err(_) => Err(format!("a statement went unanswered for {limit:?}")),
    }
}
