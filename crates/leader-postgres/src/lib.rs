#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod advisory;
mod error;
mod lock;
mod param;
mod schema;
mod set;
mod sql;
mod store;
mod url;

pub use advisory::AdvisoryLock;
pub use leader_core::redact_url;
pub use lock::TableLock;
pub use schema::{MIGRATION, SCHEMA};
pub use set::PostgresLockSet;
pub use store::{DEFAULT_SCHEMA, DEFAULT_TABLE, PostgresStore, PostgresStoreBuilder};
pub use url::LockUrl;

/// The core crate, so that one dependency is enough.
pub use leader_core;
/// The driver and pool, for callers that bring their own pool, and rustls, for TLS settings of
/// your own ([`PostgresStoreBuilder::tls`]).
pub use {deadpool_postgres, rustls, tokio_postgres};
