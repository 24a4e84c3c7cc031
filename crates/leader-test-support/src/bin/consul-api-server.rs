//! The test Consul HTTP API server as a process, for tests that run real clients (`leader run`)
//! against it.
//!
//! ```text
//! consul-api-server [--listen ADDR]
//! ```
//!
//! Serves on `ADDR` (default `127.0.0.1:0`, a free port) and prints `listening on URL` once it
//! does. Runs until it is killed.

use leader_test_support::consul_api::ConsulApiServer;

fn main() -> std::process::ExitCode {
    let mut args = std::env::args().skip(1);
    let mut listen = "127.0.0.1:0".to_owned();
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--listen", Some(address)) => listen = address,
            _ => {
                eprintln!("usage: consul-api-server [--listen ADDR]");
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
        let server = ConsulApiServer::serve(listener);
        println!("listening on {}", server.url());
        std::future::pending::<()>().await;
        std::process::ExitCode::SUCCESS
    })
}
