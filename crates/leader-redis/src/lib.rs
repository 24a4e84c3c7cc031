#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod eviction;
mod lock;
mod scripts;
mod set;
mod store;
mod url;

pub use lock::{MAX_TOKEN, RedisLock};
pub use set::RedisLockSet;
pub use store::{DEFAULT_PREFIX, RedisStore, RedisStoreBuilder};
pub use url::LockUrl;

/// The core crate, so that one dependency is enough.
pub use leader_core;
/// The driver.
pub use redis;
