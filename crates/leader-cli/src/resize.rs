//! `leader shards resize`: a running shard set's count changed in its roster, which every
//! replica follows on its next read.

use std::time::Duration;

use leader_core::ResizeError;

use crate::args::ResizeArgs;
use crate::exit;
use crate::open::{code_for, fail};
use crate::set_status::{OPEN_TIMEOUT, no_answer, set_url};

/// How long the read and the compare-and-swap of the roster may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) async fn resize(args: ResizeArgs) -> u8 {
    let name = &args.lock.name;
    let url = match set_url(&args.lock) {
        Ok(url) => url,
        Err(code) => return code,
    };
    let nobody = |lock: &str| {
        fail(
            exit::NO_ELECTION,
            format!(
                "{lock}: no replica has run shard set {name:?} yet; nothing to resize (start \
                 them with --shards {})",
                args.count
            ),
        )
    };
    // A file lock directory that does not exist holds no set; resize creates nothing.
    if url.file_path().is_some_and(|dir| !dir.is_dir()) {
        return nobody(&url.describe());
    }
    let set = match tokio::time::timeout(OPEN_TIMEOUT, url.open_set(name, "leader-shards")).await {
        Ok(Ok(set)) => set,
        Ok(Err(err)) => return fail(code_for(&err), err),
        Err(_) => return no_answer(&url, OPEN_TIMEOUT),
    };
    let resized = tokio::time::timeout(
        WRITE_TIMEOUT,
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
        Ok(Err(ResizeError::NoSuchSet { .. })) => nobody(&set.describe()),
        Ok(Err(err @ ResizeError::InvalidRoster(_))) => fail(exit::SHARD_COUNT_MISMATCH, err),
        Ok(Err(ResizeError::Lock { source, .. })) => fail(code_for(&source), source),
        Ok(Err(err @ ResizeError::InvalidCount { .. })) => fail(exit::USAGE, err),
        Ok(Err(err)) => fail(exit::FAILURE, err),
        Err(_) => no_answer(&url, WRITE_TIMEOUT),
    }
}
