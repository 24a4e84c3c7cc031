//! The `leader` command; see the crate documentation.

fn main() -> std::process::ExitCode {
    leader_cli::main()
}
