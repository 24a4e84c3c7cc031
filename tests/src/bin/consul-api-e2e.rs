//! The test Consul server of `leader-test-support`, built inside this crate so that its tests
//! can start it as a process (`CARGO_BIN_EXE_consul-api-e2e`).

fn main() -> std::process::ExitCode {
    leader_test_support::consul_api::process_main()
}
