//! A COMMAND for end-to-end tests of `leader run`: appends `start IDENTITY TOKEN NANOS` to the file
//! in `JOB_LOG` when it starts and `stop IDENTITY TOKEN NANOS` when SIGTERM stops it, with
//! `CLOCK_MONOTONIC` nanoseconds (one clock for every process on the machine). With `JOB_EXIT=N`
//! it exits with code N at once instead.

use std::io::Write;

use nix::time::{ClockId, clock_gettime};

fn now() -> i128 {
    clock_gettime(ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec())
    })
}

fn record(event: &str) {
    let identity = std::env::var("LEADER_IDENTITY").unwrap_or_default();
    let token = std::env::var("LEADER_FENCING_TOKEN").unwrap_or_default();
    if let Ok(path) = std::env::var("JOB_LOG")
        && let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    {
        let _ = writeln!(file, "{event} {identity} {token} {}", now());
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    if let Some(code) = std::env::var("JOB_EXIT")
        .ok()
        .and_then(|c| c.parse::<u8>().ok())
    {
        return std::process::ExitCode::from(code);
    }
    record("start");
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        return std::process::ExitCode::FAILURE;
    };
    term.recv().await;
    record("stop");
    std::process::ExitCode::SUCCESS
}
