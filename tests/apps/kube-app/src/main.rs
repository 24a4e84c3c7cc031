//! Leader election in a kube-rs application on Kubernetes 1.35's API types: the lock built from
//! the application's own `kube::Client`, and opened from a URL through `leader`.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use leader::{LeaderElector, shutdown_on_signals};
use leader_kube::LeaseLock;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = Client::try_default().await?;
    // The application's own API types and the lock's are one crate's.
    let leases: Api<Lease> = Api::default_namespaced(client.clone());
    let identity = leader::default_identity();
    let lock = LeaseLock::new(client, "default", "kube-app", &identity)?;
    let elector = LeaderElector::builder(lock)
        .lease_duration(Duration::from_secs(15))
        .build()?;
    let opened = leader::open("kubernetes://default", "kube-app-url", &identity).await?;
    println!("also opened {}", opened.describe());
    elector
        .run_while_leading(shutdown_on_signals(), move |leadership| {
            let leases = leases.clone();
            async move {
                let held = leases.get_opt("kube-app").await.ok().flatten();
                println!(
                    "leading with token {} (Lease {})",
                    leadership.fencing_token(),
                    held.and_then(|l| l.metadata.resource_version)
                        .unwrap_or_default()
                );
                leadership.lost().await;
            }
        })
        .await?;
    Ok(())
}
