//! An elector running in the background, for tests of the elector and of backends (feature
//! `testing`). Not API-stable.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{
    CancellationToken, ElectionError, ElectorStatus, LeaderElector, LeaderElectorBuilder,
    LeaderState, Leadership, ResourceLock, StepDown,
};

/// The lease duration [`Candidate::start`] uses: short, so that tests against real servers run
/// in seconds.
pub const LEASE: Duration = Duration::from_secs(3);
/// The renew deadline [`Candidate::start`] uses.
pub const RENEW: Duration = Duration::from_secs(2);
/// The retry period [`Candidate::start`] uses.
pub const RETRY: Duration = Duration::from_millis(500);

/// The lease duration of [`Candidate::start_steady`].
pub const STEADY_LEASE: Duration = Duration::from_secs(6);
/// The renew deadline of [`Candidate::start_steady`]: longer than a store on a loaded machine
/// stalls (a slow disk's sync holds up every member of an etcd cluster on it, and their raft
/// heartbeats, for seconds), so that a check that leadership stays put without a fault fails
/// for a defect, not for the machine's load.
pub const STEADY_RENEW: Duration = Duration::from_secs(5);

/// An elector running in a task of its own, with its state channel, its status and the terms
/// it ended.
#[derive(Debug)]
pub struct Candidate {
    /// Its state channel.
    pub state: watch::Receiver<LeaderState>,
    /// Its troubles.
    pub status: ElectorStatus,
    /// Cancel it to shut the elector down.
    pub shutdown: CancellationToken,
    /// The elector's task.
    pub task: JoinHandle<Result<(), ElectionError>>,
    stopped: Arc<Mutex<Vec<StepDown>>>,
}

impl Candidate {
    /// Starts an elector on `lock` with [`LEASE`], [`RENEW`] and [`RETRY`].
    pub fn start(lock: impl ResourceLock + 'static) -> Self {
        Self::start_with(lock, RETRY)
    }

    /// Starts an elector on `lock` with retry period `retry` (and a lease and deadline long
    /// enough for it).
    pub fn start_with(lock: impl ResourceLock + 'static, retry: Duration) -> Self {
        Self::build(
            LeaderElector::builder(lock)
                .lease_duration(LEASE.max(retry * 4))
                .renew_deadline(RENEW.max(retry * 3))
                .retry_period(retry),
        )
    }

    /// Starts an elector on `lock` with retry period `retry`, [`STEADY_LEASE`] and
    /// [`STEADY_RENEW`]: for checks that a leader keeps its lease while nothing fails.
    pub fn start_steady(lock: impl ResourceLock + 'static, retry: Duration) -> Self {
        Self::build(
            LeaderElector::builder(lock)
                .lease_duration(STEADY_LEASE)
                .renew_deadline(STEADY_RENEW)
                .retry_period(retry),
        )
    }

    /// Builds the elector `builder` describes (its own `on_stopped_leading` is replaced by the
    /// candidate's record of terms) and starts it.
    pub fn build(builder: LeaderElectorBuilder) -> Self {
        let stopped = Arc::new(Mutex::new(Vec::new()));
        let log = stopped.clone();
        let elector = builder
            .on_stopped_leading(move |step_down| {
                log.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(step_down);
            })
            .build()
            .expect("valid configuration");
        let mut candidate = Self::run(elector);
        candidate.stopped = stopped;
        candidate
    }

    /// Starts `elector` as it is.
    pub fn run(elector: LeaderElector) -> Self {
        let state = elector.subscribe();
        let status = elector.status();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(elector.run(shutdown.clone()));
        Self {
            state,
            status,
            shutdown,
            task,
            stopped: Arc::default(),
        }
    }

    /// True while it leads.
    pub fn is_leading(&self) -> bool {
        self.state.borrow().is_leading()
    }

    /// The fencing token while it leads.
    pub fn leading_token(&self) -> Option<u64> {
        self.state
            .borrow()
            .leadership()
            .map(Leadership::fencing_token)
    }

    /// The current term's cancellation: it fires exactly when that term ends, however quickly a
    /// next term follows.
    pub fn term(&self) -> Option<CancellationToken> {
        self.state
            .borrow()
            .leadership()
            .map(Leadership::cancellation_token)
    }

    /// Waits until it leads; returns the term's leadership.
    pub async fn leadership(&mut self) -> Leadership {
        self.state
            .wait_for(LeaderState::is_leading)
            .await
            .expect("elector alive")
            .leadership()
            .cloned()
            .expect("leading")
    }

    /// Waits until it leads; returns the fencing token. Panics after `within`.
    pub async fn wait_leading(&mut self, within: Duration) -> u64 {
        tokio::time::timeout(within, self.leadership())
            .await
            .expect("leads in time")
            .fencing_token()
    }

    /// Asserts that it neither leads nor stops for `duration`, as under a fault.
    pub async fn stays_alive_without_leading(&self, duration: Duration) {
        tokio::time::sleep(duration).await;
        assert!(self.leading_token().is_none(), "led despite the fault");
        assert!(!self.task.is_finished(), "the elector stopped");
    }

    /// The terms it ended so far (when started with [`build`](Self::build)).
    pub fn stopped(&self) -> Vec<StepDown> {
        self.stopped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// What a failed assertion should say of it: the terms it ended, with why, and the failure
    /// going on, if any.
    pub fn account(&self) -> String {
        let ended: Vec<String> = self
            .stopped()
            .iter()
            .map(|s| format!("{} ({:?})", s.fencing_token, s.reason))
            .collect();
        let failing = self.status.last_error().map_or_else(
            || "none".to_owned(),
            |e| format!("{} x{}", e.error, e.failures),
        );
        format!("terms ended {ended:?}, failing now: {failing}")
    }

    /// Shuts it down, waits for it, and returns the terms it ended (when started with
    /// [`build`](Self::build)).
    pub async fn stop(self) -> Vec<StepDown> {
        self.shutdown.cancel();
        self.task
            .await
            .expect("elector task")
            .expect("the elector ran");
        self.stopped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Waits until one of `candidates` leads; returns its fencing token. Panics after `within`.
pub async fn next_leader(candidates: &[&Candidate], within: Duration) -> u64 {
    tokio::time::timeout(within, async {
        loop {
            if let Some(token) = candidates.iter().find_map(|c| c.leading_token()) {
                return token;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("a leader in time")
}

/// What an outage test checks once the store is gone (S9): `probe`, a request made after the
/// store went away, failed as an outage; the leader's `term` ends by its renew deadline,
/// counted from `stopped` (when the store went away); a second later none of `electors` leads
/// and none has stopped trying.
pub async fn assert_outage_handled<T: std::fmt::Debug>(
    probe: Result<T, crate::LockError>,
    term: CancellationToken,
    stopped: tokio::time::Instant,
    electors: &[&Candidate],
) {
    let err = probe.expect_err("the store is down");
    assert!(
        matches!(
            err,
            crate::LockError::Unavailable { .. } | crate::LockError::Timeout { .. }
        ),
        "{err:?}"
    );
    tokio::time::timeout(RENEW + RETRY * 3, term.cancelled())
        .await
        .expect("the leader steps down by its renew deadline");
    assert!(stopped.elapsed() < RENEW + RETRY * 3);
    tokio::time::sleep(Duration::from_secs(1)).await;
    for elector in electors {
        assert!(
            elector.leading_token().is_none(),
            "leads while the store is down"
        );
        assert!(!elector.task.is_finished(), "an elector stopped");
    }
}
