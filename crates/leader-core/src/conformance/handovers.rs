//! Leadership changing hands: handover requests and planned handovers, electors that elect
//! exactly one and hand over (S4, S6), and a release taken over at once.

use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt;

use super::{LockFactory, get, record, unique};
use crate::background::{Candidate, LEASE, RETRY, STEADY_LEASE};
use crate::{Acquisition, LockError, request_handover};

/// A handover request is a compare-and-swap write that leaves the holder in place: the holder's
/// next renewal from its cached version conflicts; a notifying backend wakes watchers for it;
/// once released with the request kept, a store-clock acquisition takes it only for the
/// candidate it names.
pub async fn handover_requests(factory: &dyn LockFactory) {
    let name = unique("request");
    let a = factory.lock(&name, "a").await;
    let b = factory.lock(&name, "b").await;
    let c = factory.lock(&name, "c").await;
    let operator = factory.lock(&name, "operator").await;
    assert!(
        matches!(
            request_handover(&*operator, "b").await,
            Err(crate::HandoverError::NoElection { .. })
        ),
        "a request for an election nobody ran is refused"
    );
    let held = a.create(&record("a", 1)).await.expect("create");
    let changes = b.watch().await.expect("watch");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let requested = request_handover(&*operator, "b").await.expect("request");
    assert_eq!(requested.record.handover_to(), Some("b"));
    assert_eq!(requested.record.holder_identity, "a", "the holder stays");
    assert_eq!(
        requested.record.leader_transitions, held.record.leader_transitions,
        "a request is no acquisition"
    );
    assert_ne!(requested.version, held.version, "a request is a write");
    let read = get("a request", &*b).await.expect("the record");
    assert_eq!(read.record.handover_to(), Some("b"));
    if let Some(mut changes) = changes {
        let notified = tokio::time::timeout(Duration::from_secs(5), changes.next()).await;
        assert!(
            matches!(notified, Ok(Some(()))),
            "no change notification within 5 s of a handover request"
        );
    }
    let mut renewal = held.record.clone();
    renewal.renew_time = renewal.renewal_time(Utc::now());
    let stale = a.update(&held.version, &renewal).await;
    assert!(
        stale.as_ref().is_err_and(LockError::is_conflict),
        "a renewal from before the request must lose its compare-and-swap: {stale:?}"
    );
    // The holder releases, keeping the request, as the elector does.
    let mut released = read.record.clone();
    released.holder_identity = String::new();
    let released = a.update(&read.version, &released).await.expect("release");
    assert_eq!(released.record.handover_to(), Some("b"));
    match c.try_acquire(&record("c", 0)).await.expect("try_acquire") {
        None => return,
        Some(Acquisition::Held { observed, .. }) => {
            assert_eq!(observed.record.handover_to(), Some("b"));
        }
        Some(taken) => {
            panic!("a lease reserved for b was taken by c by the store's clock: {taken:?}")
        }
    }
    match b.try_acquire(&record("b", 0)).await.expect("try_acquire") {
        Some(Acquisition::Acquired(taken)) => {
            assert!(taken.record.leader_transitions > released.record.leader_transitions);
            assert_eq!(taken.record.handover_to(), None, "an acquisition clears it");
        }
        // The release handed it to b already.
        Some(Acquisition::Handed { observed, .. }) if released.record.holder_identity == "b" => {
            assert_eq!(observed.record.handover_to(), None, "a handover clears it");
        }
        other => panic!("the named candidate must take a lease reserved for it, got {other:?}"),
    }
}

/// Three electors: a handover request makes the leader step down and release, the named
/// candidate takes over with a larger token while the third stands back, never two leaders at
/// once; done to each follower in turn. A request naming a candidate that never comes delays
/// the election by at most the stand-back window and a lease.
pub async fn planned_handover(factory: &dyn LockFactory) {
    let name = unique("planned");
    let ids = ["a", "b", "c"];
    let mut electors = Vec::new();
    for id in ids {
        electors.push(Candidate::start_with(factory.lock(&name, id).await, RETRY));
    }
    let operator = factory.lock(&name, "operator").await;
    // Watches every 5 ms for `within`: never two leaders; returns the first leader whose token
    // is above `after`, if one comes.
    let watch = async |electors: &[Candidate], within: Duration, after: u64| {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let now = leading(electors);
            assert!(now.len() <= 1, "two electors lead at once: {now:?}");
            if let Some(&(i, token)) = now.first()
                && token > after
            {
                return Some((i, token));
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let (mut leader, mut token) = watch(&electors, Duration::from_secs(10), 0)
        .await
        .expect("a leader within 10 s");
    for _ in 0..2 {
        let target = (leader + 1) % ids.len();
        request_handover(&*operator, ids[target])
            .await
            .expect("handover request");
        // The leader sees it at its next renewal at the latest, then stops and releases.
        let (next, next_token) = watch(&electors, RETRY * 3 + Duration::from_secs(2), token)
            .await
            .unwrap_or_else(|| panic!("{} did not take over in time", ids[target]));
        assert_eq!(
            next, target,
            "the lease went to {} instead of the named {}",
            ids[next], ids[target]
        );
        (leader, token) = (next, next_token);
    }
    // A named candidate that never comes: the others stand back for a lease, then one leads.
    request_handover(&*operator, "gone")
        .await
        .expect("handover request");
    let requested = tokio::time::Instant::now();
    let within = RETRY * 3 + LEASE * 2 + Duration::from_secs(2);
    watch(&electors, within, token).await.unwrap_or_else(|| {
        panic!("no leader {within:?} after a handover to a candidate that never came")
    });
    let took = requested.elapsed();
    assert!(
        took >= LEASE / 2,
        "the others must stand back for the named candidate, yet one led {took:?} after the request"
    );
    for elector in electors {
        elector.stop().await;
    }
}

/// Two electors on real time: exactly one leads; when it shuts down (releasing), the other takes
/// over with a larger fencing token.
pub async fn electors_elect_one_and_hand_over(factory: &dyn LockFactory) {
    let name = unique("electors");
    let mut electors = Vec::new();
    for id in ["a", "b"] {
        electors.push(Candidate::start_with(
            factory.lock(&name, id).await,
            Duration::from_millis(300),
        ));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (first, token) = loop {
        let now_leading = leading(&electors);
        assert!(
            now_leading.len() <= 1,
            "two electors lead at once: {now_leading:?}"
        );
        if let [one] = now_leading[..] {
            break one;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no leader within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    electors[first].shutdown.cancel();
    let other = 1 - first;
    let new_token = electors[other].wait_leading(Duration::from_secs(10)).await;
    assert!(
        new_token > token,
        "fencing token must grow across a handover: {token} then {new_token}"
    );
    assert!(!electors[first].is_leading(), "the old leader still leads");
    for elector in electors {
        elector.stop().await;
    }
}

/// The electors' suite each backend runs on its real server: two and ten electors at once, each
/// group electing exactly one ([`electors_elect_exactly_one`]), and, where the store wakes its
/// followers (`woken`), a released lease taken over at once
/// ([`release_is_taken_over_at_once`], its time printed).
pub async fn electors(factory: &dyn LockFactory, woken: bool) {
    tokio::join!(
        electors_elect_exactly_one(factory, 2),
        electors_elect_exactly_one(factory, 10)
    );
    if woken {
        let took = release_is_taken_over_at_once(factory).await;
        eprintln!("handover after a release took {took:?}");
    }
}

/// `n` electors on one election: a leader within two leases, never two at once, no change of
/// hands without a fault for longer than a lease (their renew deadline,
/// [`STEADY_RENEW`](crate::background::STEADY_RENEW), outlasts a loaded machine's stalls of the
/// store, and a leader whose renewals fail steps down within it); when the leader shuts down,
/// exactly one other takes over with a larger fencing token.
pub async fn electors_elect_exactly_one(factory: &dyn LockFactory, n: usize) {
    let name = unique("many");
    let mut electors = Vec::new();
    for i in 0..n {
        electors.push(Candidate::start_steady(
            factory.lock(&name, &format!("e{i}")).await,
            Duration::from_millis(500),
        ));
    }
    let watch_for =
        async |electors: &[_], duration: Duration, mut current: Option<(usize, u64)>| {
            let until = tokio::time::Instant::now() + duration;
            while tokio::time::Instant::now() < until {
                let now = leading(electors);
                assert!(
                    now.len() <= 1,
                    "{n} electors: several lead at once: {now:?}"
                );
                if let Some(held) = current
                    && now != [held]
                {
                    let accounts: Vec<String> = electors.iter().map(Candidate::account).collect();
                    panic!(
                        "{n} electors: leadership changed hands with no fault: {held:?} then \
                         {now:?}; the electors: {accounts:#?}"
                    );
                }
                current = current.or(now.first().copied());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            current
        };
    // The first leader seen within two leases (a release that failed is waited out),
    // watched for `poll` at a time.
    let elected = async |electors: &[_], poll: Duration, what: &str| {
        let within = STEADY_LEASE * 2;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{n} electors: no {what} within {within:?}"
            );
            if let Some(leader) = watch_for(electors, poll, None).await {
                return leader;
            }
        }
    };
    let first = elected(&electors, Duration::from_millis(50), "leader").await;
    // Past the renew deadline and a lease: a leader whose renewals fail has stepped down.
    let steady = STEADY_LEASE + Duration::from_secs(2);
    let (index, token) = watch_for(&electors, steady, Some(first))
        .await
        .expect("a leader");
    electors.remove(index).stop().await;
    let next = elected(&electors, Duration::from_millis(20), "new leader").await;
    let (_, next_token) = watch_for(&electors, Duration::from_secs(1), Some(next))
        .await
        .expect("a leader");
    assert!(
        next_token > token,
        "fencing token {token} then {next_token}"
    );
    for elector in electors {
        elector.stop().await;
    }
}

/// For a backend with change notifications: a released lease is taken over well within a retry
/// period (2 s here, up to 4.4 s with jitter), because the follower is woken at once. Returns
/// how long the handover took.
pub async fn release_is_taken_over_at_once(factory: &dyn LockFactory) -> Duration {
    let name = unique("handover");
    let retry = Duration::from_secs(2);
    let mut leader = Candidate::start_with(factory.lock(&name, "first").await, retry);
    let token = leader.wait_leading(Duration::from_secs(10)).await;
    let mut follower = Candidate::start_with(factory.lock(&name, "second").await, retry);
    // Let the follower subscribe and read the record.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let released = tokio::time::Instant::now();
    leader.stop().await;
    let next = follower.wait_leading(retry).await;
    let took = released.elapsed();
    assert!(took < retry / 4, "handover after a release took {took:?}");
    assert!(next > token, "fencing token {token} then {next}");
    follower.stop().await;
    took
}

/// The electors that lead now, each with its index and fencing token.
fn leading(electors: &[Candidate]) -> Vec<(usize, u64)> {
    electors
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.leading_token().map(|token| (i, token)))
        .collect()
}
