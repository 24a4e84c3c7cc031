use super::*;
use crate::conformance::record;

#[tokio::test]
async fn a_missing_parent_directory_is_misconfigured() {
    let lock = FileLock::new("/nonexistent-dir-for-leader-tests/x", "a");
    let err = lock.get().await.expect_err("no directory");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err}");
}

#[cfg(unix)]
#[tokio::test]
async fn the_directory_is_private_and_one_others_could_write_to_is_refused() {
    use std::os::unix::fs::{PermissionsExt, symlink};

    let dir = tempfile::tempdir().expect("tempdir");
    let lock = FileLock::new(dir.path().join("mine"), "a");
    lock.create(&record("a", 1)).await.expect("create");
    let mode = fs::metadata(lock.path())
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o700, "created private to this user");

    let refused = |path: PathBuf, why: &'static str| async move {
        let lock = FileLock::new(&path, "a");
        for result in [
            lock.get().await.map(drop),
            lock.create(&record("a", 1)).await.map(drop),
            lock.try_acquire(&record("a", 1)).await.map(drop),
        ] {
            match result {
                Err(LockError::Misconfigured { message, .. }) => assert!(
                    message.contains(why) && message.contains("another user"),
                    "{message}"
                ),
                other => panic!("{}: {other:?}", path.display()),
            }
        }
    };
    let open = dir.path().join("open");
    fs::create_dir(&open).expect("mkdir");
    fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).expect("chmod");
    refused(open, "writable by other users").await;
    let group = dir.path().join("group");
    fs::create_dir(&group).expect("mkdir");
    fs::set_permissions(&group, fs::Permissions::from_mode(0o770)).expect("chmod");
    refused(group, "writable by other users").await;
    let link = dir.path().join("link");
    symlink(lock.path(), &link).expect("symlink");
    refused(link, "symbolic link").await;
}

/// A directory another user made (as root: one of `nobody`'s) is refused.
#[cfg(unix)]
#[tokio::test]
async fn a_directory_of_another_user_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let theirs = dir.path().join("theirs");
    fs::create_dir(&theirs).expect("mkdir");
    if let Err(err) = std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)) {
        assert!(
            !nix::unistd::geteuid().is_root(),
            "root could not chown: {err}"
        );
        eprintln!("skipping: only root can give a directory to another user ({err})");
        return;
    }
    let lock = FileLock::new(&theirs, "a");
    match lock.get().await {
        Err(LockError::Misconfigured { message, .. }) => {
            assert!(message.contains("owned by user 65534"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn old_versions_are_collected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = FileLock::new(dir.path().join("x"), "a");
    let mut current = lock.create(&record("a", 1)).await.expect("create");
    for _ in 0..20 {
        current = lock
            .update(&current.version, &current.record)
            .await
            .expect("update");
    }
    let versions = newest_versions(&dir.path().join("x")).expect("list");
    assert_eq!(versions.len() as u64, KEEP + 1, "{versions:?}");
    assert_eq!(versions[0], 21);
}

/// A writer that read a version long ago, and whose next version number was written and
/// collected meanwhile, loses: its late write is not the record.
#[tokio::test]
async fn a_late_write_over_a_collected_version_is_a_conflict() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = FileLock::new(dir.path().join("x"), "a");
    let first = lock.create(&record("a", 1)).await.expect("create");
    let stale = read(&dir.path().join("x")).expect("read").expect("some");
    let mut current = first;
    for _ in 0..10 {
        current = lock
            .update(&current.version, &current.record)
            .await
            .expect("update");
    }
    let late = lock.write_next(Some(&stale), record("late", 2));
    assert!(matches!(late, Err(LockError::Conflict { .. })), "{late:?}");
    assert_eq!(
        lock.get().await.expect("get").expect("some"),
        current,
        "the record is the newest version"
    );
}

#[tokio::test]
async fn a_term_lock_is_held_while_leading_and_dropped_on_release() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = FileLock::new(dir.path().join("x"), "a");
    let b = FileLock::new(dir.path().join("x"), "b");
    let held = a.create(&record("a", 1)).await.expect("create");
    let stored = read(a.path()).expect("read").expect("some");
    assert!(stored.term.is_some(), "a term lock is named");
    assert!(!b.holder_is_gone(&stored), "the holder is alive");
    assert!(a.term_lock().is_some());
    let mut free = held.record.clone();
    free.holder_identity.clear();
    a.update(&held.version, &free).await.expect("release");
    assert!(a.term_lock().is_none(), "released with the lease");
    // A holder whose lock is gone (as when its process dies) is taken over at once.
    let taken = a.create(&record("a", 1)).await;
    assert!(taken.is_err(), "the record exists");
    let current = a.get().await.expect("get").expect("some");
    let mut again = current.record.clone();
    again.holder_identity = "a".into();
    again.leader_transitions += 1;
    a.update(&current.version, &again).await.expect("acquire");
    a.term.get().take();
    match b.try_acquire(&record("b", 0)).await.expect("try_acquire") {
        Some(Acquisition::Acquired(o)) => assert_eq!(o.record.leader_transitions, 3),
        other => panic!("the holder's term lock is free: {other:?}"),
    }
}
