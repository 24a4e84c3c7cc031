//! The test Kubernetes API server of `leader-test-support`, built inside this crate so that its
//! tests can start it as a process (`CARGO_BIN_EXE_kube-api-e2e`).

fn main() -> std::process::ExitCode {
    leader_test_support::kube_api::process::main()
}
