//! A replica written with another project's Lease client, for the mixed-fleet test: it claims a
//! Lease with kubert's `LeaseManager` (server-side apply and strategic merge patches, each with
//! the `resourceVersion` it read as a precondition), and while it holds the claim it "works":
//! it logs `start` and `stop` lines to `JOB_LOG` as the `job` COMMAND of our replicas does, with
//! its own count of terms for a token.
//!
//! Usage: `kubert-claimant URL NAMESPACE NAME IDENTITY LEASE_SECS`
//!
//! It renews at half the lease, and stops working a safety margin before its claim runs out by
//! the clock (as kubert's users must: `Claim::is_current_for`), also while a request hangs. On
//! SIGTERM it stops working first, then vacates the Lease.

use std::time::Duration;

use chrono::Utc;
use kubert::lease::{ClaimParams, LeaseManager};
use kubert_k8s_openapi::api::coordination::v1::Lease;
use kubert_kube_client::api::{Api, PostParams};
use leader_tests::log_term_event_as;
use tokio::time::{Instant, sleep, sleep_until, timeout};

/// Stop working this long before the claim runs out.
const STOP_MARGIN: Duration = Duration::from_millis(250);
/// How often the claim is looked at (kubert sends a request only when one is due).
const TICK: Duration = Duration::from_millis(50);

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, namespace, name, identity, lease_secs] = args.as_slice() else {
        return Err("usage: kubert-claimant URL NAMESPACE NAME IDENTITY LEASE_SECS".into());
    };
    let lease_duration = Duration::from_secs(lease_secs.parse()?);
    let config = kubert_kube_client::Config::new(url.parse()?);
    let client = kubert_kube_client::Client::try_from(config)?;
    let api: Api<Lease> = Api::namespaced(client, namespace);
    // kubert needs the Lease to exist.
    let empty: Lease = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
    let _ = api.create(&PostParams::default(), &empty).await;
    let manager = loop {
        match LeaseManager::init(api.clone(), name).await {
            Ok(manager) => break manager,
            Err(_) => sleep(TICK).await,
        }
    };
    let params = ClaimParams {
        lease_duration,
        renew_grace_period: lease_duration / 2,
    };
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // While working: the term's number (logged as its token: kubert has no fencing token, and
    // a claim renewed after work stopped for the margin is a term of its own), and when work
    // must stop.
    let mut terms = 0_u64;
    let mut working: Option<(String, Instant)> = None;
    loop {
        let stop_at = working.as_ref().map(|(_, at)| *at);
        let claim = tokio::select! {
            _ = terminate.recv() => break,
            () = sleep_until(stop_at.unwrap_or_else(|| Instant::now() + TICK)), if stop_at.is_some() => None,
            claim = timeout(lease_duration / 4, manager.ensure_claimed(identity, &params)) => {
                claim.ok().and_then(Result::ok)
            }
        };
        if let Some(claim) = claim.filter(|c| c.holder == *identity) {
            let left = (claim.expiry - Utc::now()).to_std().unwrap_or_default();
            let until = Instant::now() + left.saturating_sub(STOP_MARGIN);
            match &mut working {
                Some((_, at)) => *at = until,
                None if left > STOP_MARGIN => {
                    terms += 1;
                    let token = terms.to_string();
                    log_term_event_as("start", identity, &token);
                    working = Some((token, until));
                }
                None => {}
            }
        }
        if let Some((token, at)) = &working
            && Instant::now() >= *at
        {
            log_term_event_as("stop", identity, token);
            working = None;
        }
        sleep(TICK).await;
    }
    if let Some((token, _)) = working.take() {
        log_term_event_as("stop", identity, &token);
    }
    let _ = timeout(Duration::from_secs(2), manager.vacate(identity)).await;
    Ok(())
}
