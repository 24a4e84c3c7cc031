//! TLS with rustls: `sslmode=require` verifies the server's certificate. Uses the local server's
//! certificate (Debian's snake-oil one, for `localhost`) as the only trusted root.

mod common;

use std::sync::Arc;

use leader_core::{LockError, ResourceLock};
use leader_postgres::PostgresStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

const SERVER_CERT: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";

/// `host=localhost` with the test server's port, database, user and password.
fn tls_conn() -> String {
    let config: tokio_postgres::Config = common::database_url().parse().expect("DATABASE_URL");
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("postgres");
    let password = config
        .get_password()
        .map(|p| format!(" password={}", String::from_utf8_lossy(p)))
        .unwrap_or_default();
    let db = config.get_dbname().unwrap_or("postgres");
    format!("host=localhost port={port} dbname={db} user={user}{password} sslmode=require")
}

/// The server's certificate, if it serves TLS with it.
async fn server_certificate() -> Option<CertificateDer<'static>> {
    let admin = common::admin().await?;
    let ssl: String = common::query_value(&admin, "SHOW ssl", &[]).await;
    let file: String = common::query_value(&admin, "SHOW ssl_cert_file", &[]).await;
    let cert = std::fs::read(SERVER_CERT)
        .ok()
        .filter(|_| ssl == "on" && file == SERVER_CERT);
    if cert.is_none() {
        let why = format!("the server does not serve TLS with {SERVER_CERT}");
        assert!(!common::in_ci(), "{why}");
        eprintln!("skipping: {why}");
    }
    CertificateDer::from_pem_slice(&cert?).ok()
}

fn trusting(cert: CertificateDer<'static>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert).expect("a usable root");
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

#[tokio::test]
async fn require_connects_over_tls_to_a_trusted_server() {
    let Some(cert) = server_certificate().await else {
        return;
    };
    let store = PostgresStore::builder(tls_conn())
        .tls(trusting(cert))
        .create_table(true)
        .build()
        .await
        .expect("TLS store");
    let client = store.pool().get().await.expect("connection");
    let encrypted: bool = common::query_value(
        &**client,
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        &[],
    )
    .await;
    assert!(encrypted, "the pooled connection is not encrypted");
    drop(client);
    let lock = store.lock(common::unique("tls"), "a");
    assert!(lock.get().await.expect("get over TLS").is_none());
}

#[tokio::test]
async fn require_refuses_a_server_it_cannot_verify() {
    if server_certificate().await.is_none() {
        return;
    }
    // The default roots (webpki-roots) do not include a self-signed certificate.
    let store = PostgresStore::connect(tls_conn())
        .await
        .expect("lazy store");
    let err = store
        .lock("tls", "a")
        .get()
        .await
        .expect_err("unverifiable certificate");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
}
