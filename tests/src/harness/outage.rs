//! An outage seen by a waiting follower: two `leader run` replicas on one backend, the holder
//! killed while the follower's store is down (its proxy closes every connection) or its record
//! unreadable (the file lock), for a while; then the store is back. Counts the follower's failed
//! attempts from its own metrics (`leader_election_errors_total{operation="acquire"}`) and times
//! how long it takes to lead once the store is back (S9).

use std::path::Path;
use std::time::Duration;

use tokio::process::Child;
use tokio::time::{Instant, sleep};

use super::Programs;
use super::campaign::{Backend, HarnessError, Settings, Stage, stage};
use super::proxy::{Mode, Proxy};
use super::servers::PrivateServer;

/// Timings of the two replicas.
#[derive(Clone, Copy, Debug)]
pub struct Timings {
    /// `--lease-duration`.
    pub lease: Duration,
    /// `--renew-deadline`.
    pub renew: Duration,
    /// `--retry-period`.
    pub retry: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(3),
            renew: Duration::from_secs(2),
            retry: Duration::from_millis(300),
        }
    }
}

/// What the follower did.
#[derive(Clone, Debug)]
pub struct OutageReport {
    /// The backend.
    pub backend: Backend,
    /// How long the store was down (or the record unreadable).
    pub outage: Duration,
    /// Failed attempts per second in consecutive windows of the outage.
    pub rates: Vec<(Duration, f64)>,
    /// Failed attempts over the whole outage.
    pub failures: u64,
    /// From the store's return to the follower leading.
    pub recovery: Option<Duration>,
    /// Lines the follower logged during the outage, with its default log filter.
    pub log_lines: usize,
    /// Those lines.
    pub logged: Vec<String>,
}

impl OutageReport {
    /// Failed attempts a second over the whole outage.
    #[must_use]
    pub fn rate(&self) -> f64 {
        self.failures as f64 / self.outage.as_secs_f64()
    }
}

/// The metrics page at `addr`, or an empty one while it does not answer.
async fn scrape(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut page = String::new();
    if stream.write_all(request.as_bytes()).await.is_ok() {
        let _ = stream.read_to_string(&mut page).await;
    }
    page
}

/// The failed attempts to acquire election `name` that the `leader` serving metrics at `addr`
/// counted (`leader_election_errors_total{operation="acquire"}`); `None` while it does not
/// answer.
pub(crate) async fn failed_attempts(addr: &str, name: &str) -> Option<u64> {
    let page = scrape(addr).await;
    if page.is_empty() {
        return None;
    }
    let election = format!(r#"name="{name}""#);
    Some(
        page.lines()
            .filter(|l| {
                l.starts_with("leader_election_errors_total")
                    && l.contains(r#"operation="acquire""#)
                    && l.contains(&election)
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64,
    )
}

struct Replica {
    child: Child,
    metrics: String,
    /// Where its standard error goes.
    log: std::path::PathBuf,
}

impl Replica {
    fn spawn(
        leader: &Path,
        (lock, env): &(String, Vec<(String, String)>),
        identity: &str,
        timings: Timings,
        dir: &Path,
    ) -> Result<Self, HarnessError> {
        let metrics = format!("127.0.0.1:{}", leader_test_support::free_port());
        let log = dir.join(format!("{identity}.log"));
        let stderr = std::fs::File::create(&log).map_err(|source| HarnessError::Io {
            what: format!("creating {}", log.display()),
            source,
        })?;
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let mut command = crate::candidate_command(leader, "run", lock, "outage", identity);
        command
            .args(["--lease-duration", &ms(timings.lease)])
            .args(["--renew-deadline", &ms(timings.renew)])
            .args(["--retry-period", &ms(timings.retry)])
            .args(["--metrics-addr", &metrics])
            .args(["--", "sleep", "3600"])
            .stderr(stderr);
        // Its own default filter, unless asked otherwise: the log during an outage is measured.
        match std::env::var("OUTAGE_LOG") {
            Ok(filter) => command.env("RUST_LOG", filter),
            Err(_) => command.env_remove("RUST_LOG"),
        };
        command.envs(env.iter().cloned());
        let child = command.spawn().map_err(|source| HarnessError::Io {
            what: format!("spawning {}", leader.display()),
            source,
        })?;
        Ok(Self {
            child,
            metrics,
            log,
        })
    }

    /// Its log so far, by line.
    fn log(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .map(|text| text.lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    async fn leads(&self) -> bool {
        scrape(&self.metrics)
            .await
            .contains(r#"leader_election_master_status{name="outage"} 1"#)
    }

    async fn failed_attempts(&self) -> u64 {
        failed_attempts(&self.metrics, "outage")
            .await
            .unwrap_or_default()
    }

    async fn wait_leading(&self, within: Duration) -> Option<Duration> {
        let started = Instant::now();
        while started.elapsed() < within {
            if self.leads().await {
                return Some(started.elapsed());
            }
            sleep(Duration::from_millis(10)).await;
        }
        None
    }
}

/// Runs one outage of `outage` on `backend`, sampling the follower's failures every `window`.
///
/// # Errors
/// A private server, a proxy or a replica could not be started.
pub async fn measure(
    backend: Backend,
    programs: &Programs,
    timings: Timings,
    outage: Duration,
    window: Duration,
) -> Result<OutageReport, HarnessError> {
    // One proxy, for the follower, when the backend has a server of its own.
    let Stage {
        dir,
        server,
        mut proxies,
    } = stage(backend, programs, 1).await?;
    let proxy = proxies.pop();
    // The election's own directory under the file URL's (one per election name).
    let lock_dir = dir.path().join("lock").join("outage");
    let settings = Settings {
        lease: timings.lease,
        renew: timings.renew,
        retry: timings.retry,
        ..Settings::default()
    };
    let lock = |port: u16| backend.replica_lock(dir.path(), port, &settings);
    let direct = server.as_ref().map_or(0, PrivateServer::port);
    let proxied = proxy.as_ref().map_or(0, Proxy::port);
    let leader = &programs.leader;
    let mut holder = Replica::spawn(leader, &lock(direct)?, "holder", timings, dir.path())?;
    let setup = Duration::from_secs(20);
    let _ = holder.wait_leading(setup).await;
    let follower = Replica::spawn(leader, &lock(proxied)?, "follower", timings, dir.path())?;
    // The follower reads the holder's record and waits.
    sleep(timings.retry * 4).await;

    match &proxy {
        Some(proxy) => proxy.set(Mode::Down),
        None => corrupt_newest(&lock_dir)?,
    }
    let _ = holder.child.kill().await;
    let began = Instant::now();
    let lines_before = follower.log().len();
    let first = follower.failed_attempts().await;
    let mut rates = Vec::new();
    let mut last = first;
    while began.elapsed() + window <= outage {
        sleep(window).await;
        let now = follower.failed_attempts().await;
        rates.push((began.elapsed(), (now - last) as f64 / window.as_secs_f64()));
        last = now;
    }
    sleep(outage.saturating_sub(began.elapsed())).await;
    let failures = follower.failed_attempts().await - first;
    let logged: Vec<String> = follower.log().split_off(lines_before);
    let log_lines = logged.len();
    let outage = began.elapsed();

    match &proxy {
        Some(proxy) => proxy.set(Mode::Open),
        None => remove_garbage(&lock_dir)?,
    }
    let recovery = follower.wait_leading(timings.lease * 4).await;
    drop(follower);
    drop(server);
    Ok(OutageReport {
        backend,
        outage,
        rates,
        failures,
        recovery,
        log_lines,
        logged,
    })
}

const GARBAGE: &str = "v09999999999999999999.json";

/// Makes the file lock's record unreadable: a newest version that is not a record.
fn corrupt_newest(dir: &Path) -> Result<(), HarnessError> {
    std::fs::write(dir.join(GARBAGE), b"{not a record").map_err(|source| HarnessError::Io {
        what: "corrupting the record".into(),
        source,
    })
}

fn remove_garbage(dir: &Path) -> Result<(), HarnessError> {
    std::fs::remove_file(dir.join(GARBAGE)).map_err(|source| HarnessError::Io {
        what: "removing the corrupt record".into(),
        source,
    })
}

/// A Markdown table of reports.
#[must_use]
pub fn table(reports: &[OutageReport], timings: Timings) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "| backend | outage | failed attempts | per second, overall | per second, first 5 s | per second, last 10 s | leader after the store is back | log lines |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        let window = |from: f64, to: f64| {
            let rates: Vec<f64> = r
                .rates
                .iter()
                .filter(|(at, _)| at.as_secs_f64() > from && at.as_secs_f64() <= to)
                .map(|(_, rate)| *rate)
                .collect();
            if rates.is_empty() {
                "n/a".to_owned()
            } else {
                format!("{:.2}", rates.iter().sum::<f64>() / rates.len() as f64)
            }
        };
        let secs = r.outage.as_secs_f64();
        let _ = writeln!(
            out,
            "| {} | {:.0} s | {} | {:.2} | {} | {} | {} | {} |",
            r.backend.name(),
            secs,
            r.failures,
            r.rate(),
            window(0.0, 5.0),
            window(secs - 10.0, secs),
            r.recovery
                .map_or("none".to_owned(), |d| format!("{} ms", d.as_millis())),
            r.log_lines,
        );
    }
    let _ = writeln!(
        out,
        "\nlease {:?}, renew deadline {:?}, retry period {:?}: the bound is 1 / retry period = {:.2} a second, falling with back-off.",
        timings.lease,
        timings.renew,
        timings.retry,
        1.0 / timings.retry.as_secs_f64()
    );
    out
}
