#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod lock;
mod set;
mod store;
mod url;

pub use lock::{ZooKeeperLock, node_of};
pub use set::ZooKeeperSet;
pub use store::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_CONNECTION_TIMEOUT, DEFAULT_PREFIX, DEFAULT_SESSION_TIMEOUT,
    ZooKeeperStore, ZooKeeperStoreBuilder,
};
pub use url::LockUrl;

/// The core crate, so that one dependency is enough.
pub use leader_core;
/// Hides passwords in URLs for logs and errors.
pub use leader_core::redact_url;
/// The client.
pub use zookeeper_client;
