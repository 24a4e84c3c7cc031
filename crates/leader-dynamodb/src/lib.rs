#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod lock;
mod set;
mod skew;
mod store;
mod url;

pub use lock::{DynamoLock, FLOOR_PREFIX};
pub use set::{BATCH_LIMIT, DynamoLockSet};
pub use store::{DynamoStore, DynamoStoreBuilder, KEY_ATTRIBUTE};
pub use url::LockUrl;

/// The AWS configuration loader, for a configuration of one's own
/// ([`DynamoStoreBuilder::sdk_config`]).
pub use aws_config;
/// The DynamoDB client.
pub use aws_sdk_dynamodb;
/// The core crate, so that one dependency is enough.
pub use leader_core;
