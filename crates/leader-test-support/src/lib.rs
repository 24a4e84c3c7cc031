//! What the workspace's tests and benchmarks share, written once: the service URLs and their
//! defaults, the rule that a missing service fails under CI and is skipped elsewhere, candidates
//! running in the background with short timings, and the benchmark tables. Not published.

#![forbid(unsafe_code)]

use std::time::Duration;

pub mod bench;
#[cfg(feature = "consul-api")]
pub mod consul_api;
pub mod etcd_cluster;
pub mod held_lease;
#[cfg(feature = "kube-api")]
pub mod kube_api;
pub mod later_column;
#[cfg(feature = "object-store")]
pub mod object_store_counting;
mod process;
#[cfg(feature = "proxy")]
pub mod proxy;
pub mod record_writes;
pub mod redaction;
pub mod secrets;
pub mod unreadable;
pub mod zookeeper_ensemble;

/// `DATABASE_URL`'s default: the loopback server's `postgres` database.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/postgres";
/// `REDIS_URL`'s default.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// `ETCD_ENDPOINTS`'s default.
pub const DEFAULT_ETCD_ENDPOINTS: &str = "http://127.0.0.1:2379";

/// The Postgres the tests use: `DATABASE_URL`, or the loopback server.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// `MYSQL_URL`'s default: the loopback MariaDB's `test` database, as root without a password.
pub const DEFAULT_MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// The MySQL or MariaDB server the tests use: `MYSQL_URL`, or the loopback server.
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| DEFAULT_MYSQL_URL.to_owned())
}

/// `NATS_URL`'s default: the loopback NATS server (with JetStream).
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// The NATS server the tests use: `NATS_URL`, or the loopback server.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned())
}

/// The key-value bucket the tests use: `NATS_BUCKET` (`scripts/test` names a new one per run),
/// or `leader_test`, created when missing.
pub fn nats_bucket() -> String {
    env_or("NATS_BUCKET", "leader_test")
}

/// `ZOOKEEPER_ENSEMBLE`'s default: the three-server ensemble `scripts/setup` starts on loopback.
pub const DEFAULT_ZOOKEEPER_ENSEMBLE: &str = "127.0.0.1:22181,127.0.0.1:22182,127.0.0.1:22183";

/// The ZooKeeper ensemble the tests use: `ZOOKEEPER_ENSEMBLE` (`host:port` pairs separated by
/// commas), or the loopback ensemble.
pub fn zookeeper_ensemble() -> String {
    env_or("ZOOKEEPER_ENSEMBLE", DEFAULT_ZOOKEEPER_ENSEMBLE)
}

/// The chroot the ZooKeeper tests work under: `ZOOKEEPER_CHROOT` (`scripts/test` names a new
/// one per run), or `/leader-tests`. The tests create it.
pub fn zookeeper_chroot() -> String {
    std::env::var("ZOOKEEPER_CHROOT")
        .ok()
        .filter(|c| c.starts_with('/') && c.len() > 1)
        .unwrap_or_else(|| "/leader-tests".to_owned())
}

/// The Redis the tests use: `REDIS_URL`, or the loopback server.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned())
}

/// The etcd members the tests use: `ETCD_ENDPOINTS` (comma-separated), or the loopback server.
pub fn etcd_endpoints() -> Vec<String> {
    std::env::var("ETCD_ENDPOINTS")
        .unwrap_or_else(|_| DEFAULT_ETCD_ENDPOINTS.to_owned())
        .split(',')
        .map(str::to_owned)
        .collect()
}

/// The etcd key prefix of this test run (`ETCD_PREFIX`), if one is set.
pub fn etcd_prefix() -> Option<String> {
    setting("ETCD_PREFIX")
}

/// The environment variable `name`, when it is set and not empty.
fn setting(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The environment variable `name`, or `default` when it is unset or empty.
fn env_or(name: &str, default: &str) -> String {
    setting(name).unwrap_or_else(|| default.to_owned())
}

/// Whether this runs under CI (`CI` set to anything but empty, `false` or `0`), where a missing
/// server is a failure instead of a reason to skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// The first port of the kernel's ephemeral range (read once), from which outgoing
/// connections take their source port.
fn ephemeral_start() -> u16 {
    static START: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    *START.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
            .unwrap_or(32_768)
    })
}

/// The first port [`free_port`] draws from.
const FIRST_FREE_PORT: u16 = 24_000;

/// A free loopback port: bound, then let go, for a server of a test's own.
///
/// It is drawn below the kernel's ephemeral range and above the fixed ports of
/// `scripts/services.sh`: a server a test stops and starts again must find its port free,
/// and an outgoing connection (which takes its source port from the ephemeral range) made
/// meanwhile by any test could otherwise hold it. The ports are walked from a random place, one
/// after the other, so that calls in a row (an ensemble's nine ports, taken before any server
/// binds one) never get the same port twice, and processes side by side rarely meet. Where the
/// ephemeral range leaves no room, any free port.
///
/// # Panics
/// No port could be bound.
#[must_use]
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let ephemeral = ephemeral_start();
    let bindable = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    if ephemeral > FIRST_FREE_PORT {
        let span = u32::from(ephemeral - FIRST_FREE_PORT);
        // The first call picks where this process starts.
        let _ = NEXT.compare_exchange(
            u32::MAX,
            fastrand::u32(..span),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        for _ in 0..1_000 {
            let offset = NEXT.fetch_add(1, Ordering::Relaxed) % span;
            let port = FIRST_FREE_PORT + u16::try_from(offset).unwrap_or(0);
            if bindable(port) {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// Whether `tool` can be run (`TOOL --version` starts), for a test that starts a server of its
/// own; `false` with a line saying why (a skip), a failure under `CI=true`. `install` says what
/// provides it.
///
/// # Panics
/// Under `CI=true`, when the tool is missing.
#[must_use]
pub fn tool_or_skip(tool: &str, install: &str) -> bool {
    let found = std::process::Command::new(tool)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok();
    if !found {
        assert!(!in_ci(), "CI=true and no {tool} ({install})");
        eprintln!("skipping: no {tool}");
    }
    found
}

/// `S3_ENDPOINT`'s default: moto's S3 server that `scripts/setup` starts on loopback.
pub const DEFAULT_S3_ENDPOINT: &str = "http://127.0.0.1:9000";

/// The S3 API server the tests use: `S3_ENDPOINT`, or the loopback test server.
pub fn s3_endpoint() -> String {
    env_or("S3_ENDPOINT", DEFAULT_S3_ENDPOINT)
}

/// The bucket the tests use: `S3_BUCKET`, or a new bucket made once per test binary on the S3
/// server (moto checks no signature, so an unsigned `CreateBucket` does). Err: the server did
/// not answer, or a loopback server is a plain `moto_server` instead of `scripts/s3-server`
/// (moto alone can let two conditional writes on one ETag both succeed, which would make the
/// lock's tests pass or fail by chance).
pub fn s3_bucket() -> Result<String, String> {
    static BUCKET: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();
    BUCKET
        .get_or_init(|| {
            let endpoint = s3_endpoint();
            if is_loopback(&endpoint) && !s3_server_is_serial(&endpoint)? {
                return Err(format!(
                    "the S3 server at {endpoint} is not scripts/s3-server (a plain moto_server \
                     lets two conditional writes on one ETag both succeed); scripts/setup \
                     replaces it"
                ));
            }
            if let Some(bucket) = setting("S3_BUCKET") {
                return Ok(bucket);
            }
            let bucket = format!("leader-test-{:08x}", fastrand::u32(..));
            create_bucket(&endpoint, &bucket).map(|()| bucket)
        })
        .clone()
}

/// True for an `http://` endpoint on this machine (a test server), false for a cloud's.
fn is_loopback(endpoint: &str) -> bool {
    let authority = endpoint.strip_prefix("http://").unwrap_or_default();
    ["127.0.0.1:", "localhost:", "[::1]:"]
        .iter()
        .any(|host| authority.starts_with(host))
}

/// `host:port` of a URL's first (or only) host, with `default_port` when it names none.
fn host_port(url: &str, default_port: u16) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    let host = hosts.split(',').next().unwrap_or_default();
    if host
        .rsplit_once(':')
        .is_some_and(|(_, port)| port.parse::<u16>().is_ok())
    {
        host.to_owned()
    } else {
        format!("{host}:{default_port}")
    }
}

/// `url` when its server answers a TCP connection (at `default_port` when the URL names
/// none), else `None` with a line saying why (a skip), or a failure under CI, where every
/// service must be there.
pub fn answering(what: &str, url: String, default_port: u16) -> Option<String> {
    let address = host_port(&url, default_port);
    let reached = std::net::ToSocketAddrs::to_socket_addrs(&address)
        .ok()
        .and_then(|mut addrs| addrs.next())
        .is_some_and(|addr| {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok()
        });
    if reached {
        return Some(url);
    }
    assert!(!in_ci(), "CI=true, but no {what} answers at {address}");
    eprintln!("skipping: no {what} answers at {address}; run scripts/test");
    None
}

/// The test Postgres as a lock URL ([`database_url`]), or a skip (a failure under CI).
pub fn postgres_lock_or_skip() -> Option<String> {
    answering("Postgres", database_url(), 5432)
}

/// The test MySQL or MariaDB as a lock URL ([`mysql_url`]), or a skip (a failure under CI).
pub fn mysql_lock_or_skip() -> Option<String> {
    answering("MySQL", mysql_url(), 3306)
}

/// The test NATS server and bucket as a lock URL ([`nats_url`], [`nats_bucket`]), or a skip (a
/// failure under CI).
pub fn nats_lock_or_skip() -> Option<String> {
    answering(
        "NATS",
        format!("{}/{}", nats_url().trim_end_matches('/'), nats_bucket()),
        4222,
    )
}

/// The test ZooKeeper ensemble as a lock URL ([`zookeeper_ensemble`]), its elections under
/// `/e2e` in the run's chroot ([`zookeeper_chroot`]) as a prefix (created when missing; a
/// chroot must exist, and only the ZooKeeper crate's tests make one), or a skip (a failure
/// under CI).
pub fn zookeeper_lock_or_skip() -> Option<String> {
    answering(
        "ZooKeeper",
        format!(
            "zk://{}?prefix={}/e2e",
            zookeeper_ensemble(),
            zookeeper_chroot()
        ),
        2181,
    )
}

/// The test Redis as a lock URL ([`redis_url`]), or a skip (a failure under CI).
pub fn redis_lock_or_skip() -> Option<String> {
    answering("Redis", redis_url(), 6379)
}

/// The test etcd as a lock URL (`etcd://HOSTS/?prefix=`, [`etcd_endpoints`] and
/// [`etcd_prefix`], by default `leader/`), or a skip (a failure under CI).
pub fn etcd_lock_or_skip() -> Option<String> {
    let hosts: Vec<String> = etcd_endpoints()
        .iter()
        .map(|e| e.trim_start_matches("http://").to_owned())
        .collect();
    let prefix = etcd_prefix().unwrap_or_else(|| "leader/".into());
    answering(
        "etcd",
        format!("etcd://{}/?prefix={prefix}", hosts.join(",")),
        2379,
    )
}

/// [`s3_bucket`], or `None` with a line saying why (a skip), or a failure under CI, where the
/// S3 server must be there.
pub fn s3_bucket_or_skip() -> Option<String> {
    match s3_bucket() {
        Ok(bucket) => Some(bucket),
        Err(why) => {
            assert!(!in_ci(), "CI=true, but there is no S3 server: {why}");
            eprintln!("skipping: no S3 server: {why}; run scripts/test");
            None
        }
    }
}

/// The `object_store` options for the test S3 server ([`s3_endpoint`]).
pub fn s3_options() -> Vec<(String, String)> {
    s3_options_at(&s3_endpoint())
}

/// The `object_store` options for a plain-HTTP S3 server at `endpoint`, with the environment's
/// credentials or moto's any-will-do ones.
pub fn s3_options_at(endpoint: &str) -> Vec<(String, String)> {
    vec![
        ("aws_endpoint".to_owned(), endpoint.to_owned()),
        // Spelt as object_store reads it from the environment too (`AWS_ALLOW_HTTP`).
        ("aws_allow_http".to_owned(), "true".to_owned()),
        ("aws_region".to_owned(), env_or("AWS_REGION", "us-east-1")),
        (
            "aws_access_key_id".to_owned(),
            env_or("AWS_ACCESS_KEY_ID", "test"),
        ),
        (
            "aws_secret_access_key".to_owned(),
            env_or("AWS_SECRET_ACCESS_KEY", "test"),
        ),
    ]
}

/// The environment a child process (the `leader` command) needs for a plain-HTTP S3 server at
/// `endpoint`: [`s3_options_at`] as `object_store` reads them from the environment (`AWS_*`).
pub fn s3_env_at(endpoint: &str) -> Vec<(String, String)> {
    s3_options_at(endpoint)
        .into_iter()
        .map(|(key, value)| (key.to_ascii_uppercase(), value))
        .collect()
}

/// `DYNAMODB_ENDPOINT`'s default: moto's server that `scripts/setup` starts for S3, which
/// answers DynamoDB on the same port.
pub const DEFAULT_DYNAMODB_ENDPOINT: &str = "http://127.0.0.1:9000";

/// The DynamoDB endpoint the tests use: `DYNAMODB_ENDPOINT`, or the loopback test server.
pub fn dynamodb_endpoint() -> String {
    env_or("DYNAMODB_ENDPOINT", DEFAULT_DYNAMODB_ENDPOINT)
}

/// The environment a child process (the `leader` command) needs for a plain-HTTP DynamoDB
/// server at `endpoint`, as every AWS SDK reads it: `AWS_ENDPOINT_URL_DYNAMODB`, and the
/// environment's region and credentials or moto's any-will-do ones.
pub fn dynamodb_env_at(endpoint: &str) -> Vec<(String, String)> {
    let env = |name: &str, default: &str| (name.to_owned(), env_or(name, default));
    vec![
        ("AWS_ENDPOINT_URL_DYNAMODB".to_owned(), endpoint.to_owned()),
        env("AWS_REGION", "us-east-1"),
        env("AWS_ACCESS_KEY_ID", "test"),
        env("AWS_SECRET_ACCESS_KEY", "test"),
    ]
}

/// [`dynamodb_env_at`] the test server ([`dynamodb_endpoint`]).
pub fn dynamodb_env() -> Vec<(String, String)> {
    dynamodb_env_at(&dynamodb_endpoint())
}

/// A `dynamodb://` lock URL on a new table of the test server named after `what`, which the
/// lock creates (`create_table=true`), or a skip (a failure under CI) when the server does not
/// answer. Its processes need [`dynamodb_env`].
pub fn dynamodb_lock_or_skip(what: &str) -> Option<String> {
    let endpoint = dynamodb_endpoint();
    answering("DynamoDB", endpoint, 80)?;
    Some(format!(
        "dynamodb://leader-{what}-{:08x}?create_table=true",
        fastrand::u32(..)
    ))
}

/// Creates `bucket` with an unsigned `PUT /BUCKET` on a plain-HTTP S3 server (`endpoint`).
pub fn create_bucket(endpoint: &str, bucket: &str) -> Result<(), String> {
    let answer = raw_request(endpoint, "PUT", &format!("/{bucket}"))?;
    match answer.split_whitespace().nth(1) {
        Some("200") => Ok(()),
        _ => Err(format!(
            "the S3 server at {endpoint} did not create bucket {bucket}: {}",
            answer.lines().next().unwrap_or_default()
        )),
    }
}

/// Creates bucket `bucket` with versioning on, on the plain-HTTP S3 server at `endpoint`.
///
/// # Errors
/// The server cannot be reached, or refused either request.
pub fn create_versioned_bucket(endpoint: &str, bucket: &str) -> Result<(), String> {
    create_bucket(endpoint, bucket)?;
    let answer = raw_request_with(
        endpoint,
        "PUT",
        &format!("/{bucket}?versioning"),
        "<VersioningConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
         <Status>Enabled</Status></VersioningConfiguration>",
    )?;
    match answer.split_whitespace().nth(1) {
        Some("200") => Ok(()),
        _ => Err(format!(
            "the S3 server at {endpoint} did not turn on versioning for {bucket}: {}",
            answer.lines().next().unwrap_or_default()
        )),
    }
}

/// True when the plain-HTTP S3 server at `endpoint` is `scripts/s3-server`, which answers one
/// request at a time and says so in the header `x-leader-s3-server: serial`.
pub fn s3_server_is_serial(endpoint: &str) -> Result<bool, String> {
    let answer = raw_request(endpoint, "HEAD", "/")?;
    let head = answer.split("\r\n\r\n").next().unwrap_or_default();
    Ok(head.lines().any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("x-leader-s3-server") && value.trim() == "serial"
        })
    }))
}

/// One unsigned request without a body to a plain-HTTP server; its whole answer.
fn raw_request(endpoint: &str, method: &str, path: &str) -> Result<String, String> {
    raw_request_with(endpoint, method, path, "")
}

/// One unsigned request with `body` to a plain-HTTP server; its whole answer.
fn raw_request_with(
    endpoint: &str,
    method: &str,
    path: &str,
    body: &str,
) -> Result<String, String> {
    use std::io::{Read, Write};
    let authority = endpoint
        .strip_prefix("http://")
        .ok_or_else(|| format!("{endpoint}: only plain http:// test servers can be set up"))?
        .trim_end_matches('/');
    let failed = |err: std::io::Error| format!("the S3 server at {endpoint}: {err}");
    let mut stream = std::net::TcpStream::connect(authority).map_err(failed)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(failed)?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(failed)?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(failed)?;
    Ok(answer)
}

/// Skips the test (returns from it) with a line saying why, or fails it under CI, where every
/// service must be there.
#[macro_export]
macro_rules! skip_or_fail {
    ($($why:tt)+) => {{
        let why = format!($($why)+);
        assert!(!$crate::in_ci(), "CI=true, but {why}");
        eprintln!("skipping: {why}");
        return;
    }};
}

pub use leader_core::background::{
    Candidate, LEASE, RENEW, RETRY, STEADY_RENEW, assert_outage_handled, next_leader,
};

/// libfaketime's library, which steps the wall clock of a process it is preloaded into
/// (Debian package `faketime`; `scripts/setup` installs it), or `None` with a line saying why
/// (a skip), or a failure under CI.
pub fn faketime_or_skip() -> Option<std::path::PathBuf> {
    let found = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|dir| dir.path().join("faketime/libfaketime.so.1"))
        .chain([std::path::PathBuf::from(
            "/usr/lib/faketime/libfaketime.so.1",
        )])
        .find(|path| path.is_file());
    if found.is_none() {
        assert!(!in_ci(), "CI=true, but libfaketime is not installed");
        eprintln!("skipping: libfaketime is not installed; run scripts/setup");
    }
    found
}

/// The environment that preloads libfaketime (`library`) into a process, with its wall clock
/// offset by what `offset_file` holds (`+0`, `-1h`, `+1h`), read again at every call; its
/// monotonic clock stays the system's.
pub fn faketime_env(
    library: &std::path::Path,
    offset_file: &std::path::Path,
) -> [(&'static str, std::ffi::OsString); 4] {
    [
        ("LD_PRELOAD", library.as_os_str().to_owned()),
        (
            "FAKETIME_TIMESTAMP_FILE",
            offset_file.as_os_str().to_owned(),
        ),
        ("FAKETIME_NO_CACHE", "1".into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()),
    ]
}

/// A [`Candidate`] on `lock`, started and waited for until it leads (within 10 s): the
/// candidate and its fencing token.
pub async fn started_leading(lock: impl leader_core::ResourceLock + 'static) -> (Candidate, u64) {
    let mut candidate = Candidate::start(lock);
    let token = candidate.wait_leading(Duration::from_secs(10)).await;
    (candidate, token)
}

/// Panics unless `answer`, to a request sent while the server is down, is an outage:
/// [`leader_core::LockError::Unavailable`] or [`leader_core::LockError::Timeout`].
pub fn assert_server_down<T: std::fmt::Debug>(answer: Result<T, leader_core::LockError>) {
    let err = answer.expect_err("server is down");
    assert!(
        matches!(
            err,
            leader_core::LockError::Unavailable { .. } | leader_core::LockError::Timeout { .. }
        ),
        "{err:?}"
    );
}

/// Panics unless `answer` is an outage ([`leader_core::LockError::Unavailable`]) whose message
/// says each of `words`.
pub fn assert_unavailable_saying<T: std::fmt::Debug>(
    answer: Result<T, leader_core::LockError>,
    words: &[&str],
) {
    assert_failed_saying(answer, "unavailable", words);
}

/// Panics unless `answer` is a refusal ([`leader_core::LockError::Forbidden`]) whose message
/// says each of `words`.
pub fn assert_forbidden_saying<T: std::fmt::Debug>(
    answer: Result<T, leader_core::LockError>,
    words: &[&str],
) {
    assert_failed_saying(answer, "forbidden", words);
}

/// Panics unless `answer` is a misconfiguration ([`leader_core::LockError::Misconfigured`])
/// whose message says each of `words`.
pub fn assert_misconfigured_saying<T: std::fmt::Debug>(
    answer: Result<T, leader_core::LockError>,
    words: &[&str],
) {
    assert_failed_saying(answer, "misconfigured", words);
}

/// Panics unless `answer` failed with an error of `kind` ([`leader_core::LockError::kind`])
/// whose message says each of `words`.
fn assert_failed_saying<T: std::fmt::Debug>(
    answer: Result<T, leader_core::LockError>,
    kind: &str,
    words: &[&str],
) {
    let err = answer.expect_err(kind);
    assert_eq!(err.kind(), kind, "{err:?}");
    let message = err.to_string();
    for word in words {
        assert!(message.contains(word), "{word:?} is not in: {message}");
    }
}

/// The record `answer` took the lease with; panics unless it did
/// ([`leader_core::Acquisition::Acquired`]).
pub fn assert_acquired(
    answer: Result<Option<leader_core::Acquisition>, leader_core::LockError>,
) -> leader_core::Observed {
    match answer.expect("acquired") {
        Some(leader_core::Acquisition::Acquired(taken)) => taken,
        other => panic!("not acquired: {other:?}"),
    }
}

/// Two candidates of one election: `first` started and waited for until it leads (within
/// 10 s), then `second`. The leader, its fencing token, its term's cancellation, and the
/// follower.
pub async fn leader_and_follower(
    first: impl leader_core::ResourceLock + 'static,
    second: impl leader_core::ResourceLock + 'static,
) -> (Candidate, u64, leader_core::CancellationToken, Candidate) {
    let (leader, token) = started_leading(first).await;
    let term = leader.term().expect("leading");
    (leader, token, term, Candidate::start(second))
}

/// Ends the session `leader` holds its lease on (`kill`, as the server would) while it leads
/// with fencing token `token`: panics unless it steps down within `step_down`, and `follower`
/// then leads with a larger token within `take_over` while it does not. Stops both, and
/// returns how long after the kill the leader stepped down and the follower led.
pub async fn assert_taken_over_once_killed(
    mut leader: Candidate,
    token: u64,
    mut follower: Candidate,
    kill: impl Future<Output = ()>,
    step_down: Duration,
    take_over: Duration,
) -> (Duration, Duration) {
    let killed = tokio::time::Instant::now();
    kill.await;
    tokio::time::timeout(step_down, leader.state.wait_for(|s| !s.is_leading()))
        .await
        .expect("the leader steps down by its renew deadline")
        .expect("alive");
    let stepped_down = killed.elapsed();
    let next = follower.wait_leading(take_over).await;
    assert!(next > token, "fencing token {token} then {next}");
    assert!(leader.leading_token().is_none(), "both lead");
    let taken_over = killed.elapsed();
    follower.stop().await;
    leader.stop().await;
    (stepped_down, taken_over)
}

/// S15 at a term's start: `leader` leads on a lock that `follower` waits on, and `change` makes
/// the store's settings ones the lock refuses. Once no check that passed before the change
/// stands (however late the follower's own check at its start ran), `leader` stops, and this
/// panics unless `follower`'s next term was refused at its start and released: it never leads,
/// and the record `lock` (on the same election) reads is free.
pub async fn assert_next_term_refused_and_released(
    leader: Candidate,
    follower: Candidate,
    change: impl Future<Output = ()>,
    lock: impl leader_core::ResourceLock,
) {
    change.await;
    // Past the second that a check that passed before the change stands for.
    tokio::time::sleep(leader_core::backend::SettingsCheck::STANDS_FOR * 2).await;
    leader.stop().await;
    tokio::time::sleep(LEASE + RETRY * 4).await;
    assert_eq!(
        follower.leading_token(),
        None,
        "a term started on settings the lock refuses"
    );
    let record = lock.get().await.expect("get").expect("the record");
    assert!(
        record.record.is_free(),
        "the refused term was released: {record:?}"
    );
    follower.stop().await;
}

/// `prefix` and eight random hex digits: a name no other test run uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", fastrand::u32(..))
}

/// What connecting to the test server gave: the connection, or `None` with a line saying why
/// (a skip), or a failure under CI. `what` names the server, `at` where it was looked for (with
/// no password), and `variable` the environment variable that says where it is.
pub fn connected_or_skip<T, E: std::fmt::Display>(
    connected: Result<T, E>,
    what: &str,
    at: &str,
    variable: &str,
) -> Option<T> {
    match connected {
        Ok(connection) => Some(connection),
        Err(err) => {
            assert!(!in_ci(), "CI=true and no {what} at {at}: {err}");
            eprintln!("skipping: no {what} at {at} ({err}); set {variable} or run scripts/test");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_free_port_is_outside_the_ephemeral_range_free_and_never_given_twice() {
        let low = super::ephemeral_start();
        let mut given = std::collections::HashSet::new();
        for _ in 0..50 {
            let port = super::free_port();
            if low > super::FIRST_FREE_PORT {
                assert!(
                    (super::FIRST_FREE_PORT..low).contains(&port),
                    "port {port}, ephemeral from {low}"
                );
            }
            assert!(given.insert(port), "port {port} given twice");
            std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        }
    }
}
