//! Runnable examples of the leader election toolkit; see the `*.rs` files beside this crate.
