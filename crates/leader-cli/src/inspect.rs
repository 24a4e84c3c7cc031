//! `leader status` and `leader handover`: the lock read, and a handover asked for, without
//! taking part in the election.

use std::time::Duration;

use crate::ago::ago;
use crate::args::{HandoverArgs, StatusArgs};
use crate::exit;
use crate::open::{code_for, fail, open_lock};
use crate::set_status;

pub(crate) async fn status(args: StatusArgs) -> u8 {
    if args.shards {
        return set_status::status(&args, true)
            .await
            .unwrap_or(exit::FAILURE);
    }
    let lock = match open_lock(&args.lock, "leader-status", Duration::from_secs(5)).await {
        Ok((lock, _)) => lock,
        Err(code) => return code,
    };
    let observed = match lock.get().await {
        Ok(observed) => observed,
        Err(err) => return fail(code_for(&err), err),
    };
    let now = chrono::Utc::now();
    let Some(observed) = observed else {
        // A shard set keeps no record under its own name: its roster is `NAME-members`.
        if let Some(code) = set_status::status(&args, false).await {
            return code;
        }
        if args.json {
            println!(
                "{}",
                serde_json::json!({"lock": lock.describe(), "name": args.lock.name, "exists": false})
            );
        } else {
            println!(
                "{}: no record yet (nobody has run for leadership, and no shard set of this name)",
                lock.describe()
            );
        }
        return exit::OK;
    };
    let record = &observed.record;
    // The store's own clock, where it keeps one: the holder may renew there without rewriting
    // the record's renew time (etcd, Redis).
    let time_left = lock.time_left().await.ok().flatten();
    let lease = chrono::Duration::from_std(record.lease_duration).unwrap_or(chrono::Duration::MAX);
    // Wall clocks, for people: the electors themselves never decide on them.
    let expired = match time_left {
        Some(left) => left.is_zero(),
        // A lease past the calendar's end (a record that asks for "forever") never expires.
        None => {
            record.is_free()
                || record
                    .renew_time
                    .checked_add_signed(lease)
                    .is_some_and(|end| end < now)
        }
    };
    if args.json {
        let value = serde_json::json!({
            "lock": lock.describe(),
            "name": args.lock.name,
            "exists": true,
            "holder": (!record.is_free()).then_some(&record.holder_identity),
            "leaseDurationMillis": record.lease_duration.as_millis(),
            "acquireTime": record.acquire_time,
            "renewTime": record.renew_time,
            "leaderTransitions": record.leader_transitions,
            "expired": expired,
            // What `expired` was judged by: the store's clock, or the holder's renew time
            // against this machine's clock.
            "expiredBy": if time_left.is_some() { "store" } else { "renewTime" },
            "expiresInMillis": time_left.map(|left| left.as_millis()),
            "handoverTo": record.handover_to(),
            "schedules": schedules_json(record),
        });
        println!("{value}");
    } else {
        let holder = if record.is_free() {
            "(released)"
        } else {
            &record.holder_identity
        };
        println!("lock         {}", lock.describe());
        println!("name         {}", args.lock.name);
        println!("holder       {holder}");
        println!(
            "lease        {}",
            humantime::format_duration(record.lease_duration)
        );
        println!(
            "acquired     {} ({})",
            record.acquire_time.to_rfc3339(),
            ago(now - record.acquire_time)
        );
        println!(
            "renewed      {} ({})",
            record.renew_time.to_rfc3339(),
            ago(now - record.renew_time)
        );
        println!("transitions  {}", record.leader_transitions);
        // Without the store's clock, the holder's renew time against this machine's clock:
        // machines whose clocks disagree by more than what is left of the lease disagree.
        let judged_by = if time_left.is_some() || record.is_free() {
            ""
        } else {
            " (the renew time, written by the holder's clock, against this machine's)"
        };
        println!(
            "expired      {}{judged_by}",
            if expired { "yes" } else { "no" }
        );
        if let Some(left) = time_left {
            println!(
                "expires in   {} (by the store's clock)",
                humantime::format_duration(left)
            );
        }
        if let Some(to) = record.handover_to() {
            println!("handover to  {to} (pending)");
        }
        print_schedules(record);
    }
    exit::OK
}

/// The schedules `leader cron` keeps in the record, as JSON: each with its last firing and
/// outcome, and the next firing.
#[cfg(feature = "cron")]
fn schedules_json(record: &leader_core::LeaderElectionRecord) -> serde_json::Value {
    use leader::cron::ScheduleStatus;
    let schedules: Vec<serde_json::Value> = ScheduleStatus::all_in(&record.extensions)
        .into_iter()
        .map(|s| {
            serde_json::json!({
                "name": s.name,
                "schedule": s.state.schedule,
                "running": s.state.running,
                "last": s.state.last,
                "history": s.state.history,
                "retrying": s.state.retrying,
                "missed": s.state.missed,
                "next": s.next,
                "changed": s.state.changed,
                "suspended": s.suspended,
                "pendingTrigger": s.pending_trigger,
                "pendingCancel": s.pending_cancel,
            })
        })
        .collect();
    serde_json::Value::Array(schedules)
}

#[cfg(not(feature = "cron"))]
fn schedules_json(_record: &leader_core::LeaderElectionRecord) -> serde_json::Value {
    serde_json::Value::Array(Vec::new())
}

/// The schedules, for people.
#[cfg(feature = "cron")]
fn print_schedules(record: &leader_core::LeaderElectionRecord) {
    use leader::cron::ScheduleStatus;
    for s in ScheduleStatus::all_in(&record.extensions) {
        println!("schedule     {} ({})", s.name, s.state.schedule);
        match &s.state.last {
            Some(last) => println!(
                "  last       {} attempt {}: {} at {}",
                last.scheduled.to_rfc3339(),
                last.attempt,
                describe(&last.outcome),
                last.ended_at.to_rfc3339()
            ),
            None => println!("  last       (none yet)"),
        }
        for ended in s.state.history.iter().rev().skip(1) {
            println!(
                "  earlier    {} attempt {}: {} at {}{}",
                ended.scheduled.to_rfc3339(),
                ended.attempt,
                describe(&ended.outcome),
                ended.ended_at.to_rfc3339(),
                ended
                    .identity
                    .as_ref()
                    .zip(ended.fencing_token)
                    .map(|(identity, token)| format!(" ({identity}, fencing token {token})"))
                    .unwrap_or_default()
            );
        }
        for running in &s.state.running {
            println!(
                "  running    {} attempt {} (fencing token {}, since {})",
                running.scheduled.to_rfc3339(),
                running.attempt,
                running.fencing_token,
                running.started_at.to_rfc3339()
            );
        }
        for retry in &s.state.retrying {
            println!(
                "  retrying   {} attempt {} at {}",
                retry.scheduled.to_rfc3339(),
                retry.attempt,
                retry.at.to_rfc3339()
            );
        }
        match (&s.suspended, s.next) {
            (Some(by), _) => println!(
                "  suspended  by {} since {}: no firing starts until resumed",
                by.by,
                by.at.to_rfc3339()
            ),
            (None, Some(next)) => println!("  next       {}", next.to_rfc3339()),
            (None, None) => println!("  next       (never)"),
        }
        if let Some(asked) = &s.pending_trigger {
            println!(
                "  trigger    asked by {} at {}, not started yet",
                asked.by,
                asked.at.to_rfc3339()
            );
        }
        if let Some(asked) = &s.pending_cancel {
            let firings: Vec<String> = asked.firings.iter().map(|at| at.to_rfc3339()).collect();
            println!(
                "  cancel     of {} asked by {} at {}, not handled yet",
                firings.join(", "),
                asked.by,
                asked.at.to_rfc3339()
            );
        }
        if let Some(changed) = &s.state.changed {
            println!(
                "  changed    from {} by {} at {}",
                changed.from,
                changed.by,
                changed.at.to_rfc3339()
            );
        }
        if s.state.missed > 0 {
            println!("  missed     {}", s.state.missed);
        }
    }
}

#[cfg(feature = "cron")]
fn describe(outcome: &leader::cron::Outcome) -> String {
    use leader::cron::Outcome;
    match outcome {
        Outcome::Failed { message } => format!("failed ({message})"),
        Outcome::GaveUp { reason } => format!("gave up ({reason})"),
        Outcome::Cancelled { by } => format!("cancelled (by {by})"),
        other => other.name().to_owned(),
    }
}

#[cfg(not(feature = "cron"))]
fn print_schedules(_record: &leader_core::LeaderElectionRecord) {}

pub(crate) async fn handover(args: HandoverArgs) -> u8 {
    let lock = match open_lock(&args.lock, "leader-handover", Duration::from_secs(5)).await {
        Ok((lock, _)) => lock,
        Err(code) => return code,
    };
    let Some(to) = args.to.as_deref() else {
        return match leader_core::withdraw_handover(&*lock).await {
            Ok(_) => {
                println!("{}: no handover request pending", lock.describe());
                exit::OK
            }
            Err(leader_core::HandoverError::NoElection { lock }) => fail(
                exit::NO_ELECTION,
                format!("{lock}: nobody has run for this election yet; nothing to withdraw"),
            ),
            Err(leader_core::HandoverError::Lock(err)) => fail(code_for(&err), err),
            Err(err) => fail(exit::FAILURE, err),
        };
    };
    let written = match leader_core::request_handover(&*lock, to).await {
        Ok(written) => written,
        Err(leader_core::HandoverError::NoElection { lock }) => {
            return fail(
                exit::NO_ELECTION,
                format!("{lock}: nobody has run for this election yet; nothing to hand over"),
            );
        }
        Err(leader_core::HandoverError::Lock(err)) => return fail(code_for(&err), err),
        Err(err) => return fail(exit::FAILURE, err),
    };
    if written.record.is_held_by(to) {
        println!("{to} already leads");
        return exit::OK;
    }
    println!("asked {} to hand over to {to}", lock.describe());
    if !args.wait {
        return exit::OK;
    }
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut last = written.record;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match lock.get().await {
            Ok(Some(current)) if current.record.is_held_by(to) => {
                println!(
                    "{to} leads (fencing token {})",
                    current.record.leader_transitions
                );
                return exit::OK;
            }
            Ok(Some(current)) => last = current.record,
            Ok(None) | Err(_) => {}
        }
    }
    let now = if last.is_free() {
        "nobody leads".to_owned()
    } else {
        format!("{} leads", last.holder_identity)
    };
    fail(
        exit::NOT_HANDED_OVER,
        format!(
            "{to} did not lead within {} ({now})",
            humantime::format_duration(args.timeout)
        ),
    )
}
