#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod lease;
mod lock;
mod members;
mod queue;
mod seen;
mod set;
mod shared;
mod store;
mod url;
mod watch;

pub use lock::EtcdLock;
pub use set::EtcdLockSet;
pub use store::{DEFAULT_PREFIX, EtcdStore, EtcdStoreBuilder};
pub use url::LockUrl;

/// The driver, for TLS options and clients of your own.
pub use etcd_client;
/// The core crate, so that one dependency is enough.
pub use leader_core;
