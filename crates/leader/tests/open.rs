//! `leader::open` checks the lock before it returns: a server that is down, a database that
//! does not exist or an unreadable directory are errors at start, not later in the elector.

use leader::{LockError, OpenError};

#[tokio::test]
async fn a_directory_another_user_could_write_to_is_an_error_at_open() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let open_to_all = dir.path().join("shared");
    std::fs::create_dir(&open_to_all).expect("mkdir");
    std::fs::set_permissions(&open_to_all, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let url = format!("file://{}", open_to_all.display());
    match leader::open(&url, "jobs", "a").await {
        Err(OpenError::Lock(LockError::Misconfigured { message, .. })) => {
            assert!(message.contains("writable by other users"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_postgres_that_is_down_or_a_missing_database_is_an_error_at_open() {
    let down = "postgres://postgres:postgres@127.0.0.1:1/postgres";
    match leader::open(down, "jobs", "a").await {
        Err(OpenError::Lock(LockError::Unavailable { .. } | LockError::Timeout { .. })) => {}
        other => panic!("a server that is down: {other:?}"),
    }
    let mut missing: url::Url = leader_test_support::database_url()
        .parse()
        .expect("DATABASE_URL");
    missing.set_path("/no_such_database_for_leader_tests");
    match leader::open(missing.as_str(), "jobs", "a").await {
        Err(OpenError::Lock(err)) => {
            let shown = err.to_string();
            assert!(
                shown.contains("no_such_database_for_leader_tests"),
                "{shown}"
            );
            assert!(
                !shown.contains(":postgres@"),
                "the password is shown: {shown}"
            );
        }
        other => panic!("a database that does not exist: {other:?}"),
    }
}
