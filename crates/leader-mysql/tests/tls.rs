//! TLS with a private CA against a MariaDB of the test's own (`mariadbd` from Debian's packages)
//! that refuses plain TCP (`--require-secure-transport=ON`), its certificates made by `openssl`
//! in a temporary directory: the CA given with `ssl_ca` (URL or builder), a client certificate
//! given with `ssl_cert` and `ssl_key`, and the errors when either is missing or wrong. Skipped
//! without `mariadbd` or `openssl`, a failure under `CI=true`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::private::{PrivateServer, run, server_dir, tools_or_skip};
use leader_core::conformance::record;
use leader_core::{LockError, LockTarget, ResourceLock};
use leader_mysql::mysql_async::prelude::Queryable;
use leader_mysql::{LockUrl, MysqlStore, MysqlStoreBuilder};

/// A private MariaDB with TLS on loopback; killed when dropped, its directory removed.
struct TlsServer {
    server: PrivateServer,
}

/// `name.key` and `name.pem` in `dir`: an EC key and a certificate signed by the CA in `dir`
/// (`ca.key`, `ca.pem`), or the self-signed CA itself for `ca`.
fn certificate(dir: &Path, name: &str, subject: &str, extensions: &[&str]) {
    let mut command = Command::new("openssl");
    command
        .current_dir(dir)
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
        .args(["-subj", subject, "-keyout"])
        .arg(format!("{name}.key"))
        .arg("-out")
        .arg(format!("{name}.pem"));
    if name != "ca" {
        command.args(["-CA", "ca.pem", "-CAkey", "ca.key"]);
    }
    for extension in extensions {
        command.args(["-addext", extension]);
    }
    run(command.stdout(Stdio::null()));
}

impl TlsServer {
    /// Makes a CA, a server certificate for 127.0.0.1 and localhost and a client certificate,
    /// initialises a data directory and starts the server; `None` (outside CI) without
    /// `mariadbd` or `openssl`.
    async fn start() -> Option<Self> {
        if !tools_or_skip(&["openssl"]) {
            return None;
        }
        let dir = server_dir("tls");
        let path = dir.path();
        certificate(
            path,
            "ca",
            "/CN=leader test CA",
            &[
                "basicConstraints=critical,CA:TRUE",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        );
        certificate(
            path,
            "server",
            "/CN=localhost",
            &[
                "basicConstraints=critical,CA:FALSE",
                "subjectAltName=DNS:localhost,IP:127.0.0.1",
                "extendedKeyUsage=serverAuth",
            ],
        );
        certificate(
            path,
            "client",
            "/CN=x509",
            &[
                "basicConstraints=critical,CA:FALSE",
                "extendedKeyUsage=clientAuth",
            ],
        );
        let args = [
            format!("--ssl-ca={}", path.join("ca.pem").display()),
            format!("--ssl-cert={}", path.join("server.pem").display()),
            format!("--ssl-key={}", path.join("server.key").display()),
            // 127.0.0.2, an address the server's certificate does not name.
            "--bind-address=127.0.0.1,127.0.0.2".to_owned(),
            "--require-secure-transport=ON".to_owned(),
        ];
        let mut server = PrivateServer::start(dir, &args)?;
        // Root gets in over TLS, then makes the database and the client-certificate user.
        let mut conn = server.admin("require_ssl=true&verify_ca=false").await;
        for sql in [
            "CREATE DATABASE leader",
            "CREATE USER x509@'%' REQUIRE SUBJECT '/CN=x509'",
            "GRANT ALL ON leader.* TO x509@'%'",
        ] {
            conn.query_drop(sql).await.expect(sql);
        }
        let _ = conn.disconnect().await;
        Some(Self { server })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.server.file(name)
    }

    fn url(&self, user: &str, query: &str) -> String {
        self.server.url(user, "leader", query)
    }
}

/// A store on the test's table, as `builder` says.
async fn built(builder: MysqlStoreBuilder) -> MysqlStore {
    builder.table("tls_locks").build().await.expect("store")
}

/// What reading the election `name` as `identity` on [`built`] `builder` fails with (`why`
/// says why it must).
async fn refused(builder: MysqlStoreBuilder, name: &str, identity: &str, why: &str) -> LockError {
    built(builder)
        .await
        .lock(name, identity)
        .get()
        .await
        .expect_err(why)
}

async fn acquire(lock: &dyn ResourceLock) {
    let acquisition = lock
        .try_acquire(&record(lock.identity(), 0))
        .await
        .expect("acquire over TLS")
        .expect("the table lock acquires in one statement");
    assert!(acquisition.acquired().is_some(), "{acquisition:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_ca_and_a_client_certificate_connect_and_nothing_else_does() {
    let Some(server) = TlsServer::start().await else {
        return;
    };
    let ca = server.file("ca.pem");

    // (a) The lock URL's ssl_ca, with the server's name checked: connects, and the lock works.
    let lock_url = LockUrl::parse(&server.url(
        "root",
        &format!(
            "ssl_ca={}&verify_identity=true&table=tls_locks",
            ca.display()
        ),
    ))
    .expect("lock URL");
    let lock = lock_url.open("over-tls", "a").await.expect("open over TLS");
    acquire(lock.as_ref()).await;
    // The driver's connection is really encrypted.
    let store = lock_url.store().build().await.expect("store");
    let mut conn = store.pool().get_conn().await.expect("a pooled connection");
    let cipher: Option<(String, String)> = conn
        .query_first("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .await
        .expect("Ssl_cipher");
    assert!(
        cipher.as_ref().is_some_and(|(_, c)| !c.is_empty()),
        "{cipher:?}"
    );
    drop(conn);

    // The builder's ssl_ca, on a URL that only says where the server is.
    let store = built(MysqlStore::builder(server.url("root", "")).ssl_ca(&ca)).await;
    acquire(&store.lock("builder", "b")).await;

    // A client certificate for a user who must present one (REQUIRE SUBJECT), from the URL and
    // from the builder.
    let with_identity = format!(
        "ssl_ca={}&ssl_cert={}&ssl_key={}&table=tls_locks",
        ca.display(),
        server.file("client.pem").display(),
        server.file("client.key").display()
    );
    let lock = LockUrl::parse(&server.url("x509", &with_identity))
        .expect("lock URL")
        .open("client-certificate", "c")
        .await
        .expect("open with a client certificate");
    acquire(lock.as_ref()).await;
    let store = built(
        MysqlStore::builder(server.url("x509", ""))
            .ssl_ca(&ca)
            .ssl_client_identity(server.file("client.pem"), server.file("client.key")),
    )
    .await;
    acquire(&store.lock("client-certificate-builder", "d")).await;
    // Without it the server refuses that user: Forbidden, as any failed authentication.
    let builder = MysqlStore::builder(server.url("x509", "")).ssl_ca(&ca);
    let err = refused(builder, "no-identity", "e", "no client certificate").await;
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");

    // (b) Without the CA, TLS with the built-in roots only: the server's certificate is not
    // trusted. The crate maps TLS failures as every failure to connect: Unavailable, with the
    // driver's reason.
    let builder = MysqlStore::builder(server.url("root:hunter2", "require_ssl=true"));
    let err = refused(builder, "no-ca", "f", "untrusted server").await;
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    let message = format!("{err} {err:?}");
    assert!(message.contains("UnknownIssuer"), "{message}");
    assert!(!message.contains("hunter2"), "{message}");
    // A CA that did not sign the server's certificate is no better, and the built-in roots
    // are not tried besides it.
    let other = tempfile::tempdir().expect("temporary directory");
    certificate(
        other.path(),
        "ca",
        "/CN=another CA",
        &["basicConstraints=critical,CA:TRUE"],
    );
    let builder = MysqlStore::builder(server.url("root", "")).ssl_ca(other.path().join("ca.pem"));
    let err = refused(builder, "other-ca", "g", "untrusted server").await;
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    // The server's name is checked: the certificate for 127.0.0.1 and localhost does not
    // vouch for 127.0.0.2. (The driver's verify_identity=false does not help here with
    // mysql_async 0.37.1 and rustls 0.23: blackbeam/mysql_async#404.)
    let url = server.url("root", "").replace("127.0.0.1", "127.0.0.2");
    let err = refused(
        MysqlStore::builder(url).ssl_ca(&ca),
        "name",
        "i",
        "another name",
    )
    .await;
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("certificate not valid for name \"127.0.0.2\""),
        "{err}"
    );
    // Plain TCP: the server refuses it. MariaDB answers a connection without TLS under
    // require_secure_transport as a failed login ("Access denied", error 1045): Forbidden.
    let builder = MysqlStore::builder(server.url("root", ""));
    let err = refused(builder, "plain", "h", "plain TCP").await;
    assert!(matches!(err, LockError::Forbidden { .. }), "{err:?}");
    drop(server);
}

/// Files that are missing, unreadable or not what they should be: `Misconfigured` naming the
/// file when the store is built, before any connection (no server needed), without the
/// password.
#[tokio::test]
async fn bad_tls_files_are_refused_when_the_store_is_built() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let missing = dir.path().join("no-such-ca.pem");
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").expect("write");
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello\n").expect("write");
    let cert = dir.path().join("cert.pem");
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
    )
    .expect("write");
    let base = "mysql://app:hunter2@127.0.0.1:1/app";
    let cases = [
        (
            format!("{base}?ssl_ca={}", missing.display()),
            missing.display().to_string(),
        ),
        (
            format!("{base}?ssl_ca={}", empty.display()),
            format!("{}: no PEM certificate", empty.display()),
        ),
        (
            format!("{base}?ssl_ca={}", not_pem.display()),
            format!("{}: no PEM certificate", not_pem.display()),
        ),
        (
            format!(
                "{base}?ssl_cert={}&ssl_key={}",
                cert.display(),
                missing.display()
            ),
            format!("ssl_key file {}", missing.display()),
        ),
        (
            format!(
                "{base}?ssl_cert={}&ssl_key={}",
                cert.display(),
                cert.display()
            ),
            format!("ssl_key file {}: no PEM private key", cert.display()),
        ),
        (
            format!("{base}?ssl_cert={}", cert.display()),
            "ssl_cert without ssl_key".to_owned(),
        ),
        (format!("{base}?ssl_ca="), "ssl_ca= is empty".to_owned()),
        (
            format!("{base}?ssl_ca={}&require_ssl=false", cert.display()),
            "leave out require_ssl=false".to_owned(),
        ),
    ];
    for (url, expected) in cases {
        let lock_url = LockUrl::parse(&url).expect("the lock URL parses");
        let Err(err) = lock_url.open("x", "a").await else {
            panic!("{url}: opened");
        };
        let message = err.to_string();
        assert!(
            matches!(err, LockError::Misconfigured { .. }),
            "{url}: {err:?}"
        );
        assert!(message.contains(&expected), "{url}: {message}");
        assert!(!message.contains("hunter2"), "{url}: {message}");
    }
    // The builder's own paths too.
    let err = MysqlStore::builder(base)
        .ssl_ca(&missing)
        .build()
        .await
        .expect_err("missing CA");
    assert!(matches!(err, LockError::Misconfigured { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
    let err = MysqlStore::builder(base)
        .ssl_client_identity(&missing, &cert)
        .build()
        .await
        .expect_err("missing certificate");
    assert!(
        err.to_string()
            .contains(&format!("ssl_cert file {}", missing.display())),
        "{err}"
    );
    // A readable CA builds (the pool connects lazily).
    MysqlStore::builder(base)
        .ssl_ca(&cert)
        .build()
        .await
        .expect("a readable CA builds");
}
