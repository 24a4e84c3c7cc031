//! The `leader` command, built inside this crate so that its tests can run it
//! (`CARGO_BIN_EXE_leader-e2e`).

fn main() -> std::process::ExitCode {
    leader_cli::main()
}
