#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod lock;
mod store;
mod url;

pub use lock::{NatsLock, key_of};
pub use store::{
    DEFAULT_BUCKET, DEFAULT_REQUEST_TIMEOUT, MAX_RECONNECT_DELAY, NatsStore, NatsStoreBuilder,
};
pub use url::LockUrl;

/// The client.
pub use async_nats;
/// The core crate, so that one dependency is enough.
pub use leader_core;
/// Hides passwords in URLs for logs and errors.
pub use leader_core::redact_url;
