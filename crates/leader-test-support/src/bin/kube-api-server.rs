//! The test Kubernetes API server as a process, for tests and tools that run real clients
//! (`leader run`, other Lease clients) against it.
//!
//! ```text
//! kube-api-server [--listen ADDR] [--state FILE] [--kubeconfig FILE] [--coordinated-leader-election]
//! ```
//!
//! Serves on `ADDR` (default `127.0.0.1:0`, a free port) and prints `listening on URL` once it
//! does. With `--state`, the objects and the revision are kept in `FILE` and read back when it
//! starts again, as a real API server keeps them in etcd. With `--kubeconfig`, a kubeconfig for
//! the server (namespace `default`) is written to `FILE`. With `--coordinated-leader-election`, it
//! elects among LeaseCandidates as kube-apiserver does with that feature gate on. Runs until it
//! is killed.

fn main() -> std::process::ExitCode {
    leader_test_support::kube_api::process::main()
}
