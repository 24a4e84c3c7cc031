//! The etcd lock against etcd's own election service (`v3election`: campaign, resign, and a
//! session lease kept alive), interleaved in one process on the same server, with the ratios.
//!
//! ```text
//! ETCD_ENDPOINTS=http://127.0.0.1:2379 cargo bench -p leader-etcd --bench peers
//! ROUNDS=500 cargo bench -p leader-etcd --bench peers
//! ```
//!
//! - Renewal: ours is `EtcdLock::renew` by the holder; the election service's is a keep-alive of
//!   the campaign's lease (what keeps its leadership). Messages per renewal are counted on the
//!   server (`grpc_server_msg_received_total`).
//! - Taking a free lease: ours is `try_acquire` by a follower that saw the lease released with
//!   nobody waiting (its lease granted in advance); the peer's is `campaign` on a free election
//!   with a lease granted beforehand.
//! - Handover after a release: two electors (lease 3 s, renew deadline 2 s, retry period
//!   500 ms); the leader shuts down, releasing (to the follower, which waits as a candidate),
//!   and the follower leads. The peer: one session resigns while another's `campaign` waits;
//!   measured to that campaign's answer.
//!
//! Failover after SIGKILL is not here: both wait for etcd's lessor to expire the lease (see the
//! workspace's `failover` benchmark).

use std::error::Error;
use std::time::{Duration, Instant};

use leader_core::{Acquisition, ResourceLock};
use leader_etcd::EtcdStore;
use leader_test_support::Candidate;
use leader_test_support::bench::{self, Rewrite};

fn ratio(ours: &mut [Duration], theirs: &mut [Duration]) -> (Duration, Duration, f64) {
    ours.sort();
    theirs.sort();
    let (a, b) = (bench::percentile(ours, 50), bench::percentile(theirs, 50));
    (a, b, a.as_secs_f64() / b.as_secs_f64())
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    let endpoint = bench::etcd_endpoint();
    let rounds = bench::knob("ROUNDS", 200);
    let store = EtcdStore::connect([endpoint.as_str()]).await?;
    let mut client = store.client().await.expect("etcd client");
    let tag = format!("{:08x}", fastrand::u32(..));

    // 1. Renewal: ours by the holder, against a keep-alive of an election session's lease.
    let lock = store.lock(format!("peers-renew-{tag}"), "ours");
    let Some(Acquisition::Acquired(mut held)) = lock.try_acquire(&bench::lasting("ours")).await?
    else {
        return Err("could not take a free lease".into());
    };
    let session = client.lease_grant(10, None).await?.id();
    let (mut keeper, mut stream) = client.lease_keep_alive(session).await?;
    // The holder's watch of its own key starts in the background.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let (mut ours_messages, mut their_messages) = (0, 0);
    for _ in 0..rounds / 10 {
        let before = bench::etcd_messages_received(&endpoint)?;
        ours.extend(bench::rewrites(&lock, &mut held, 10, Rewrite::Renew).await?);
        let middle = bench::etcd_messages_received(&endpoint)?;
        bench::time_each(10, &mut theirs, async || {
            keeper.keep_alive().await?;
            stream.message().await
        })
        .await?;
        let after = bench::etcd_messages_received(&endpoint)?;
        // Each /metrics read is an HTTP request, not a gRPC message.
        ours_messages += middle - before;
        their_messages += after - middle;
    }
    let renewals = (rounds / 10 * 10) as f64;
    let (renew_ours, renew_theirs, renew_ratio) = ratio(&mut ours, &mut theirs);
    client.lease_revoke(session).await?;

    // 2. Taking a free lease: a follower that saw it released with nobody waiting (its lease
    // granted in advance), against campaign on a free election with a lease granted beforehand.
    let mut election = client.election_client();
    let campaign_lease = client.lease_grant(10, None).await?.id();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        // Ours: a holder takes the lease; the follower sees it held (and prepares its own
        // lease); the holder releases it free (the follower's registration as a waiting
        // candidate is removed first, or the release would hand the lease to it); the
        // follower reads the free record, then takes it.
        let name = format!("peers-take-{tag}-{i}");
        let holder = store.lock(&name, "holder");
        let follower = store.lock(&name, "follower");
        let Some(Acquisition::Acquired(taken)) =
            holder.try_acquire(&bench::lasting("holder")).await?
        else {
            return Err("the holder could not take the lease".into());
        };
        follower.try_acquire(&bench::lasting("follower")).await?;
        client
            .delete(format!("{}.candidates/follower", holder.key()), None)
            .await?;
        let mut free = taken.record.clone();
        free.holder_identity.clear();
        holder.update(&taken.version, &free).await?;
        follower.get().await?;
        let at = Instant::now();
        let Some(Acquisition::Acquired(_)) =
            follower.try_acquire(&bench::lasting("follower")).await?
        else {
            return Err("the follower could not take a free lease".into());
        };
        ours.push(at.elapsed());
        follower.close().await;
        client.delete(holder.key(), None).await?;
        // The peer: campaign on a free election, then resign.
        let at = Instant::now();
        let won = election
            .campaign(format!("peers-election-{tag}-{i}"), "bench", campaign_lease)
            .await?;
        theirs.push(at.elapsed());
        if let Some(key) = won.leader().cloned() {
            election
                .resign(Some(etcd_client::ResignOptions::new().with_leader(key)))
                .await?;
        }
    }
    let (take_ours, take_theirs, take_ratio) = ratio(&mut ours, &mut theirs);
    client.lease_revoke(campaign_lease).await?;

    // 3. Handover after a release: electors, against resign-to-campaign.
    let name = format!("peers-handover-{tag}");
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let mut leader = Candidate::start(store.lock(&name, "c0"));
    leader.wait_leading(Duration::from_secs(10)).await;
    let mut next = Candidate::start(store.lock(&name, "c1"));
    let election_name = format!("peers-resign-{tag}");
    for i in 2..rounds + 2 {
        // Ours.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let released = Instant::now();
        leader.shutdown.cancel();
        next.wait_leading(Duration::from_secs(10)).await;
        ours.push(released.elapsed());
        leader.task.await??;
        leader = next;
        next = Candidate::start(store.lock(&name, format!("c{i}")));
        // The peer: a leader session resigns while a second session's campaign waits.
        let first = client.lease_grant(10, None).await?.id();
        let second = client.lease_grant(10, None).await?.id();
        let won = election.campaign(election_name.clone(), "a", first).await?;
        let mut waiting = client.election_client();
        let name = election_name.clone();
        let campaign = tokio::spawn(async move { waiting.campaign(name, "b", second).await });
        // The second campaign is waiting on the first's key.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let resigned = Instant::now();
        if let Some(key) = won.leader().cloned() {
            election
                .resign(Some(etcd_client::ResignOptions::new().with_leader(key)))
                .await?;
        }
        let taken = campaign.await??;
        theirs.push(resigned.elapsed());
        if let Some(key) = taken.leader().cloned() {
            election
                .resign(Some(etcd_client::ResignOptions::new().with_leader(key)))
                .await?;
        }
        client.lease_revoke(first).await?;
        client.lease_revoke(second).await?;
    }
    leader.stop().await;
    next.stop().await;
    let (mut ours_sorted, mut theirs_sorted) = (ours.clone(), theirs.clone());
    let (hand_ours, hand_theirs, hand_ratio) = ratio(&mut ours_sorted, &mut theirs_sorted);
    let hand_p99 = (
        bench::percentile(&ours_sorted, 99),
        bench::percentile(&theirs_sorted, 99),
    );

    println!(
        "etcd lock against etcd's election service on {endpoint}, {rounds} rounds each, interleaved"
    );
    println!();
    println!("| measure | ours | election service | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| renewal latency, p50 | {} | {} (keep-alive) | {renew_ratio:.2}x |",
        us(renew_ours),
        us(renew_theirs)
    );
    println!(
        "| messages per renewal (server) | {:.2} | {:.2} | {:.2}x |",
        ours_messages as f64 / renewals,
        their_messages as f64 / renewals,
        ours_messages as f64 / their_messages.max(1) as f64
    );
    println!(
        "| taking a free lease, p50 | {} | {} (campaign, lease granted beforehand) | {take_ratio:.2}x |",
        us(take_ours),
        us(take_theirs)
    );
    println!(
        "| handover after release, p50 | {} | {} (resign to campaign) | {hand_ratio:.2}x |",
        us(hand_ours),
        us(hand_theirs)
    );
    println!(
        "| handover after release, p99 | {} | {} | {:.2}x |",
        us(hand_p99.0),
        us(hand_p99.1),
        hand_p99.0.as_secs_f64() / hand_p99.1.as_secs_f64()
    );
    Ok(())
}
