//! A MariaDB of a test's own (`mariadbd` from Debian's packages) on loopback, for what a test
//! cannot set on the shared server (TLS only, a global `wait_timeout`): killed when dropped, its
//! directory removed. Skipped without `mariadbd`, a failure under `CI=true`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use leader_mysql::mysql_async::prelude::Queryable;
use leader_mysql::mysql_async::{self, Conn};

use super::in_ci;

/// A private MariaDB on loopback; killed when dropped, its directory removed.
pub struct PrivateServer {
    dir: tempfile::TempDir,
    pub port: u16,
    child: Child,
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn run(command: &mut Command) {
    let output = command
        .output()
        .unwrap_or_else(|err| panic!("{command:?}: {err}"));
    assert!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

pub use leader_test_support::free_port;

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// Whether every one of `tools` runs; `false` (outside CI) says why.
pub fn tools_or_skip(tools: &[&str]) -> bool {
    tools
        .iter()
        .all(|tool| leader_test_support::tool_or_skip(tool, "scripts/setup installs MariaDB"))
}

/// A temporary directory for a server, named after what it is for.
pub fn server_dir(purpose: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("leader-mysql-{purpose}-"))
        .tempdir()
        .expect("temporary directory")
}

impl PrivateServer {
    /// Initialises a data directory in `dir` and starts the server there with `args` besides
    /// its own (a free port on loopback, no binary log); `None` (outside CI) without
    /// `mariadbd`. [`admin`](Self::admin) waits until it answers.
    pub fn start(dir: tempfile::TempDir, args: &[String]) -> Option<Self> {
        if !tools_or_skip(&["mariadbd", "mariadb-install-db"]) {
            return None;
        }
        let path = dir.path();
        let data = path.join("data");
        let mut install = Command::new("mariadb-install-db");
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--tmpdir={}", path.display()))
            .env("TMPDIR", path)
            .args(["--skip-test-db", "--auth-root-authentication-method=normal"]);
        if running_as_root() {
            install.arg("--user=root");
        }
        run(&mut install);
        let port = free_port();
        let log = std::fs::File::create(path.join("mariadbd.log")).expect("log file");
        let mut server = Command::new("mariadbd");
        server
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", path.join("mysqld.sock").display()))
            .arg(format!("--pid-file={}", path.join("mysqld.pid").display()))
            .arg(format!("--port={port}"))
            .args(["--skip-log-bin", "--innodb-buffer-pool-size=32M"])
            .args(args);
        if !args.iter().any(|arg| arg.starts_with("--bind-address")) {
            server.arg("--bind-address=127.0.0.1");
        }
        if running_as_root() {
            server.arg("--user=root");
        }
        let child = server
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start mariadbd");
        Some(Self { dir, port, child })
    }

    /// A server started as [`start`](Self::start) does, with the database `leader` and a store
    /// on it that created its table: the server, root's connection and the store; `None`
    /// (outside CI) without `mariadbd`.
    pub async fn with_store(
        purpose: &str,
        args: &[String],
    ) -> Option<(Self, Conn, leader_mysql::MysqlStore)> {
        let mut server = Self::start(server_dir(purpose), args)?;
        let mut admin = server.admin("").await;
        admin
            .query_drop("CREATE DATABASE leader")
            .await
            .expect("database");
        let store = leader_mysql::MysqlStore::builder(server.url("root", "leader", ""))
            .create_table(true)
            .build()
            .await
            .expect("store");
        Some((server, admin, store))
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `mysql://{user}@127.0.0.1:{port}/{database}`, with `query` if any.
    pub fn url(&self, user: &str, database: &str, query: &str) -> String {
        let separator = if query.is_empty() { "" } else { "?" };
        format!(
            "mysql://{user}@127.0.0.1:{}/{database}{separator}{query}",
            self.port
        )
    }

    /// Waits until root gets in (with the driver's parameters `query`); its connection.
    pub async fn admin(&mut self, query: &str) -> Conn {
        let opts = mysql_async::Opts::from_url(&self.url("root", "", query)).expect("admin URL");
        let started = Instant::now();
        loop {
            match Conn::new(opts.clone()).await {
                Ok(conn) => return conn,
                Err(err) => {
                    let exited = self.child.try_wait().expect("mariadbd's status");
                    if exited.is_some() || started.elapsed() > Duration::from_secs(30) {
                        panic!(
                            "mariadbd did not come up ({exited:?}, {err}): {}",
                            std::fs::read_to_string(self.file("mariadbd.log")).unwrap_or_default()
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}
