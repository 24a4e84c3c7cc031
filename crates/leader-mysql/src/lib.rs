#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
mod fence;
mod lock;
mod named;
mod set;
mod sql;
mod store;
mod url;

pub use leader_core::redact_url;
pub use lock::TableLock;
pub use named::NamedLock;
pub use set::MysqlLockSet;
pub use sql::SCHEMA;
pub use store::{DEFAULT_TABLE, MysqlStore, MysqlStoreBuilder};
pub use url::LockUrl;

/// The core crate, so that one dependency is enough.
pub use leader_core;
/// The driver, for callers that bring their own pool options.
pub use mysql_async;
