#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod candidate;
mod error;
mod lock;
mod names;
mod pod_label;
mod set;
mod time;
mod url;

pub use candidate::Coordination;
pub use lock::{
    COORDINATION_ANNOTATION, EXTENSIONS_ANNOTATION, FENCING_TOKEN_ANNOTATION, HANDOVER_STRATEGY,
    LeaseLock,
};
pub use pod_label::{POD_LABEL, PodLabel};
pub use set::LeaseSet;
pub use url::{DEFAULT_REQUEST_TIMEOUT, LockUrl};

/// The core crate, so that one dependency is enough.
pub use leader_core;
/// The driver and the API types, for callers that build their own client.
pub use {k8s_openapi, kube};
