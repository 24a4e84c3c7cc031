#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

pub mod backend;
mod backoff;
mod clock;
mod config;
mod elector;
mod error;
mod file;
mod handover;
mod health;
mod hub;
mod identity;
mod leadership;
mod lock;
mod memory;
pub mod metrics;
mod record;
mod redact;
mod retry;
mod rules;
mod runner;
mod shards;
mod signal;
mod status;
mod url;
mod view;
mod work;

#[cfg(feature = "testing")]
pub mod background;
#[cfg(feature = "testing")]
pub mod conformance;
#[cfg(feature = "testing")]
pub mod faults;

pub use clock::{Clock, ClockStep, SystemClock, TokioClock, WallClock};
pub use config::{
    DEFAULT_LEASE_DURATION, DEFAULT_RENEW_DEADLINE, DEFAULT_RETRY_PERIOD, ElectorConfig,
    JITTER_FACTOR, LeaseConfig, MAX_LEASE_DURATION, Timings, WorkExit,
};
pub use elector::{LeaderElector, LeaderElectorBuilder};
pub use error::{BoxError, ConfigError, LockError};
pub use file::FileLock;
pub use handover::{HandoverError, edit_record, request_handover, withdraw_handover};
pub use health::{HealthCheck, NotReady, Unhealthy};
pub use identity::default_identity;
pub use leadership::{
    ExtensionError, LeaderState, Leadership, LeadershipLost, StepDown, StepDownReason, TermDeadline,
};
pub use lock::{Acquisition, ChangeStream, LeaderEvent, ResourceLock};
pub use memory::{MemoryLock, MemoryStore};
pub use record::{LeaderElectionRecord, Observed, Version};
pub use redact::redact_url;
pub use shards::{
    COUNT_EXTENSION, LockSet, MAX_SHARDS, MAX_STATIC_MEMBERSHIP_WINDOW, MemberView, RecordState,
    RecordView, RosterError, ShardSetView, ShardSetViewError, ShardView, Shards, ShardsBuilder,
    ShardsConfig, ShardsError, ShardsState, drain_member, resize_shard_set,
};
pub use signal::{shutdown_on_signals, shutdown_signal};
pub use status::{ElectionError, ElectorStatus, IdentityConflict, LastError};
pub use url::{FileUrl, LockTarget, UrlError};
pub use view::LeaderView;

/// Re-exported so that users need not depend on `async-trait` and `tokio-util` themselves.
pub use async_trait::async_trait;
pub use tokio_util::sync::CancellationToken;
