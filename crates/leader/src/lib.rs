#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

#[cfg(feature = "tower")]
mod endpoints;
#[cfg(feature = "tower")]
mod leader_only;
mod url;

#[cfg(feature = "tower")]
pub use endpoints::{DEFAULT_HEALTH_TOLERANCE, LeaderEndpoints, LeaderEndpointsLayer};
#[cfg(feature = "tower")]
pub use leader_only::{LeaderOnly, LeaderOnlyLayer};

pub use leader_core::*;
pub use url::{
    BACKENDS, Backend, LockUrl, LockUrlError, OPEN_TIMEOUT, OpenError, default_file, open, open_set,
};

/// The MySQL / MariaDB table lock (feature `mysql`).
#[cfg(feature = "mysql")]
pub use leader_mysql as mysql;
/// The NATS JetStream key-value lock (feature `nats`).
#[cfg(feature = "nats")]
pub use leader_nats as nats;
/// The Postgres table and advisory locks (feature `postgres`).
#[cfg(feature = "postgres")]
pub use leader_postgres as postgres;
/// The ZooKeeper lock (feature `zookeeper`).
#[cfg(feature = "zookeeper")]
pub use leader_zookeeper as zookeeper;

/// The Redis lock (feature `redis`).
#[cfg(feature = "redis")]
pub use leader_redis as redis;

/// Scheduled jobs run once per firing by the leader (feature `cron`).
#[cfg(feature = "cron")]
pub use leader_cron as cron;
/// The etcd lock (feature `etcd`).
#[cfg(feature = "etcd")]
pub use leader_etcd as etcd;

/// The Consul lock (feature `consul`).
#[cfg(feature = "consul")]
pub use leader_consul as consul;
/// The object storage lock (feature `object-store`).
#[cfg(feature = "object-store")]
pub use leader_object_store as object_store;

/// The DynamoDB lock (feature `dynamodb`).
#[cfg(feature = "dynamodb")]
pub use leader_dynamodb as dynamodb;

/// The Kubernetes Lease lock (feature `kubernetes`).
#[cfg(feature = "kubernetes")]
pub use leader_kube as kubernetes;
