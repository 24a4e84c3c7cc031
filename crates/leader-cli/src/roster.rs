//! `leader shards resize|drain|undrain`: a running shard set changed through its roster, which
//! every replica follows on its next read.

use std::time::Duration;

use leader_core::{LockSet, RosterError, ShardSetView};

use crate::args::{DrainArgs, LockArgs, ResizeArgs};
use crate::exit;
use crate::open::{code_for, fail, lock_url, open_failed};
use crate::set_status::OPEN_TIMEOUT;

/// How long the read and the compare-and-swap of the roster may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The set's records through `--lock`, or the exit code: `nothing` says what there is to act
/// on, in the line said when no replica has run the set.
async fn open(lock: &LockArgs, nothing: &str) -> Result<Box<dyn LockSet>, u8> {
    let url = lock_url(lock)?;
    // A file lock directory that does not exist holds no set; this creates nothing.
    if url.file_path().is_some_and(|dir| !dir.is_dir()) {
        return Err(nobody(&url.describe(), &lock.name, nothing));
    }
    url.open_set_checked(&lock.name, "leader-shards", OPEN_TIMEOUT)
        .await
        .map_err(open_failed)
}

fn nobody(lock: &str, name: &str, nothing: &str) -> u8 {
    fail(
        exit::NO_ELECTION,
        format!("{lock}: no replica has run shard set {name:?} yet; {nothing}"),
    )
}

/// `change` of the roster of `set` if the store answers within [`WRITE_TIMEOUT`], else the
/// exit code of a store that did not.
async fn within<T>(set: &dyn LockSet, change: impl Future<Output = T>) -> Result<T, u8> {
    tokio::time::timeout(WRITE_TIMEOUT, change)
        .await
        .map_err(|_| {
            fail(
                exit::UNREACHABLE,
                format!("{}: no answer within {WRITE_TIMEOUT:?}", set.describe()),
            )
        })
}

/// The exit code and line of a change of the roster that failed.
fn failed(set: &dyn LockSet, name: &str, nothing: &str, err: RosterError) -> u8 {
    match err {
        RosterError::NoSuchSet { .. } => nobody(&set.describe(), name, nothing),
        err @ RosterError::InvalidRoster(_) => fail(exit::SHARD_COUNT_MISMATCH, err),
        RosterError::Lock { source, .. } => fail(code_for(&source), source),
        err @ RosterError::InvalidCount { .. } => fail(exit::USAGE, err),
        err => fail(exit::FAILURE, err),
    }
}

pub(crate) async fn resize(args: ResizeArgs) -> u8 {
    let name = &args.lock.name;
    let nothing = format!(
        "nothing to resize (start them with --shards {})",
        args.count
    );
    let set = match open(&args.lock, &nothing).await {
        Ok(set) => set,
        Err(code) => return code,
    };
    let resized = within(
        &*set,
        leader_core::resize_shard_set(&*set, name, args.count),
    )
    .await;
    match resized {
        Ok(Ok(before)) if before == args.count => {
            println!("shard set {name:?} already has {before} shards");
            exit::OK
        }
        Ok(Ok(before)) => {
            println!(
                "shard set {name:?}: {before} -> {} shards; its replicas follow within a retry \
                 period (start new ones with --shards {})",
                args.count, args.count
            );
            exit::OK
        }
        Ok(Err(err)) => failed(&*set, name, &nothing, err),
        Err(code) => code,
    }
}

pub(crate) async fn drain(args: DrainArgs, drain: bool) -> u8 {
    let (name, identity) = (&args.lock.name, &args.identity);
    let nothing = "nothing to drain";
    let set = match open(&args.lock, nothing).await {
        Ok(set) => set,
        Err(code) => return code,
    };
    let changed = within(
        &*set,
        leader_core::drain_member(&*set, name, identity, drain),
    )
    .await;
    let was = match changed {
        Ok(Ok(was)) => was,
        Ok(Err(err)) => return failed(&*set, name, nothing, err),
        Err(code) => return code,
    };
    let view = ShardSetView::read(&*set, name).await.ok().flatten();
    let member = view
        .as_ref()
        .is_some_and(|v| v.members.iter().any(|m| m.identity == *identity));
    match (drain, was) {
        (true, true) => println!("{identity} was drained already"),
        (true, false) => println!(
            "drained {identity}: it hands its shards to the others and takes none until undrained"
        ),
        (false, false) => println!("{identity} was not drained"),
        (false, true) => println!("undrained {identity}: it takes its share again"),
    }
    if !member {
        println!("{identity} is not a member of shard set {name:?} now: the mark waits for it");
    }
    if !args.wait {
        return exit::OK;
    }
    let deadline = tokio::time::Instant::now() + args.timeout;
    loop {
        let view = ShardSetView::read(&*set, name).await.ok().flatten();
        if let Some(view) = &view
            && let Some(owned) = at_target(view, identity, drain)
        {
            println!("{identity} owns {owned} shards");
            return exit::OK;
        }
        if tokio::time::Instant::now() >= deadline {
            let owned = view
                .and_then(|v| v.members.into_iter().find(|m| m.identity == *identity))
                .map_or(0, |m| m.shards.len());
            return fail(
                exit::NOT_HANDED_OVER,
                format!(
                    "{identity} still owns {owned} shards after {:?}{}",
                    args.timeout,
                    if drain { "" } else { ", short of its share" }
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The shards `identity` owns once a drain (none) or an undrain (every shard owned, and at
/// least its share by weight among the live members not drained) has taken effect.
fn at_target(view: &ShardSetView, identity: &str, drain: bool) -> Option<usize> {
    let member = view.members.iter().find(|m| m.identity == identity);
    let owned = member.map_or(0, |m| m.shards.len());
    if drain {
        return (owned == 0).then_some(0);
    }
    let member = member.filter(|m| m.alive)?;
    let total: u64 = view
        .members
        .iter()
        .filter(|m| m.alive && !m.drained)
        .map(|m| u64::from(m.weight))
        .sum();
    let share = u64::from(view.count) * u64::from(member.weight) / total.max(1);
    (view.unowned.is_empty() && owned as u64 >= share).then_some(owned)
}
