//! The test Kubernetes API server as a process, for tests and tools that run real clients
//! (`leader run`, other Lease clients) against it.
//!
//! ```text
//! kube-api-server [--listen ADDR] [--state FILE] [--kubeconfig FILE]
//! ```
//!
//! Serves on `ADDR` (default `127.0.0.1:0`, a free port) and prints `listening on URL` once it
//! does. With `--state`, the objects and the revision are kept in `FILE` and read back when it
//! starts again, as a real API server keeps them in etcd. With `--kubeconfig`, a kubeconfig for
//! the server (namespace `default`) is written to `FILE`. Runs until it is killed.

use std::path::PathBuf;
use std::process::ExitCode;

use leader_test_support::kube_api::KubeApiServer;

const USAGE: &str = "usage: kube-api-server [--listen ADDR] [--state FILE] [--kubeconfig FILE]";

struct Args {
    listen: String,
    state: Option<PathBuf>,
    kubeconfig: Option<PathBuf>,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args {
        listen: "127.0.0.1:0".into(),
        state: None,
        kubeconfig: None,
    };
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => parsed.listen = value()?,
            "--state" => parsed.state = Some(value()?.into()),
            "--kubeconfig" => parsed.kubeconfig = Some(value()?.into()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(parsed)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(err) => {
            eprintln!("kube-api-server: {err}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("kube-api-server: listening on {}: {err}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let server = match KubeApiServer::serve(listener, args.state.as_deref()) {
        Ok(server) => server,
        Err(err) => {
            eprintln!("kube-api-server: reading the state file: {err}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &args.kubeconfig
        && let Err(err) = std::fs::write(path, server.kubeconfig("default"))
    {
        eprintln!("kube-api-server: writing {}: {err}", path.display());
        return ExitCode::FAILURE;
    }
    println!("listening on {}", server.url());
    std::future::pending::<()>().await;
    ExitCode::SUCCESS
}
