//! The test Consul server as a process of its own.

use super::ConsulApiServer;

/// The `consul-api-server` program (`[--listen ADDR] [--state FILE]`): serves on `ADDR`
/// (default a free loopback port), prints `listening on URL`, and runs until it is killed; with
/// `--state`, keeps its data in `FILE` across restarts. For binaries that start the server as a
/// process.
#[must_use]
pub fn process_main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let mut listen = "127.0.0.1:0".to_owned();
    let mut state = None;
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--listen", Some(address)) => listen = address,
            ("--state", Some(file)) => state = Some(std::path::PathBuf::from(file)),
            _ => {
                eprintln!("usage: consul-api-server [--listen ADDR] [--state FILE]");
                return std::process::ExitCode::from(2);
            }
        }
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("consul-api-server: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let listener = match tokio::net::TcpListener::bind(&listen).await {
            Ok(listener) => listener,
            Err(err) => {
                eprintln!("consul-api-server: listening on {listen}: {err}");
                return std::process::ExitCode::FAILURE;
            }
        };
        let server = match ConsulApiServer::serve_with_state(listener, state.as_deref()) {
            Ok(server) => server,
            Err(err) => {
                eprintln!("consul-api-server: reading the state file: {err}");
                return std::process::ExitCode::FAILURE;
            }
        };
        println!("listening on {}", server.url());
        std::future::pending::<()>().await;
        std::process::ExitCode::SUCCESS
    })
}
