//! A candidate process for end-to-end tests: runs for leadership on a file lock and prints
//! `leading TOKEN` and `stopped TOKEN` lines; shuts down (releasing) when its stdin closes.
//!
//! Usage: `candidate ID PATH LEASE_MS RENEW_MS RETRY_MS`

use std::error::Error;
use std::time::Duration;

use leader_core::{CancellationToken, FileLock, LeaderElector};
use tokio::io::AsyncReadExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [id, path, lease, renew, retry] = args.as_slice() else {
        return Err("usage: candidate ID PATH LEASE_MS RENEW_MS RETRY_MS".into());
    };
    let ms = |s: &str| s.parse().map(Duration::from_millis);
    let elector = LeaderElector::builder(FileLock::new(path, id.as_str()))
        .lease_duration(ms(lease)?)
        .renew_deadline(ms(renew)?)
        .retry_period(ms(retry)?)
        .on_started_leading(|leadership| async move {
            println!("leading {}", leadership.fencing_token());
            leadership.lost().await;
            println!("stopped {}", leadership.fencing_token());
        })
        .build()?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::io::stdin().read_to_end(&mut Vec::new()).await;
        stop.cancel();
    });
    elector.run(shutdown).await.expect("the elector runs");
    Ok(())
}
