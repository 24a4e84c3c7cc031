//! Fencing tokens keep growing when the row's own count starts over (S5): the row deleted (by
//! an operator, a cleanup job) or a backup restored that holds an older count. A lock goes on
//! from the highest token it has seen, the table lock and the `GET_LOCK` lock alike, whether it
//! starts a term by insert, by takeover or by a compare-and-swap of the record it read, also
//! when a shard set's batch read the record; and a holder's writes carry its term's token on.

mod common;

use leader_core::backend::Renewal;
use leader_core::conformance::record;
use leader_core::{Acquisition, LeaderElectionRecord, LockSet, Observed, ResourceLock};
use leader_mysql::mysql_async::Conn;
use leader_mysql::mysql_async::prelude::Queryable;

/// Takes the free lease with `lock` as "a".
async fn take_free(lock: &dyn ResourceLock) -> Observed {
    let Some(Acquisition::Acquired(held)) = lock.try_acquire(&record("a", 0)).await.expect("try")
    else {
        panic!("the free lease is taken");
    };
    held
}

/// Takes the free lease with `lock`, then releases it; the token of that term.
async fn a_term(lock: &dyn ResourceLock) -> u64 {
    let held = take_free(lock).await;
    let token = held.record.leader_transitions;
    release(lock, &held).await;
    token
}

async fn release(lock: &dyn ResourceLock, held: &Observed) {
    let released = {
        let mut record = held.record.clone();
        record.holder_identity = String::new();
        record
    };
    lock.update(&held.version, &released)
        .await
        .expect("release");
}

/// What the row holds as its token.
async fn stored_token(admin: &mut Conn, name: &str) -> u64 {
    admin
        .exec_first(
            "SELECT leader_transitions FROM leader_election WHERE name = ?",
            (name,),
        )
        .await
        .expect("read the row")
        .expect("a row")
}

/// A backup from before the last terms: the count it holds is lower, at a version of then.
async fn restore_older_count(admin: &mut Conn, name: &str) {
    admin
        .exec_drop(
            "UPDATE leader_election SET leader_transitions = 1, version = version + 1 \
             WHERE name = ?",
            (name,),
        )
        .await
        .expect("restore an older count");
}

async fn delete_row(admin: &mut Conn, name: &str) {
    admin
        .exec_drop("DELETE FROM leader_election WHERE name = ?", (name,))
        .await
        .expect("delete the row");
}

/// Runs `check` on a table lock of a new election named after `prefix`.
async fn on_table_lock(prefix: &str, check: impl AsyncFnOnce(&dyn ResourceLock, &str)) {
    let Some(store) = common::store().await else {
        return;
    };
    let name = common::unique(prefix);
    check(&store.lock(&name, "a"), &name).await;
}

/// Runs `check` on a `GET_LOCK` lock of a new election named after `prefix`, then closes it.
async fn on_named_lock(prefix: &str, check: impl AsyncFnOnce(&dyn ResourceLock, &str)) {
    let Some(store) = common::store().await else {
        return;
    };
    let name = common::unique(prefix);
    let lock = store.named_lock(&name, "a");
    check(&lock, &name).await;
    lock.close().await;
}

/// Takes the lease by compare-and-swap of the record `read` after a restored backup, with its
/// count plus one: `highest`, the highest token the lock has seen, which must not be issued
/// again (`what` names the acquisition). What it holds then.
async fn taken_above(
    lock: &dyn ResourceLock,
    admin: &mut Conn,
    name: &str,
    read: &Observed,
    highest: u64,
    what: &str,
) -> Observed {
    let desired = record("a", read.record.leader_transitions + 1);
    assert_eq!(
        desired.leader_transitions, highest,
        "the case at hand: the restored count plus one is the highest token seen"
    );
    let taken = lock.update(&read.version, &desired).await.expect("take");
    let token = taken.record.leader_transitions;
    assert!(
        token > highest,
        "{what} reused token {token} (highest seen {highest})"
    );
    assert_eq!(stored_token(admin, name).await, token);
    taken
}

/// The holder's write of its term's own (an extension) after `renewed`: it keeps the term's
/// `token`, in what the lock returns and in the row. What it holds then.
async fn written_in_term(
    lock: &dyn ResourceLock,
    admin: &mut Conn,
    name: &str,
    renewed: &Observed,
    token: u64,
) -> Observed {
    let mut extended = renewal(&renewed.record);
    extended
        .extensions
        .insert("weight".to_owned(), "2".to_owned());
    let written = lock
        .update(&renewed.version, &extended)
        .await
        .expect("write of the term");
    assert_eq!(written.record.leader_transitions, token, "the term's token");
    assert_eq!(stored_token(admin, name).await, token);
    written
}

async fn tokens_go_on(lock: &dyn ResourceLock, name: &str) {
    let mut admin = common::admin().await.expect("server");
    let mut tokens = vec![a_term(lock).await, a_term(lock).await];

    delete_row(&mut admin, name).await;
    tokens.push(a_term(lock).await);
    assert_eq!(
        stored_token(&mut admin, name).await,
        *tokens.last().expect("a token"),
        "the row holds the token the lock returned"
    );

    restore_older_count(&mut admin, name).await;
    tokens.push(a_term(lock).await);

    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens must grow: {tokens:?}"
    );
    delete_row(&mut admin, name).await;
}

#[tokio::test]
async fn tokens_go_on_after_the_row_is_deleted_or_a_backup_restored() {
    on_table_lock("tokens", tokens_go_on).await;
}

#[tokio::test]
async fn get_lock_tokens_go_on_after_the_row_is_deleted_or_a_backup_restored() {
    on_named_lock("named-tokens", tokens_go_on).await;
}

/// The elector's acquisition by compare-and-swap (`update` of the record read, with its token
/// plus one) after a restored backup: that token is the highest the lock has seen, and must
/// not be issued again. The holder's next write of the term keeps it.
async fn an_acquisition_by_update_goes_above_every_token_seen(lock: &dyn ResourceLock, name: &str) {
    let mut admin = common::admin().await.expect("server");
    a_term(lock).await;
    let highest = a_term(lock).await;

    restore_older_count(&mut admin, name).await;
    let read = lock.get().await.expect("get").expect("the row");
    let taken = taken_above(lock, &mut admin, name, &read, highest, "an acquisition").await;
    let token = taken.record.leader_transitions;

    // A renewal, and a write of the term's own (an extension), carry the term's token on.
    let renewed = lock
        .renew(&taken.version, &renewal(&taken.record))
        .await
        .expect("renew");
    assert_eq!(renewed.record.leader_transitions, token);
    let written = written_in_term(lock, &mut admin, name, &renewed, token).await;

    release(lock, &written).await;
    delete_row(&mut admin, name).await;
}

fn renewal(of: &LeaderElectionRecord) -> LeaderElectionRecord {
    let mut next = of.clone();
    next.renew_time = chrono::Utc::now();
    next
}

#[tokio::test]
async fn a_table_lock_acquisition_by_update_goes_above_every_token_seen() {
    on_table_lock(
        "tokens-update",
        an_acquisition_by_update_goes_above_every_token_seen,
    )
    .await;
}

#[tokio::test]
async fn a_get_lock_acquisition_by_update_goes_above_every_token_seen() {
    on_named_lock(
        "named-tokens-update",
        an_acquisition_by_update_goes_above_every_token_seen,
    )
    .await;
}

/// A shard set's batch renews a term (at a version the key's lock never saw): the holder's
/// next write of that term (an extension) keeps the term's token.
#[tokio::test]
async fn a_write_after_a_batch_renewal_keeps_the_terms_token() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let name = common::unique("set-tokens-renew");
    let set = store.lock_set("a");
    let lock = set.lock(&name);
    let held = take_free(lock.as_ref()).await;
    let token = held.record.leader_transitions;
    let renewed = set
        .renew_many(&[Renewal {
            key: name.clone(),
            version: held.version.clone(),
            record: renewal(&held.record),
        }])
        .await
        .pop()
        .expect("one result")
        .expect("renewed in the batch");
    let written = written_in_term(lock.as_ref(), &mut admin, &name, &renewed, token).await;
    release(lock.as_ref(), &written).await;
    delete_row(&mut admin, &name).await;
}

/// A shard's claim: the record read by the set's batch (a version the key's lock never saw)
/// after a restored backup, taken with its count plus one, the highest token the lock has
/// seen: that token is not issued again.
#[tokio::test]
async fn a_claim_after_a_batch_read_goes_above_every_token_seen() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let name = common::unique("set-tokens-claim");
    let set = store.lock_set("a");
    let lock = set.lock(&name);
    a_term(lock.as_ref()).await;
    let highest = a_term(lock.as_ref()).await;

    restore_older_count(&mut admin, &name).await;
    let read = set
        .get_many(std::slice::from_ref(&name))
        .await
        .pop()
        .expect("one result")
        .expect("read")
        .expect("the row");
    let taken = taken_above(lock.as_ref(), &mut admin, &name, &read, highest, "a claim").await;
    release(lock.as_ref(), &taken).await;
    delete_row(&mut admin, &name).await;
}
