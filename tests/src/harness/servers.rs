//! Backend servers of the harness's own, on loopback ports nobody else uses, so that a fault test
//! can kill one and start it again without touching the servers the other tests share. Each
//! keeps its data across restarts, as a production server would.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use leader_test_support::zookeeper_ensemble;

/// moto's S3 server as the tests run it (see [`ServerKind::S3`]).
const S3_SERVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/s3-server");

/// Which server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerKind {
    /// PostgreSQL from Debian's packages (`/usr/lib/postgresql/*/bin`), started with `pg_ctl`,
    /// every commit durable as by default (`fsync`, `synchronous_commit`): the locks refuse a
    /// server a crash can undo commits on.
    Postgres,
    /// `redis-server` with the append-only file synced on every write (`appendfsync always`), the
    /// set-up `leader-redis` documents for fencing tokens that survive a restart.
    Redis,
    /// MariaDB from Debian's packages (`mariadbd`), a data directory of its own made by
    /// `mariadb-install-db`, every write durable as by default (`innodb_flush_log_at_trx_commit=1`),
    /// no grant checks (any user, any password), and a database `leader`.
    Mysql,
    /// `nats-server` from Debian's packages with JetStream, its store in a directory of its own
    /// (kept across restarts: a SIGKILL loses nothing the kernel has).
    Nats,
    /// A single-member `etcd` cluster.
    Etcd,
    /// A standalone ZooKeeper server from Debian's `zookeeperd` (3.8) with its defaults
    /// (`tickTime` 2000 ms, sessions of 4 to 40 s), its snapshots and transaction log in a
    /// directory of its own: a restart keeps the znodes and the sessions.
    ZooKeeper,
    /// The test Kubernetes API server (`kube-api-server` of `leader-test-support`), keeping its
    /// Leases in a state file across restarts as a real one keeps them in etcd.
    Kube,
    /// The test Consul server (`consul-api-server` of `leader-test-support`), keeping its KV
    /// entries and sessions in a state file across restarts as Consul keeps them in its raft
    /// log.
    Consul,
    /// moto's S3 API server, one request at a time (`scripts/s3-server`; `scripts/setup`
    /// installs moto from PyPI), with the bucket
    /// [`FAULT_BUCKET`](super::campaign::FAULT_BUCKET); it answers DynamoDB on the same port.
    /// It keeps its objects and tables in memory: a restart loses them, so the campaign does
    /// not restart it.
    S3,
}

/// A private server: started by [`PrivateServer::start`], crashed by [`PrivateServer::kill`],
/// started again on the same port and data by [`PrivateServer::restart`]; killed and its data
/// removed when dropped.
#[derive(Debug)]
pub struct PrivateServer {
    kind: ServerKind,
    /// The server's program, where it is one of ours (`kube-api-server`, `consul-api-server`).
    program: Option<PathBuf>,
    port: u16,
    peer_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// Why a private server could not be had.
#[derive(Debug, thiserror::Error)]
#[error("private {kind:?} server: {message}")]
pub struct ServerError {
    kind: ServerKind,
    message: String,
}

fn postgres_bin(tool: &str) -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin").join(tool)))
        .filter(|p| p.exists())
        .collect();
    versions.sort();
    versions.pop()
}

fn running_as_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Postgres refuses to run as root: as root, its tools run as the `postgres` user.
fn postgres_command(tool: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(tool);
        command
    } else {
        Command::new(tool)
    }
}

/// Runs `command` to its end: what went wrong otherwise (it could not run, or it failed, with
/// what it wrote to stderr), after `what`.
fn run_to_end(command: &mut Command, what: &str) -> Result<(), String> {
    let output = command.output().map_err(|e| format!("{what}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what}: {}",
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

impl PrivateServer {
    /// Starts a fresh server of `kind` on an ephemeral loopback port; `program` is the
    /// `kube-api-server` binary for [`ServerKind::Kube`], `consul-api-server` for
    /// [`ServerKind::Consul`].
    ///
    /// # Errors
    /// Its binaries are missing or it does not come up.
    pub fn start(kind: ServerKind, program: Option<&Path>) -> Result<Self, ServerError> {
        let fail = |message: String| ServerError { kind, message };
        let dir = std::env::temp_dir().join(format!(
            "leader-fault-{}-{:08x}",
            format!("{kind:?}").to_lowercase(),
            fastrand::u32(..)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
        let mut server = Self {
            kind,
            program: program.map(Path::to_owned),
            port: leader_test_support::free_port(),
            peer_port: leader_test_support::free_port(),
            dir,
            child: None,
        };
        if kind == ServerKind::Postgres {
            let initdb = postgres_bin("initdb")
                .ok_or_else(|| fail("no initdb under /usr/lib/postgresql".into()))?;
            if running_as_root() {
                let chown = Command::new("chown")
                    .arg("postgres:")
                    .arg(&server.dir)
                    .status()
                    .map_err(|e| fail(format!("chown: {e}")))?;
                if !chown.success() {
                    return Err(fail("chown postgres: failed".into()));
                }
            }
            run_to_end(
                postgres_command(&initdb)
                    .arg("-D")
                    .arg(server.dir.join("data"))
                    .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"]),
                "initdb",
            )
            .map_err(fail)?;
        }
        if kind == ServerKind::Mysql {
            let mut install = Command::new("mariadb-install-db");
            // Its own temporary directory: two installs at once collide in a shared one.
            install
                .arg("--no-defaults")
                .arg(format!("--datadir={}", server.dir.join("data").display()))
                .arg(format!("--tmpdir={}", server.dir.display()))
                .env("TMPDIR", &server.dir)
                .args(["--skip-test-db", "--auth-root-authentication-method=normal"]);
            if running_as_root() {
                install.arg("--user=root");
            }
            run_to_end(&mut install, "mariadb-install-db").map_err(fail)?;
        }
        server.restart()?;
        if kind == ServerKind::Mysql {
            run_to_end(
                Command::new("mariadb")
                    .args([
                        "-h",
                        "127.0.0.1",
                        "-P",
                        &server.port.to_string(),
                        "-u",
                        "root",
                    ])
                    .args(["-e", "CREATE DATABASE IF NOT EXISTS leader"]),
                "creating the database",
            )
            .map_err(fail)?;
        }
        Ok(server)
    }

    /// The port it listens on, on 127.0.0.1.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Crashes the server: SIGKILL (Redis, etcd, the Kubernetes and Consul test servers) or an immediate
    /// shutdown, which is Postgres's crash (every backend killed, recovery from the WAL at the
    /// next start).
    pub fn kill(&mut self) {
        if self.kind == ServerKind::Postgres {
            if let Some(pg_ctl) = postgres_bin("pg_ctl") {
                let _ = postgres_command(&pg_ctl)
                    .arg("-D")
                    .arg(self.dir.join("data"))
                    .args(["-m", "immediate", "-w", "stop"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        } else if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server (again) on the same port and data, and waits until it accepts
    /// connections.
    ///
    /// # Errors
    /// It does not start.
    pub fn restart(&mut self) -> Result<(), ServerError> {
        let fail = |message: String| ServerError {
            kind: self.kind,
            message,
        };
        let endpoint = format!("http://127.0.0.1:{}", self.port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        match self.kind {
            ServerKind::Postgres => {
                let pg_ctl = postgres_bin("pg_ctl").ok_or_else(|| fail("no pg_ctl".to_owned()))?;
                let options = format!(
                    "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=200",
                    self.port,
                    self.dir.display()
                );
                let output = postgres_command(&pg_ctl)
                    .arg("-D")
                    .arg(self.dir.join("data"))
                    .arg("-l")
                    .arg(self.dir.join("log"))
                    .args(["-o", &options, "-w", "start"])
                    .stdout(Stdio::null())
                    .output()
                    .map_err(|e| fail(format!("pg_ctl: {e}")))?;
                if !output.status.success() {
                    let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
                    return Err(fail(format!("pg_ctl start failed: {log}")));
                }
            }
            ServerKind::Redis => {
                let mut command = Command::new("redis-server");
                command
                    .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                    .arg("--dir")
                    .arg(&self.dir)
                    .args([
                        "--appendonly",
                        "yes",
                        "--appendfsync",
                        "always",
                        "--save",
                        "",
                    ])
                    .args(["--protected-mode", "no", "--daemonize", "no"]);
                self.child = Some(spawn_quiet(&mut command, "redis-server").map_err(fail)?);
            }
            ServerKind::Mysql => {
                let mut command = Command::new("mariadbd");
                command
                    .arg("--no-defaults")
                    .arg(format!("--datadir={}", self.dir.join("data").display()))
                    .arg(format!(
                        "--socket={}",
                        self.dir.join("mysqld.sock").display()
                    ))
                    .arg(format!(
                        "--pid-file={}",
                        self.dir.join("mysqld.pid").display()
                    ))
                    .arg(format!("--port={}", self.port))
                    .args([
                        "--bind-address=127.0.0.1",
                        "--skip-grant-tables",
                        "--skip-log-bin",
                        "--innodb-buffer-pool-size=32M",
                        "--max-connections=300",
                    ]);
                if running_as_root() {
                    command.arg("--user=root");
                }
                self.child = Some(spawn_quiet(&mut command, "mariadbd").map_err(fail)?);
            }
            ServerKind::Nats => {
                let mut command = Command::new("nats-server");
                command
                    .args([
                        "-a",
                        "127.0.0.1",
                        "-p",
                        &self.port.to_string(),
                        "-js",
                        "-sd",
                    ])
                    .arg(self.dir.join("js"));
                self.child = Some(
                    spawn_quiet(&mut command, "nats-server (scripts/setup installs it)")
                        .map_err(fail)?,
                );
            }
            ServerKind::Etcd => {
                let mut command = Command::new("etcd");
                command
                    .args(["--name", "fault", "--data-dir"])
                    .arg(self.dir.join("data"))
                    .args(["--listen-client-urls", &endpoint])
                    .args(["--advertise-client-urls", &endpoint])
                    .args(["--listen-peer-urls", &peer])
                    .args(["--initial-advertise-peer-urls", &peer])
                    .args(["--initial-cluster", &format!("fault={peer}")]);
                self.child = Some(spawn_quiet(&mut command, "etcd").map_err(fail)?);
            }
            ServerKind::ZooKeeper => {
                let config = self.dir.join("zoo.cfg");
                std::fs::write(
                    &config,
                    zookeeper_ensemble::server_config(&self.dir.join("data"), self.port, ""),
                )
                .map_err(|e| fail(format!("zoo.cfg: {e}")))?;
                let mut command = zookeeper_ensemble::server_command(&config);
                self.child = Some(
                    spawn_quiet(
                        &mut command,
                        "ZooKeeper (scripts/setup installs zookeeperd)",
                    )
                    .map_err(fail)?,
                );
            }
            ServerKind::S3 => {
                // One request at a time: moto alone can let two conditional writes on one
                // ETag both succeed (scripts/s3-server says where).
                let mut command = Command::new("python3");
                command
                    .arg(S3_SERVER)
                    .args(["-H", "127.0.0.1", "-p", &self.port.to_string()]);
                self.child = Some(
                    spawn_quiet(
                        &mut command,
                        &format!("{S3_SERVER} (scripts/setup installs moto)"),
                    )
                    .map_err(fail)?,
                );
            }
            ServerKind::Kube | ServerKind::Consul => {
                let program = self
                    .program
                    .clone()
                    .ok_or_else(|| fail("no server program given".to_owned()))?;
                let child = Command::new(&program)
                    .args(["--listen", &format!("127.0.0.1:{}", self.port)])
                    .arg("--state")
                    .arg(self.dir.join("state.json"))
                    .stdout(Stdio::null())
                    .spawn()
                    .map_err(|e| fail(format!("{}: {e}", program.display())))?;
                self.child = Some(child);
            }
        }
        for _ in 0..400 {
            if self.ready() {
                // moto starts empty, every time.
                if self.kind == ServerKind::S3 {
                    return leader_test_support::create_bucket(
                        &endpoint,
                        super::campaign::FAULT_BUCKET,
                    )
                    .map_err(fail);
                }
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Err(fail(format!("not ready on port {} after 10 s", self.port)))
    }

    /// Freezes the server with SIGSTOP (every process of it: Postgres's postmaster and each
    /// backend), so that open connections stay open and nothing answers; [`Self::thaw`] resumes
    /// it.
    pub fn freeze(&self) {
        for pid in self.processes() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP);
        }
    }

    /// Resumes a frozen server with SIGCONT.
    pub fn thaw(&self) {
        for pid in self.processes() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
        }
    }

    /// The server's processes: its own and, for Postgres, every child of the postmaster.
    fn processes(&self) -> Vec<nix::unistd::Pid> {
        let main = match self.kind {
            ServerKind::Postgres => std::fs::read_to_string(self.dir.join("data/postmaster.pid"))
                .ok()
                .and_then(|pid| pid.lines().next()?.trim().parse::<i32>().ok()),
            _ => self.child.as_ref().and_then(|c| i32::try_from(c.id()).ok()),
        };
        let mut out = Vec::new();
        let mut todo: Vec<i32> = main.into_iter().collect();
        while let Some(pid) = todo.pop() {
            out.push(nix::unistd::Pid::from_raw(pid));
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default();
            todo.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
        out
    }

    /// Accepts connections; for etcd, also has a raft leader and answers reads (`/health`), which
    /// a fresh single-member cluster takes about a second for; for ZooKeeper, serves (its
    /// `srvr` says it is standalone).
    fn ready(&self) -> bool {
        use std::io::{Read, Write};
        if self.kind == ServerKind::ZooKeeper {
            return zookeeper_ensemble::four_letter_word(self.port, "srvr")
                .is_some_and(|answer| answer.contains("Mode: standalone"));
        }
        let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        if self.kind != ServerKind::Etcd {
            return true;
        }
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let request = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
        let mut answer = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut answer).is_ok()
            && answer.contains("\"health\":\"true\"")
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts `command` with its output dropped; `what` names the program in the error.
fn spawn_quiet(command: &mut Command, what: &str) -> Result<Child, String> {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{what}: {e}"))
}
