//! A shard set's records on Redis: a record whose holder stops renewing it is gone from the
//! set's next read once its lease has run out, which is why the members of a set on Redis
//! never probe each other's records (`LockSet::reads_show_expiry`).

mod common;

use std::time::Duration;

use leader_core::{Acquisition, LockSet};

use common::{store, unique};

#[tokio::test]
async fn a_record_not_renewed_is_gone_from_the_read_after_its_lease() {
    let Some(store) = store().await else { return };
    let set = store.lock_set("member-1");
    assert!(set.reads_show_expiry());
    let key = format!("{}-member-1", unique("jobs"));
    let desired = {
        let mut record = leader_core::conformance::record("member-1", 0);
        record.lease_duration = Duration::from_millis(500);
        record
    };
    let taken = set
        .lock(&key)
        .try_acquire(&desired)
        .await
        .expect("try_acquire");
    assert!(matches!(taken, Some(Acquisition::Acquired(_))), "{taken:?}");
    let read = set.get_many(std::slice::from_ref(&key)).await;
    assert!(
        read[0].as_ref().expect("read").is_some(),
        "present while held"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    let read = set.get_many(std::slice::from_ref(&key)).await;
    assert!(
        read[0].as_ref().expect("read").is_none(),
        "still read after its lease: {read:?}"
    );
}

/// `count` shards of set `name` taken by `member-1`: their keys, and each key with its record
/// as created.
async fn held(
    set: &leader_redis::RedisLockSet,
    name: &str,
    count: usize,
) -> (Vec<String>, Vec<(String, leader_core::Observed)>) {
    let keys: Vec<String> = (0..count).map(|i| format!("{name}-shard-{i}")).collect();
    let mut taken = Vec::new();
    for key in &keys {
        let observed = set
            .lock(key)
            .create(&leader_core::conformance::record("member-1", 1))
            .await
            .expect("create");
        taken.push((key.clone(), observed));
    }
    (keys, taken)
}

/// A member's round, its renewals and its read of the set, is one script on the server,
/// whatever the number of records (the commands `MONITOR` shows a client sending with the set's
/// keys).
#[tokio::test]
async fn a_round_is_one_script_whatever_the_number_of_records() {
    use futures_util::StreamExt;
    use leader_core::backend::{Known, Reread};

    let Some(store) = store().await else { return };
    let set = store.lock_set("member-1");
    let name = unique("round");
    let (keys, taken) = held(&set, &name, 50).await;
    let renewals = leader_core::conformance::renewals(&taken);
    let known: Vec<Known<'_>> = taken
        .iter()
        .map(|(_, o)| Known::Version(&o.version))
        .collect();

    let client = redis::Client::open(common::redis_url()).expect("REDIS_URL");
    let mut monitor = client
        .get_async_monitor()
        .await
        .expect("MONITOR")
        .into_on_message::<String>();
    let round = set.renew_and_read(&renewals, &keys, &known).await;
    assert!(
        round.renewed.iter().all(Result::is_ok),
        "{:?}",
        round.renewed
    );
    assert!(
        round.read.iter().all(|r| matches!(r, Ok(Reread::Same))),
        "{:?}",
        round.read
    );
    // A command after the round marks the end of what the monitor is to see.
    let end = format!("{name}-end");
    let mut admin = common::admin().await.expect("admin");
    let _: Option<String> = redis::cmd("GET")
        .arg(&end)
        .query_async(&mut admin)
        .await
        .expect("GET");
    let mut seen = Vec::new();
    while let Some(line) = tokio::time::timeout(Duration::from_secs(5), monitor.next())
        .await
        .expect("the monitor saw the end")
    {
        if line.contains(&end) {
            break;
        }
        // The commands a script runs show as the script's (`[DB lua]`): not requests.
        if line.contains(&name) && !line.contains(" lua]") {
            seen.push(line.chars().take(120).collect::<String>());
        }
    }
    assert_eq!(seen.len(), 1, "one command for the round: {seen:#?}");
    assert!(
        seen[0].to_ascii_uppercase().contains("\"EVALSHA\"")
            || seen[0].to_ascii_uppercase().contains("\"EVAL\""),
        "{}",
        seen[0]
    );
}

/// One shard's key overwritten with a value of another type (a stray `SET`) is that shard's
/// unreadable record, reported for it alone: the round's script goes on for the others, whose
/// renewals and reads are as before (S8), where the error ended the script for all of them.
#[tokio::test]
async fn a_key_of_another_type_spoils_only_its_own_shard() {
    use leader_core::LockError;
    use leader_core::backend::{Known, Reread};

    let Some(store) = store().await else { return };
    let set = store.lock_set("member-1");
    let name = unique("stray");
    let (keys, taken) = held(&set, &name, 4).await;
    let mut admin = common::admin().await.expect("admin");
    let stray = store.lock(&keys[1], "x").key().to_owned();
    let _: () = redis::cmd("SET")
        .arg(&stray)
        .arg("hello")
        .query_async(&mut admin)
        .await
        .expect("SET");
    let renewals = leader_core::conformance::renewals(&taken);
    let known: Vec<Known<'_>> = taken
        .iter()
        .map(|(_, o)| Known::Version(&o.version))
        .collect();
    let round = set.renew_and_read(&renewals, &keys, &known).await;
    for i in [0, 2, 3] {
        assert!(round.renewed[i].is_ok(), "{i}: {:?}", round.renewed[i]);
        assert!(
            matches!(round.read[i], Ok(Reread::Same)),
            "{i}: {:?}",
            round.read[i]
        );
    }
    assert!(round.renewed[1].is_err(), "{:?}", round.renewed[1]);
    match &round.read[1] {
        Err(err @ LockError::InvalidRecord { .. }) => {
            assert!(err.to_string().contains("another type"), "{err}");
        }
        other => panic!("the stray key read as {other:?}"),
    }
    // A read of the set alone says the same.
    let read = set.get_many(&keys).await;
    assert!(read[0].as_ref().is_ok_and(Option::is_some), "{read:?}");
    assert!(
        matches!(read[1], Err(LockError::InvalidRecord { .. })),
        "{read:?}"
    );
}
