//! A COMMAND for end-to-end tests of `leader run`: appends `start IDENTITY TOKEN NANOS PID` to the
//! file in `JOB_LOG` when it starts and `stop ...` when SIGTERM stops it, with `CLOCK_MONOTONIC`
//! nanoseconds (one clock for every process on the machine; see
//! [`leader_tests::log_term_event`]). With `JOB_EXIT=N` it exits with code N at once instead.

use leader_tests::log_term_event;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    if let Some(code) = std::env::var("JOB_EXIT")
        .ok()
        .and_then(|c| c.parse::<u8>().ok())
    {
        return std::process::ExitCode::from(code);
    }
    // The handler first: a SIGTERM right after the start line (a leader that steps down at
    // once) must still log the stop, not kill the process by the default action.
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        return std::process::ExitCode::FAILURE;
    };
    log_term_event("start");
    term.recv().await;
    log_term_event("stop");
    std::process::ExitCode::SUCCESS
}
