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

/// `url` with `password` for its user (and `user` when it has none).
fn with_password(url: &str, user: &str, password: &str) -> String {
    let mut url: url::Url = url.parse().expect("a URL");
    if url.username().is_empty() {
        url.set_username(user).expect("a user");
    }
    url.set_password(Some(password)).expect("a password");
    url.into()
}

/// A wrong password is an error at open, promptly (not a timeout), saying the server refused
/// it, never showing it.
async fn a_wrong_password_is_refused_at_open(url: String) {
    let started = std::time::Instant::now();
    match leader::open(&url, "jobs", "a").await {
        Err(OpenError::Lock(err)) => {
            let shown = format!("{err} {err:?}");
            assert!(
                !shown.contains("Wr0ngSecret"),
                "the password is shown: {shown}"
            );
            assert!(
                !matches!(err, LockError::Timeout { .. }),
                "a refusal waited for the open timeout: {shown}"
            );
            let lower = shown.to_ascii_lowercase();
            assert!(
                ["denied", "auth", "password", "wrongpass"]
                    .iter()
                    .any(|w| lower.contains(w)),
                "says nothing of the refusal: {shown}"
            );
        }
        Ok(_) => panic!("opened with a wrong password"),
        Err(other) => panic!("{other:?}"),
    }
    assert!(started.elapsed() < leader::OPEN_TIMEOUT);
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_wrong_mysql_password_is_an_error_at_open() {
    let Some(url) = leader_test_support::mysql_lock_or_skip() else {
        return;
    };
    a_wrong_password_is_refused_at_open(with_password(&url, "root", "Wr0ngSecret-mysql")).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_wrong_redis_password_is_an_error_at_open() {
    let Some(url) = leader_test_support::redis_lock_or_skip() else {
        return;
    };
    // A Redis without requirepass takes any password for `default` (nopass): a user that does
    // not exist is refused as a wrong password is.
    a_wrong_password_is_refused_at_open(with_password(&url, "no-such-user", "Wr0ngSecret-redis"))
        .await;
}
