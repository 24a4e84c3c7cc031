//! Workspace-level end-to-end and fault tests live in `tests/`; this library holds the fault
//! harness they share with the long fault run.

pub mod harness;

/// A test of `scenario` per backend, named for both, each given its lock URL by an expression
/// that is `None` (a skip, or a failure under CI) without the backend's server: a `String`, or
/// a [`FileLock`]. Attributes (doc comments) written before a test's name are kept on it.
#[macro_export]
macro_rules! on_each_backend {
    ($scenario:ident: $($(#[$attr:meta])* $test:ident => $url:expr,)+) => {
        $(
            $(#[$attr])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let Some(url) = $url else {
                    return;
                };
                $scenario(&url).await;
            }
        )+
    };
}

/// A `file://` lock in a temporary directory of its own, removed when dropped; it reads as
/// its URL.
#[derive(Debug)]
pub struct FileLock {
    url: String,
    _dir: tempfile::TempDir,
}

impl FileLock {
    /// A lock file in a new temporary directory.
    ///
    /// # Panics
    /// When no temporary directory can be made.
    #[must_use]
    pub fn in_temp_dir() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self {
            url: file_lock_in(dir.path()),
            _dir: dir,
        }
    }
}

/// The URL of a `file://` lock in `dir`, beside whatever else a test keeps there.
#[must_use]
pub fn file_lock_in(dir: &std::path::Path) -> String {
    format!("file://{}", dir.join("lock").display())
}

impl std::ops::Deref for FileLock {
    type Target = str;

    fn deref(&self) -> &str {
        &self.url
    }
}

/// `leader SUBCOMMAND` (`run`, `cron`) of election `name` on `lock` as `identity`, run from
/// `binary` (a test's `leader-e2e`), its stdout dropped, killed when dropped: timings,
/// COMMAND and the rest are the caller's to add.
pub fn candidate_command(
    binary: impl AsRef<std::ffi::OsStr>,
    subcommand: &str,
    lock: &str,
    name: &str,
    identity: &str,
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(binary);
    command
        .args([subcommand, "--lock", lock, "--name", name])
        .args(["--identity", identity])
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true);
    command
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process on the machine, so times logged
/// by different processes compare exactly.
#[must_use]
pub fn now_ns() -> i128 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec())
    })
}

/// Whether a firing's first attempt fails on purpose in the schedule workload: a scheduled
/// instant (a whole second) that is a multiple of `every` seconds. The fenced writer fails
/// those, and the checker expects their retries.
#[must_use]
pub fn firing_fails(
    scheduled: chrono::DateTime<chrono::Utc>,
    first_attempt: bool,
    every: i64,
) -> bool {
    first_attempt
        && every > 0
        && scheduled.timestamp_subsec_nanos() == 0
        && scheduled.timestamp() % every == 0
}

/// Appends `EVENT IDENTITY TOKEN NANOS PID` to the file in `JOB_LOG` (if set), with this
/// process's `LEADER_IDENTITY` and `LEADER_FENCING_TOKEN` and [`now_ns`]: how the COMMANDs of
/// the end-to-end tests report the start and end of their term.
pub fn log_term_event(event: &str) {
    let identity = std::env::var("LEADER_IDENTITY").unwrap_or_default();
    let token = std::env::var("LEADER_FENCING_TOKEN").unwrap_or_default();
    log_term_event_as(event, &identity, &token);
}

/// [`log_term_event`] for a process that knows its identity and token itself. The COMMAND of a
/// shard (`LEADER_SHARD`) writes to `JOB_LOG.SHARD`.
pub fn log_term_event_as(event: &str, identity: &str, token: &str) {
    use std::io::Write;
    let shard = std::env::var("LEADER_SHARD").ok();
    if let Ok(path) = std::env::var("JOB_LOG")
        && let path = shard.map_or_else(|| path.clone(), |shard| format!("{path}.{shard}"))
        && let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    {
        let line = format!(
            "{event} {identity} {token} {} {}\n",
            now_ns(),
            std::process::id()
        );
        // One write per line: lines from different processes never interleave.
        let _ = file.write_all(line.as_bytes());
    }
}

/// One line of a `JOB_LOG`, as [`log_term_event`] writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TermEvent {
    /// `start` (true) or `stop`.
    pub start: bool,
    /// The COMMAND's `LEADER_IDENTITY`.
    pub identity: String,
    /// Its `LEADER_FENCING_TOKEN`.
    pub token: u64,
    /// [`now_ns`] when it was written.
    pub at: i128,
    /// The COMMAND's process id.
    pub pid: Option<i32>,
}

/// Every complete line of the `JOB_LOG` at `path`, in order (none if it does not exist yet).
#[must_use]
pub fn term_events(path: &std::path::Path) -> Vec<TermEvent> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(TermEvent::parse)
        .collect()
}

/// Waits up to `within` until the `JOB_LOG` at `path` holds `n` starts; returns start number `n`.
///
/// # Panics
/// When the log holds fewer starts by then.
pub async fn nth_start(path: &std::path::Path, n: usize, within: std::time::Duration) -> TermEvent {
    tokio::time::timeout(within, async {
        loop {
            let starts: Vec<TermEvent> =
                term_events(path).into_iter().filter(|e| e.start).collect();
            if starts.len() >= n {
                return starts[n - 1].clone();
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "no job start number {n} within {within:?}: {:?}",
            term_events(path)
        )
    })
}

impl TermEvent {
    /// One line of the log (`start|stop IDENTITY TOKEN AT [PID]`), `None` when it is not one.
    #[must_use]
    pub fn parse(line: &str) -> Option<Self> {
        let parts: Vec<&str> = line.split(' ').collect();
        Some(Self {
            start: *parts.first()? == "start",
            identity: (*parts.get(1)?).to_owned(),
            token: parts.get(2)?.parse().ok()?,
            at: parts.get(3)?.parse().ok()?,
            pid: parts.get(4).and_then(|p| p.parse().ok()),
        })
    }
}

/// The Postgres of `DATABASE_URL` (default: loopback), where the fenced sink lives.
pub use leader_test_support::database_url;

/// The test Kubernetes API server as a process, for end-to-end tests with real `leader`
/// processes.
#[derive(Debug)]
pub struct KubeApiProcess {
    /// The process (killed when dropped).
    pub child: tokio::process::Child,
    /// Its URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// A kubeconfig for it, for `KUBECONFIG`.
    pub kubeconfig: std::path::PathBuf,
}

impl KubeApiProcess {
    /// Starts `binary` (a test's `CARGO_BIN_EXE_kube-api-e2e`) with `args`, its kubeconfig
    /// written into `dir`, and waits until it listens.
    ///
    /// # Panics
    /// When it cannot be started or does not listen within 10 s.
    pub async fn start(binary: &str, dir: &std::path::Path, args: &[&str]) -> Self {
        use tokio::io::AsyncReadExt;
        let kubeconfig = dir.join("kubeconfig");
        let mut child = tokio::process::Command::new(binary)
            .args(args)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the API server");
        let mut stdout = child.stdout.take().expect("stdout");
        let url = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            let mut out = String::new();
            let mut buffer = [0; 256];
            while !out.contains('\n') {
                let read = stdout.read(&mut buffer).await.expect("read");
                assert!(read > 0, "the API server exited: {out}");
                out.push_str(&String::from_utf8_lossy(&buffer[..read]));
            }
            out.trim().trim_start_matches("listening on ").to_owned()
        })
        .await
        .expect("the API server starts");
        Self {
            child,
            url,
            kubeconfig,
        }
    }

    /// The `KUBECONFIG` environment entry for it.
    #[must_use]
    pub fn env(&self) -> (String, String) {
        (
            "KUBECONFIG".to_owned(),
            self.kubeconfig.display().to_string(),
        )
    }
}
