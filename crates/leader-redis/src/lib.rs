#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod lock;
mod scripts;

pub use lock::{DEFAULT_PREFIX, RedisLock, RedisStore, RedisStoreBuilder};

/// The core crate, so that one dependency is enough.
pub use leader_core;
/// The driver.
pub use redis;
