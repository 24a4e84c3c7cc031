//! The `GET_LOCK` lock against a real MySQL or MariaDB: the conformance suite (with the shard
//! protocol, one record at a time), electors, a killed session, the handover on release (and on
//! releases in a row), a user-level lock that never stacks, a session kept between renewals
//! whatever its idle timeout, and the server check at open.

mod common;

use std::time::Duration;

use common::{Factory, LEASE, RENEW, RETRY, Running, unique};
use leader_core::conformance::{self, record};
use leader_core::{Acquisition, LeaderElectionRecord, LockError, LockTarget, ResourceLock};
use leader_mysql::mysql_async::Conn;
use leader_mysql::mysql_async::prelude::Queryable;
use leader_mysql::{LockUrl, NamedLock};
use leader_test_support::assert_taken_over_once_killed;
use tokio::time::{Instant, sleep};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn named_lock_conforms() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::run_all(&Factory { store, named: true }).await;
}

/// Two and ten electors on the `GET_LOCK` lock each elect exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn named_lock_electors_conform() {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::electors(&Factory { store, named: true }, false).await;
}

/// Which session holds `lock`'s user-level lock, as another session sees it.
async fn user(admin: &mut Conn, lock: &NamedLock) -> Option<u64> {
    admin
        .exec_first::<Option<u64>, _, _>("SELECT IS_USED_LOCK(?)", (lock.key(),))
        .await
        .expect("IS_USED_LOCK")
        .flatten()
}

/// The user-level lock belongs to the leader's session: when the server kills it, the next
/// renewal fails its session check, the leader steps down by its renew deadline, and the
/// follower takes over once the lease has run out by the server's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_steps_down_when_its_session_is_killed() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let name = unique("named-killed");
    let lock = store.named_lock(&name, "first");
    let handle = lock.clone();
    // A slower retry for the old leader: once its term is over it tries again on its retry
    // ticks, while the follower wakes right when the lease runs out.
    let retry = Duration::from_secs(1);
    let mut leader = Running::start_with(lock, retry);
    let token = leader.wait_leading(Duration::from_secs(10)).await;
    let follower = Running::start(store.named_lock(&name, "second"));
    sleep(RETRY * 2).await;
    let id = handle.session_id().await.expect("the leader's session");
    assert_eq!(user(&mut admin, &handle).await, Some(u64::from(id)));
    let kill = async {
        admin
            .query_drop(format!("KILL CONNECTION {id}"))
            .await
            .expect("kill");
    };
    let (stepped_down, led) = assert_taken_over_once_killed(
        leader,
        token,
        follower,
        kill,
        (RENEW.max(retry * 3)) + retry * 2,
        LEASE.max(retry * 4) + RETRY * 4,
    )
    .await;
    eprintln!(
        "killed session: the leader stepped down after {stepped_down:?}, the follower led after {led:?}"
    );
}

/// A release hands the user-level lock to the follower waiting in `GET_LOCK`: it takes over
/// well within its retry period (2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_released_lease_is_taken_over_at_once() {
    let Some(store) = common::store().await else {
        return;
    };
    let factory = Factory { store, named: true };
    let mut took = Vec::new();
    for _ in 0..5 {
        took.push(conformance::release_is_taken_over_at_once(&factory).await);
    }
    took.sort();
    eprintln!("handover after release (5 runs, sorted): {took:?}");
}

/// Releases in a row are each taken over at once: after a handover, a follower waits on the new
/// holder's lock at once (not a watch interval later), so the next release reaches it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn releases_in_a_row_are_each_taken_over_at_once() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("in-a-row");
    let retry = Duration::from_secs(2);
    let mut first = Running::start_with(store.named_lock(&name, "first"), retry);
    first.wait_leading(Duration::from_secs(10)).await;
    let mut others = vec![
        Running::start_with(store.named_lock(&name, "second"), retry),
        Running::start_with(store.named_lock(&name, "third"), retry),
    ];
    // Let the followers subscribe and read the record.
    sleep(Duration::from_millis(500)).await;
    first.stop().await;
    let released = Instant::now();
    let next = loop {
        if let Some(i) = others.iter().position(Running::is_leading) {
            break i;
        }
        let took = released.elapsed();
        assert!(took < retry / 4, "no takeover {took:?} after a release");
        sleep(Duration::from_millis(5)).await;
    };
    let second = others.remove(next);
    let mut third = others.pop().expect("three candidates");
    // The next release at once, while the last follower has only just seen the takeover.
    let released = Instant::now();
    second.stop().await;
    third.wait_leading(retry).await;
    let took = released.elapsed();
    assert!(
        took < retry / 4,
        "the second release was taken over after {took:?}"
    );
    third.stop().await;
}

fn renewal(of: &LeaderElectionRecord) -> LeaderElectionRecord {
    let mut next = of.clone();
    next.renew_time = chrono::Utc::now();
    next
}

/// However often the holder renews, takes its own term again or tries to acquire, its session
/// holds the user-level lock once: one `RELEASE_LOCK` (the release) frees it while the session
/// lives on. A take attempt that fails hands the lock back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_user_level_lock_never_stacks() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let name = unique("named-stack");
    let a = store.named_lock(&name, "a");
    let b = store.named_lock(&name, "b");
    let Some(Acquisition::Acquired(mut held)) =
        a.try_acquire(&record("a", 0)).await.expect("try_acquire")
    else {
        panic!("a free election is acquired");
    };
    let session = u64::from(a.session_id().await.expect("a session"));
    for _ in 0..5 {
        held = a
            .renew(&held.version, &renewal(&held.record))
            .await
            .expect("renew");
        assert!(matches!(
            a.try_acquire(&record("a", 0)).await.expect("try_acquire"),
            Some(Acquisition::Held { .. })
        ));
        assert!(matches!(
            b.try_acquire(&record("b", 0)).await.expect("try_acquire"),
            Some(Acquisition::Held { .. })
        ));
    }
    // The holder takes its own term again (the elector does so after a renewal it could not
    // confirm), and writes its record.
    let mut again = renewal(&held.record);
    again.leader_transitions += 1;
    held = a
        .update(&held.version, &again)
        .await
        .expect("own term again");
    held = a
        .update(&held.version, &renewal(&held.record))
        .await
        .expect("write");
    assert_eq!(user(&mut admin, &a).await, Some(session), "a holds it");
    assert_eq!(
        b.session_id().await,
        None,
        "a follower needs no session while the lease is held"
    );

    let mut free = held.record.clone();
    free.holder_identity.clear();
    let released = a.update(&held.version, &free).await.expect("release");
    assert_eq!(
        a.session_id().await.map(u64::from),
        Some(session),
        "the session lives on after the release"
    );
    let alive: Option<u64> = admin
        .exec_first(
            "SELECT ID FROM information_schema.PROCESSLIST WHERE ID = ?",
            (session,),
        )
        .await
        .expect("processlist");
    assert_eq!(alive, Some(session), "the session is still connected");
    let is_free: Option<Option<i64>> = admin
        .exec_first("SELECT IS_FREE_LOCK(?)", (a.key(),))
        .await
        .expect("IS_FREE_LOCK");
    assert_eq!(
        is_free.flatten(),
        Some(1),
        "one RELEASE_LOCK freed the lock: it never stacked"
    );

    // A takeover from a stale version fails, and hands back the lock it took for the attempt.
    let stale = b.update(&held.version, &record("b", 99)).await;
    assert!(
        stale.as_ref().is_err_and(LockError::is_conflict),
        "{stale:?}"
    );
    assert_eq!(
        user(&mut admin, &b).await,
        None,
        "a failed take keeps nothing"
    );
    let taken = b
        .update(
            &released.version,
            &record("b", released.record.leader_transitions + 1),
        )
        .await
        .expect("takeover of the free record");
    let b_session = u64::from(b.session_id().await.expect("b's session"));
    assert_eq!(user(&mut admin, &b).await, Some(b_session));
    // A candidate that is refused (b holds it) keeps nothing either.
    assert!(a.update(&taken.version, &record("a", 500)).await.is_err());
    assert_eq!(user(&mut admin, &a).await, Some(b_session));
    b.close().await;
    a.close().await;
    assert_eq!(user(&mut admin, &b).await, None, "close lets go");
}

/// An idle session timeout shorter than the retry period: the server would drop the holder's
/// session, and its user-level lock, between two renewals, and the leader would lose every term
/// at its first renewal. The session stays at least the lease, so the term goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_keeps_its_session_with_an_idle_timeout_below_the_retry_period() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let name = unique("named-idle");
    let lock = store
        .named_lock(&name, "a")
        .idle_session_timeout(Duration::from_secs(1));
    let handle = lock.clone();
    // Lease 6 s, renew deadline 4.5 s: renewals 1.5 s apart, each past the 1 s.
    let retry = Duration::from_millis(1500);
    let mut leader = Running::start_with(lock, retry);
    let token = leader.wait_leading(Duration::from_secs(10)).await;
    let id = handle.session_id().await.expect("the leader's session");
    // Past the renew deadline, several renewals in.
    sleep(Duration::from_secs(7)).await;
    assert_eq!(
        leader.leading_token(),
        Some(token),
        "the term ended: {:?}",
        leader.stopped()
    );
    assert!(leader.stopped().is_empty(), "{:?}", leader.stopped());
    assert_eq!(handle.session_id().await, Some(id), "the same session");
    assert_eq!(user(&mut admin, &handle).await, Some(u64::from(id)));
    leader.stop().await;
}

/// The `leader` command's start on a server that can run the lock (no Galera: `wsrep_on` is
/// OFF or absent): open and the start check pass.
#[tokio::test]
async fn the_lock_opens_on_a_server_without_galera() {
    let Some(_store) = common::store().await else {
        return;
    };
    let url = format!("{}?lock=named", common::mysql_url());
    let lock = LockUrl::parse(&url)
        .expect("a lock URL")
        .open(&unique("named-open"), "a")
        .await
        .expect("opens");
    lock.check_lease(LEASE)
        .await
        .expect("the start check passes");
    lock.close().await;
}
