#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod key;
mod lock;
mod session;
mod set;
mod store;
mod sweeper;
mod url;

pub use lock::ConsulLock;
pub use set::ConsulLockSet;
pub use store::{ConsulStore, ConsulStoreBuilder, DEFAULT_PREFIX};
pub use url::LockUrl;

/// The core crate, so that one dependency is enough.
pub use leader_core;
