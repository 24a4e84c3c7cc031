//! The fault harness: replicas of the `leader` command against a backend, faults injected into
//! the leader, and a checker over every leadership interval and every fenced write.

pub mod campaign;
pub mod checker;
pub mod outage;
pub mod proxy;
pub mod servers;
