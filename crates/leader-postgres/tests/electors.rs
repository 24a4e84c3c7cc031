//! Electors on one real Postgres: exactly one leads, a killed session, a fast handover.

mod common;

use leader_test_support::record_writes::created;
use leader_test_support::{assert_taken_over_once_killed, started_leading};
use std::time::Duration;

use common::{Factory, LEASE, RENEW, RETRY, Running, query_value, unique};
use leader_core::ResourceLock;
use leader_core::conformance;
use tokio::time::{Instant, sleep, timeout};

/// Two and ten electors each elect exactly one, and a release announced with NOTIFY is taken
/// over well within a retry period: on the table lock, and on the advisory lock.
async fn electors_conform(advisory: bool) {
    let Some(store) = common::store().await else {
        return;
    };
    conformance::electors(&Factory { store, advisory }, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_lock_electors_conform() {
    electors_conform(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn advisory_lock_electors_conform() {
    electors_conform(true).await;
}

/// The advisory lock belongs to the leader's session: when the server kills it, the leader
/// steps down by its renew deadline and another candidate takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn advisory_leader_steps_down_when_its_session_is_killed() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await.expect("server");
    let name = unique("terminate");
    let leader_lock = store.advisory_lock(&name, "first");
    let pid_of = leader_lock.clone();
    let (leader, token) = started_leading(leader_lock).await;
    let follower = Running::start(store.advisory_lock(&name, "second"));
    sleep(RETRY * 2).await;
    let pid = pid_of.backend_pid().await.expect("pid").expect("connected");
    let terminate = async {
        let terminated: bool =
            query_value(&admin, "SELECT pg_terminate_backend($1)", &[&pid]).await;
        assert!(terminated);
    };
    let (_, led) = assert_taken_over_once_killed(
        leader,
        token,
        follower,
        terminate,
        RENEW + RETRY * 2,
        LEASE + RETRY * 4,
    )
    .await;
    assert!(led < LEASE + RETRY * 4 + Duration::from_secs(1));
}

/// An `idle_session_timeout` below the retry period, which the server would end the holder's
/// session on between two renewals (and its advisory lock with it, every term ending at its
/// first renewal): the session is kept for the lease at least. The leader keeps its term and
/// its session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_timeout_below_the_retry_period_keeps_the_term() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("idle");
    let lock = store
        .advisory_lock(&name, "first")
        .idle_session_timeout(RETRY / 4);
    let pid_of = lock.clone();
    let (leader, token) = started_leading(lock).await;
    let pid = pid_of.backend_pid().await.expect("pid").expect("connected");
    sleep(LEASE).await;
    assert_eq!(
        leader.leading_token(),
        Some(token),
        "the leader kept its term"
    );
    assert_eq!(
        pid_of.backend_pid().await.expect("pid"),
        Some(pid),
        "the same session"
    );
    leader.stop().await;
}

/// A request the caller gives up on (the elector's request timeout) may still run on the server
/// later, so the advisory lock ends its session instead of keeping it: the server lets go of
/// the advisory lock, and the lease is not kept alive by statements nobody hears back from.
/// Here the statement waits on a row lock another session holds, as it would wait behind a
/// slow network, and the session must end before that wait does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_session_ends_when_a_request_is_cancelled() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await.expect("server");
    let mut other = common::admin().await.expect("server");
    let name = unique("cancelled");
    let lock = store.advisory_lock(&name, "first");
    let created = lock
        .create(&leader_core::conformance::record("first", 1))
        .await
        .expect("create");
    let pid = lock.backend_pid().await.expect("pid").expect("connected");
    let held: i64 = query_value(
        &admin,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
        &[&pid],
    )
    .await;
    assert_eq!(held, 1, "the session holds the advisory lock");
    let blocker = give_up_a_renewal_behind_the_row(&mut other, &lock, &name, &created).await;
    // The session ends while its statement still waits: the socket is closed at once, and the
    // server notices (client_connection_check_interval) without waiting for the statement.
    let ended = timeout(Duration::from_secs(5), async {
        loop {
            let alive: i64 = query_value(
                &admin,
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await;
            if alive == 0 {
                break;
            }
            sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(ended.is_ok(), "the session of the cancelled request ended");
    blocker.rollback().await.expect("rollback");
    let next = lock.backend_pid().await.expect("pid");
    assert_ne!(next, Some(pid), "the next request runs on a new session");
}

/// The table lock's lease lives in the row, not in a session: when the server kills the
/// leader's pooled connection, the next renewal runs on a fresh connection and the leader keeps
/// leading without a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn table_leader_rides_out_a_killed_connection() {
    let Some(admin) = common::admin().await else {
        return;
    };
    let app = unique("lt");
    let sep = if common::database_url().contains('?') {
        '&'
    } else {
        '?'
    };
    let url = format!("{}{sep}application_name={app}", common::database_url());
    let store = leader_postgres::PostgresStore::builder(url)
        .create_table(true)
        .build()
        .await
        .expect("store");
    let name = unique("terminate-table");
    let (leader, token) = started_leading(store.lock(&name, "first")).await;
    let follower = Running::start(store.lock(&name, "second"));
    sleep(RETRY * 2).await;
    let killed: i64 = query_value(
        &admin,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
        &[&app],
    )
    .await;
    assert!(killed >= 1, "no connection to kill");
    let until = Instant::now() + LEASE * 2;
    while Instant::now() < until {
        assert_eq!(
            leader.leading_token(),
            Some(token),
            "the leader lost its lease"
        );
        assert_eq!(follower.leading_token(), None);
        sleep(Duration::from_millis(20)).await;
    }
    let record = store
        .lock(&name, "x")
        .get()
        .await
        .expect("get")
        .expect("row")
        .record;
    assert!(record.is_held_by("first"));
    assert!(
        chrono::Utc::now() - record.renew_time
            < chrono::Duration::from_std(RENEW).expect("duration"),
        "renewals continued on a new connection"
    );
    follower.stop().await;
    leader.stop().await;
}

/// A handover on the advisory lock goes to the candidate it names, even when another candidate
/// tries first: that candidate's attempt may take the advisory lock in its statement, and must
/// let it go, or the named one could not acquire (and, once the others stood back for a lease,
/// the other would lead instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advisory_handover_goes_to_the_named_candidate_whoever_tries_first() {
    let Some(store) = common::store().await else {
        return;
    };
    let name = unique("advisory-reserved");
    let (a, b, c) = (
        store.advisory_lock(&name, "a"),
        store.advisory_lock(&name, "b"),
        store.advisory_lock(&name, "c"),
    );
    let record = |holder: &str| {
        let mut record = conformance::record(holder, 1);
        record.acquire_time = chrono::Utc::now();
        record.renew_time = record.acquire_time;
        record
    };
    let held = a.create(&record("a")).await.expect("a acquires");
    // The operator's request names b; a releases, keeping the request.
    let requested = leader_core::request_handover(&a, "b")
        .await
        .expect("handover request");
    let mut released = requested.record.clone();
    released.holder_identity.clear();
    a.update(&requested.version, &released)
        .await
        .expect("a releases");
    let _ = held;
    // c tries first: the lease is reserved for b.
    let tried = c.try_acquire(&record("c")).await.expect("c's attempt");
    assert!(
        matches!(tried, Some(leader_core::Acquisition::Held { .. })),
        "c took a lease reserved for b: {tried:?}"
    );
    // b, named, acquires.
    let taken = b.try_acquire(&record("b")).await.expect("b's attempt");
    assert!(
        matches!(taken, Some(leader_core::Acquisition::Acquired(ref o)) if o.record.holder_identity == "b"),
        "the named candidate could not acquire after another tried: {taken:?}"
    );
}

/// A renewal given up while its statement waits on the row (another transaction holds it) is
/// never applied later: its pooled connection does not answer the check, so the statement is
/// cancelled before the connection is closed. (A closed socket alone does not stop a backend
/// waiting on a lock: once the row is free, the late renewal would be written.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_given_up_while_it_waits_on_the_row_is_never_applied() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut blocker = common::admin().await.expect("server");
    let name = unique("given-up");
    let lock = store.lock(&name, "a");
    let created = created(&lock).await;
    let holding = give_up_a_renewal_behind_the_row(&mut blocker, &lock, &name, &created).await;
    // The check (1 s), then the cancel and the close: nothing waits on the row any more.
    let blocker_pid: i32 = query_value(&holding, "SELECT pg_backend_pid()", &[]).await;
    let watcher = common::admin().await.expect("server");
    let waiting = async || -> i64 {
        query_value(
            &watcher,
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            &[&blocker_pid],
        )
        .await
    };
    let until = Instant::now() + Duration::from_secs(30);
    while waiting().await > 0 {
        assert!(
            Instant::now() < until,
            "the renewal given up still waits on the row after 30 s"
        );
        sleep(Duration::from_millis(100)).await;
    }
    holding.commit().await.expect("commit");
    sleep(Duration::from_millis(500)).await;
    let stored = lock.get().await.expect("get").expect("row");
    assert_eq!(
        stored.version, created.version,
        "the renewal given up was written once the row was free"
    );
}

/// Holds the row of election `name` in a transaction of `client`'s (`FOR UPDATE`), then gives
/// up a renewal of `created` on `lock` after 300 ms, while its statement waits on the row. The
/// transaction holding the row.
async fn give_up_a_renewal_behind_the_row<'c>(
    client: &'c mut tokio_postgres::Client,
    lock: &dyn ResourceLock,
    name: &str,
    created: &leader_core::Observed,
) -> tokio_postgres::Transaction<'c> {
    let holding = client.transaction().await.expect("begin");
    holding
        .execute(
            "SELECT 1 FROM public.leader_election WHERE name = $1 FOR UPDATE",
            &[&name],
        )
        .await
        .expect("lock the row");
    let given_up = timeout(
        Duration::from_millis(300),
        lock.update(&created.version, &created.record),
    )
    .await;
    assert!(given_up.is_err(), "the row is locked: {given_up:?}");
    holding
}
