//! Fencing tokens keep growing when the row's own count starts over (S5): the row deleted (by
//! an operator, a cleanup job) or a backup restored that holds an older count. A lock goes on
//! from the highest token it has seen.

mod common;

use leader_core::conformance::record;
use leader_core::{Acquisition, LeaderElectionRecord, ResourceLock};
use leader_mysql::mysql_async::prelude::Queryable;

/// Takes the free lease with `lock`, then releases it; the token of that term.
async fn a_term(lock: &dyn ResourceLock) -> u64 {
    let Some(Acquisition::Acquired(held)) = lock.try_acquire(&record("a", 0)).await.expect("try")
    else {
        panic!("the free lease is taken");
    };
    let token = held.record.leader_transitions;
    let released = LeaderElectionRecord {
        holder_identity: String::new(),
        ..held.record.clone()
    };
    lock.update(&held.version, &released)
        .await
        .expect("release");
    token
}

#[tokio::test]
async fn tokens_go_on_after_the_row_is_deleted_or_a_backup_restored() {
    let Some(store) = common::store().await else {
        return;
    };
    let mut admin = common::admin().await.expect("server");
    let name = common::unique("tokens");
    let lock = store.lock(&name, "a");
    let mut tokens = vec![a_term(&lock).await, a_term(&lock).await];

    admin
        .exec_drop("DELETE FROM leader_election WHERE name = ?", (&name,))
        .await
        .expect("delete the row");
    tokens.push(a_term(&lock).await);

    // A backup from before those terms: the count it holds is lower.
    admin
        .exec_drop(
            "UPDATE leader_election SET leader_transitions = 1 WHERE name = ?",
            (&name,),
        )
        .await
        .expect("restore an older count");
    tokens.push(a_term(&lock).await);

    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens must grow: {tokens:?}"
    );
    admin
        .exec_drop("DELETE FROM leader_election WHERE name = ?", (&name,))
        .await
        .expect("clean up");
}
