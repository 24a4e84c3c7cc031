//! The test Consul HTTP API server as a process, for tests that run real clients (`leader run`)
//! against it.
//!
//! ```text
//! consul-api-server [--listen ADDR] [--state FILE]
//! ```
//!
//! Serves on `ADDR` (default `127.0.0.1:0`, a free port) and prints `listening on URL` once it
//! does. With `--state`, keeps its data in `FILE` across restarts. Runs until it is killed.

fn main() -> std::process::ExitCode {
    leader_test_support::consul_api::process_main()
}
