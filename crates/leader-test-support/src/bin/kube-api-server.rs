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
//! the server (namespace `default`) is written to `FILE`. By default it is a stock cluster: the
//! `CoordinatedLeaderElection` feature gate is off (the Lease strategy drops `strategy` and
//! `preferredHolder`) and `coordination.k8s.io/v1beta1` is not served. With
//! `--coordinated-leader-election`, it runs as kube-apiserver does with that gate on and
//! `--runtime-config=coordination.k8s.io/v1beta1=true`: LeaseCandidates are served, the fields
//! kept, and the coordinator elects among the candidates. Runs until it is killed.

fn main() -> std::process::ExitCode {
    leader_test_support::kube_api::process::main()
}
