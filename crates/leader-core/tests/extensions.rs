//! The record's extensions on tokio's paused clock: the leader writes them with a
//! compare-and-swap fenced by its term, the next leader reads what was stored, and a leader
//! whose term ended writes nothing.

mod common;

use std::collections::BTreeMap;

use leader_core::background::Candidate;
use leader_core::faults::FaultyLock;
use leader_core::{ExtensionError, MemoryStore, request_handover};
use tokio::time::sleep;

use common::{RETRY, builder, stored_record};

async fn stored(store: &MemoryStore) -> BTreeMap<String, String> {
    stored_record(store, "election").await.extensions
}

#[tokio::test(start_paused = true)]
async fn the_leader_writes_them_and_the_next_leader_reads_them() {
    let store = MemoryStore::new();
    for store_clock in [false, true] {
        let lock = |id: &str| store.lock("election", id).with_store_clock(store_clock);
        let mut a = Candidate::build(builder(lock("a")));
        let term = a.leadership().await;
        term.set_extension("cron/nightly", Some("started 7".into()))
            .await
            .expect("written");
        term.set_extensions([
            ("shards".to_owned(), Some("16".to_owned())),
            ("cron/hourly".to_owned(), Some("done".to_owned())),
        ])
        .await
        .expect("written");
        term.set_extension("cron/hourly", None)
            .await
            .expect("removed");
        let expected = BTreeMap::from([
            ("cron/nightly".to_owned(), "started 7".to_owned()),
            ("shards".to_owned(), "16".to_owned()),
        ]);
        assert_eq!(term.extensions(), expected);
        assert_eq!(stored(&store).await, expected, "in the store at once");
        // Renewals keep them; a handover request keeps them; the next leader reads them.
        drop(term);
        sleep(RETRY * 3).await;
        let mut b = Candidate::build(builder(lock("b")));
        request_handover(&store.lock("election", "operator"), "b")
            .await
            .expect("request");
        let next = b.leadership().await;
        assert_eq!(
            next.extensions(),
            expected,
            "the next term starts from them"
        );
        drop(next);
        b.stop().await;
        a.stop().await;
        store.delete("election");
    }
}

#[tokio::test(start_paused = true)]
async fn a_term_that_ended_writes_nothing() {
    let store = MemoryStore::new();
    let lock = FaultyLock::new(store.lock("election", "a"));
    let faults = lock.faults();
    let mut a = Candidate::build(builder(lock));
    let term = a.leadership().await;
    term.set_extension("cron/nightly", Some("first".into()))
        .await
        .expect("written");
    // The store hangs: the write cannot complete, and the term ends at its renew deadline.
    faults.hang(true);
    let written = term
        .set_extension("cron/nightly", Some("late".into()))
        .await;
    assert!(
        matches!(
            written,
            Err(ExtensionError::Lost(_) | ExtensionError::Lock(_))
        ),
        "{written:?}"
    );
    term.lost().await;
    let after = term
        .set_extension("cron/nightly", Some("after".into()))
        .await;
    assert!(matches!(after, Err(ExtensionError::Lost(_))), "{after:?}");
    // This process goes away (its lease runs out: the old term's clone is still held here).
    a.shutdown.cancel();
    faults.hang(false);
    assert_eq!(
        stored(&store).await.get("cron/nightly").map(String::as_str),
        Some("first"),
        "nothing written once the term could not renew"
    );
    // Another takes over meanwhile: the old term's clone can never write over its record.
    let mut b = Candidate::build(builder(store.lock("election", "b")));
    let next = b.leadership().await;
    next.set_extension("cron/nightly", Some("b's".into()))
        .await
        .expect("written");
    let stale = term
        .set_extension("cron/nightly", Some("stale".into()))
        .await;
    assert!(matches!(stale, Err(ExtensionError::Lost(_))), "{stale:?}");
    assert_eq!(
        stored(&store).await.get("cron/nightly").map(String::as_str),
        Some("b's")
    );
    drop((term, next));
    b.stop().await;
    a.task
        .await
        .expect("elector task")
        .expect("the elector ran");
}
