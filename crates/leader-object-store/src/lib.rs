#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod lock;
mod store;
mod url;

pub use lock::BucketLock;
pub use store::{
    BucketStore, BucketStoreBuilder, DEFAULT_PREFIX, PROBE_NAME, ensure_crypto_provider,
};
pub use url::LockUrl;

/// The core crate, so that one dependency is enough.
pub use leader_core;
/// The `object_store` crate, for building a store of one's own ([`BucketStore::builder`]).
pub use object_store;
