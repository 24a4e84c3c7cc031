//! `leader status` of a shard set (`leader run --shards`): the count, the members and their
//! last renewals, each shard's owner, fencing token and since when, and the shards nobody owns,
//! read without taking part in the set.

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::Duration;

use leader::OpenError;
use leader_core::{
    LockError, MemberView, RecordState, RecordView, ShardSetView, ShardSetViewError,
};

use crate::ago::ago;
use crate::args::StatusArgs;
use crate::exit;
use crate::open::{code_for, fail, lock_url, no_answer, open_failed};

/// How long opening the store and reading the roster may take.
pub(crate) const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long reading the whole set may take (every member and every shard).
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Shows the shard set `--name` names. `asked` is `--shards`: without it, `None` when the store
/// holds no such set (or keeps no sets), so that the caller says the lock holds nothing.
pub(crate) async fn status(args: &StatusArgs, asked: bool) -> Option<u8> {
    let name = &args.lock.name;
    let url = match lock_url(&args.lock) {
        Ok(url) => url,
        Err(code) => return Some(code),
    };
    // A file lock directory that does not exist holds no set; status creates nothing.
    if url.file_path().is_some_and(|dir| !dir.is_dir()) {
        return no_set(args, &url.describe(), asked);
    }
    let set = match url
        .open_set_checked(name, "leader-status", OPEN_TIMEOUT)
        .await
    {
        Ok(set) => set,
        // A backend that keeps no shard sets holds none of this name.
        Err(OpenError::Lock(LockError::Misconfigured { .. })) if !asked => return None,
        Err(err) => return Some(open_failed(err)),
    };
    let view = match tokio::time::timeout(READ_TIMEOUT, ShardSetView::read(&*set, name)).await {
        Ok(Ok(Some(view))) => view,
        Ok(Ok(None)) => return no_set(args, &set.describe(), asked),
        Ok(Err(err)) => {
            let code = match &err {
                ShardSetViewError::Roster { source, .. } => code_for(source),
                _ => exit::SHARD_COUNT_MISMATCH,
            };
            return Some(fail(code, err));
        }
        Err(_) => return Some(no_answer(&url, READ_TIMEOUT)),
    };
    let out = if args.json {
        format!("{}\n", json(&view))
    } else {
        table(&view)
    };
    // A reader that closed the pipe (`| head`) has what it wanted.
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
    Some(exit::OK)
}

/// No roster of that name: said when asked for, else left to the caller.
fn no_set(args: &StatusArgs, lock: &str, asked: bool) -> Option<u8> {
    if !asked {
        return None;
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({"lock": lock, "name": args.lock.name, "exists": false, "shardSet": true})
        );
    } else {
        println!(
            "{lock}: no shard set {:?} (no roster record: no replica has run with --shards)",
            args.lock.name
        );
    }
    Some(exit::OK)
}

/// The view as JSON: the library's [`ShardSetView`], with `lock` (the store), `exists` and
/// `shardSet` as `leader status --json` says of a single election.
fn json(view: &ShardSetView) -> serde_json::Value {
    let mut value = serde_json::to_value(view).unwrap_or_default();
    if let Some(object) = value.as_object_mut() {
        object.remove("store");
        object.insert("lock".into(), view.store.clone().into());
        object.insert("exists".into(), true.into());
        object.insert("shardSet".into(), true.into());
    }
    value
}

/// The view for people, as `kafka-consumer-groups --describe` shows a group: a header, the
/// members, then one line per shard.
fn table(view: &ShardSetView) -> String {
    let mut out = String::new();
    let owned = view.shards.len() - view.unowned.len();
    let alive = view.members.iter().filter(|m| m.alive).count();
    let _ = writeln!(out, "lock         {}", view.store);
    let _ = writeln!(out, "shard set    {}", view.name);
    let _ = writeln!(
        out,
        "shards       {} ({owned} owned, {} unowned{})",
        view.count,
        view.unowned.len(),
        if view.unowned.is_empty() {
            String::new()
        } else {
            format!(": {}", list(&view.unowned))
        }
    );
    let _ = writeln!(out, "members      {} ({alive} alive)", view.members.len());
    out.push('\n');
    let mut rows = vec![[
        "MEMBER".to_owned(),
        "ALIVE".to_owned(),
        "WEIGHT".to_owned(),
        "SHARDS".to_owned(),
        "OWNED".to_owned(),
        "SINCE".to_owned(),
        "LAST RENEWAL".to_owned(),
    ]];
    for member in &view.members {
        rows.push([
            member.identity.clone(),
            liveness(member),
            if member.drained {
                "drained".to_owned()
            } else {
                member.weight.to_string()
            },
            member.shards.len().to_string(),
            list(&member.shards),
            time(member.record.acquire_time, view),
            renewal(&member.record, view),
        ]);
    }
    rows_into(&mut out, &rows);
    out.push('\n');
    let mut rows = vec![[
        "SHARD".to_owned(),
        "OWNER".to_owned(),
        "TOKEN".to_owned(),
        "SINCE".to_owned(),
        "STATE".to_owned(),
    ]];
    for shard in &view.shards {
        let record = &shard.record;
        rows.push([
            shard.shard.to_string(),
            record.owner().unwrap_or("-").to_owned(),
            record
                .fencing_token
                .map_or_else(|| "-".to_owned(), |t| t.to_string()),
            match record.state {
                RecordState::Held => time(record.acquire_time, view),
                _ => "-".to_owned(),
            },
            state(record),
        ]);
    }
    rows_into(&mut out, &rows);
    out
}

/// Whether a member is alive, and for a static member its window: how long its shards wait
/// for it once its lease ran out.
fn liveness(member: &MemberView) -> String {
    let alive = if member.alive { "yes" } else { "no" };
    match member.static_membership_window {
        Some(window) => format!(
            "{alive} (static, window {})",
            humantime::format_duration(window)
        ),
        None => alive.to_owned(),
    }
}

/// What a record's state says, with what people need to act on it.
fn state(record: &RecordView) -> String {
    let mut said = match record.state {
        RecordState::Held => "held".to_owned(),
        RecordState::Expired => format!(
            "expired (last owner {})",
            record.holder.as_deref().unwrap_or("?")
        ),
        RecordState::Free => "free".to_owned(),
        RecordState::Absent => "never taken".to_owned(),
        RecordState::Unreadable => format!(
            "unreadable: {}",
            record.error.as_deref().unwrap_or("no reason given")
        ),
        _ => "unknown".to_owned(),
    };
    if let Some(to) = &record.handover_to {
        said.push_str(&format!(", handover to {to} pending"));
    }
    said
}

fn time(at: Option<chrono::DateTime<chrono::Utc>>, view: &ShardSetView) -> String {
    at.map_or_else(
        || "-".to_owned(),
        |at| {
            format!(
                "{} ({})",
                at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                ago(view.read_at - at)
            )
        },
    )
}

/// A member's last renewal, or, where the store renews leases itself, the time its lease has
/// left by the store's clock.
fn renewal(record: &RecordView, view: &ShardSetView) -> String {
    match (record.state, record.expires_in) {
        (RecordState::Unreadable, _) => state(record),
        (_, Some(left)) => format!(
            "renewed in the store (expires in {})",
            humantime::format_duration(Duration::from_millis(
                u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
            ))
        ),
        (state, _) => {
            let at = time(record.renew_time, view);
            match state {
                RecordState::Expired => format!("{at}, lease ran out"),
                RecordState::Free | RecordState::Absent => "(left)".to_owned(),
                _ => at,
            }
        }
    }
}

/// Shards as a short list: `0-3,7`.
fn list(shards: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut run: Option<(u32, u32)> = None;
    for &shard in shards {
        run = match run {
            Some((first, last)) if last.checked_add(1) == Some(shard) => Some((first, shard)),
            Some(done) => {
                parts.push(range(done));
                Some((shard, shard))
            }
            None => Some((shard, shard)),
        };
    }
    parts.extend(run.map(range));
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(",")
    }
}

fn range((first, last): (u32, u32)) -> String {
    if first == last {
        first.to_string()
    } else {
        format!("{first}-{last}")
    }
}

/// Rows in columns, each as wide as its widest cell; the last column unpadded.
fn rows_into<const N: usize>(out: &mut String, rows: &[[String; N]]) {
    let mut widths = [0; N];
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in rows {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            if i + 1 == N {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}  "));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::list;

    #[test]
    fn shards_are_listed_in_runs() {
        assert_eq!(list(&[]), "-");
        assert_eq!(list(&[4]), "4");
        assert_eq!(list(&[0, 1, 2, 3, 7, 9, 10]), "0-3,7,9-10");
    }
}
