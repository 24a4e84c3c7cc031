//! The work of one term: the `on_started_leading` callbacks running as tasks, and the clones of
//! the term's [`Leadership`] they keep. The runner asks it whether the work ended by itself
//! (which ends the term, or restarts the work, S13) and waits for it to stop (S6).

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::{Id, JoinError, JoinSet};
use tokio::time::{sleep, timeout};

use crate::config::WorkExit;
use crate::leadership::Leadership;

pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;
/// An `on_started_leading` callback.
pub(crate) type StartedFn = Arc<dyn Fn(Leadership) -> BoxFuture + Send + Sync>;

/// How the term's work ended by itself, when that ends the term.
#[derive(Debug)]
pub(crate) enum WorkEnd {
    /// Every callback returned and no clone of the leadership is left.
    Returned,
    /// A callback panicked (its message is logged).
    Panicked,
}

/// The running work of one term.
pub(crate) struct TermWork {
    callbacks: Vec<StartedFn>,
    tasks: JoinSet<()>,
    /// The tasks that run beside the work (`beside_work`): stopped and waited for with it,
    /// never keeping the term.
    beside: JoinSet<()>,
    /// Which callback each task runs, for restarts.
    callback_of: HashMap<Id, usize>,
    /// Completes (with `None`) once every counted clone of the leadership is gone.
    alive: mpsc::Receiver<()>,
    alive_gone: bool,
    /// The elector's own counted clone, kept while the work may need new clones: to restart a
    /// callback, or, without callbacks, for clones made from the state channel to count.
    kept: Option<Leadership>,
    exit: WorkExit,
    restart_after: Duration,
}

impl TermWork {
    /// Starts every callback with a clone of `leadership`, and every task beside the work with
    /// a copy that does not count.
    pub(crate) fn start(
        callbacks: &[StartedFn],
        beside: &[StartedFn],
        leadership: Leadership,
        alive: mpsc::Receiver<()>,
        exit: WorkExit,
        restart_after: Duration,
    ) -> Self {
        let mut work = Self {
            callbacks: callbacks.to_vec(),
            tasks: JoinSet::new(),
            beside: JoinSet::new(),
            callback_of: HashMap::new(),
            alive,
            alive_gone: false,
            kept: None,
            exit,
            restart_after,
        };
        for index in 0..work.callbacks.len() {
            work.spawn(index, leadership.clone(), Duration::ZERO);
        }
        for task in beside {
            work.beside.spawn(task(leadership.uncounted()));
        }
        if work.callbacks.is_empty() || exit == WorkExit::Restart {
            work.kept = Some(leadership);
        }
        work
    }

    fn spawn(&mut self, index: usize, leadership: Leadership, delay: Duration) {
        let callback = self.callbacks[index].clone();
        let handle = self.tasks.spawn(async move {
            if !delay.is_zero() {
                tokio::select! {
                    biased;
                    () = leadership.lost() => return,
                    () = sleep(delay) => {}
                }
            }
            callback(leadership).await;
        });
        self.callback_of.insert(handle.id(), index);
    }

    /// Completes when the work has ended by itself in a way that ends the term; restarts
    /// work that ended under [`WorkExit::Restart`] and never completes then. Without callbacks
    /// it never completes: there is no work the elector knows of. Cancel safe.
    pub(crate) async fn ended(&mut self) -> WorkEnd {
        loop {
            tokio::select! {
                Some(done) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    let (id, panic) = match done {
                        Ok((id, ())) => (id, None),
                        Err(err) => {
                            let id = err.id();
                            match panic_message(err) {
                                Some(message) => (id, Some(message)),
                                // Aborted: only the elector aborts, after the term.
                                None => continue,
                            }
                        }
                    };
                    let index = self.callback_of.remove(&id);
                    if let Some(end) = self.after(index, panic) {
                        return end;
                    }
                }
                None = self.alive.recv(), if !self.alive_gone => {
                    self.alive_gone = true;
                    if self.tasks.is_empty() && !self.callbacks.is_empty() {
                        return WorkEnd::Returned;
                    }
                }
                else => std::future::pending::<()>().await,
            }
        }
    }

    /// What a callback's end means for the term.
    fn after(&mut self, index: Option<usize>, panic: Option<String>) -> Option<WorkEnd> {
        match (&panic, self.exit) {
            (Some(message), WorkExit::StepDown) => {
                tracing::error!(panic = %message, "leader work panicked: ending the term");
                Some(WorkEnd::Panicked)
            }
            (_, WorkExit::Restart) => {
                let (Some(index), Some(leadership)) = (index, self.kept.clone()) else {
                    return None;
                };
                match &panic {
                    Some(message) => tracing::error!(
                        panic = %message,
                        after = ?self.restart_after,
                        "leader work panicked: starting it again"
                    ),
                    None => tracing::warn!(
                        after = ?self.restart_after,
                        "leader work returned while leading: starting it again"
                    ),
                }
                crate::metrics::work_ended(leadership.name(), panic.is_some());
                self.spawn(index, leadership, self.restart_after);
                None
            }
            (None, WorkExit::StepDown) => {
                if self.tasks.is_empty() && self.alive_gone {
                    return Some(WorkEnd::Returned);
                }
                None
            }
        }
    }

    /// Once the term's leadership is cancelled: waits, up to `grace`, until every callback has
    /// stopped and every counted clone of the leadership is gone; aborts callbacks that outlive
    /// it. True when everything stopped in time.
    pub(crate) async fn stop(mut self, grace: Duration) -> bool {
        drop(self.kept.take());
        let all_stopped = async {
            while let Some(done) = self.tasks.join_next().await {
                if let Err(err) = done
                    && let Some(message) = panic_message(err)
                {
                    tracing::error!(panic = %message, "leader work panicked while stopping");
                }
            }
            // `None` once every counted clone of the leadership has been dropped.
            while self.alive.recv().await.is_some() {}
            while let Some(done) = self.beside.join_next().await {
                if let Err(err) = done
                    && let Some(message) = panic_message(err)
                {
                    tracing::error!(panic = %message, "a task beside the leader's work panicked");
                }
            }
        };
        if timeout(grace, all_stopped).await.is_ok() {
            return true;
        }
        self.tasks.abort_all();
        self.beside.abort_all();
        tracing::warn!(
            ?grace,
            "leader work still running after the stop grace; callback tasks aborted"
        );
        false
    }
}

impl Drop for TermWork {
    /// Should the runner be dropped mid-term (its task aborted), the callbacks are left to
    /// finish: the term's cancellation, which fires next, tells them to stop.
    fn drop(&mut self) {
        self.tasks.detach_all();
        self.beside.detach_all();
    }
}

/// The message of a panicked task; `None` for a task that was aborted.
fn panic_message(err: JoinError) -> Option<String> {
    if !err.is_panic() {
        return None;
    }
    let payload: Box<dyn Any + Send> = err.into_panic();
    Some(
        payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned()),
    )
}
