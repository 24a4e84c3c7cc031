//! The test API server as a process: `kube-api-server [--listen ADDR] [--state FILE]
//! [--kubeconfig FILE] [--coordinated-leader-election]` (see the binary's documentation).

use std::path::PathBuf;
use std::process::ExitCode;

use super::KubeApiServer;

const USAGE: &str = "usage: kube-api-server [--listen ADDR] [--state FILE] [--kubeconfig FILE] [--coordinated-leader-election]";

struct Args {
    listen: String,
    state: Option<PathBuf>,
    kubeconfig: Option<PathBuf>,
    coordinator: bool,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args {
        listen: "127.0.0.1:0".into(),
        state: None,
        kubeconfig: None,
        coordinator: false,
    };
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => parsed.listen = value()?,
            "--state" => parsed.state = Some(value()?.into()),
            "--kubeconfig" => parsed.kubeconfig = Some(value()?.into()),
            "--coordinated-leader-election" => parsed.coordinator = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(parsed)
}

/// The `kube-api-server` program: parses the arguments, serves until killed.
#[must_use]
pub fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("kube-api-server: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(serve())
}

async fn serve() -> ExitCode {
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
    if args.coordinator {
        server.start_coordinator();
    }
    println!("listening on {}", server.url());
    std::future::pending::<()>().await;
    ExitCode::SUCCESS
}
