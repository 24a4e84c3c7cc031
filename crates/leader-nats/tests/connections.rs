//! The connections NATS users configure, each against a server of the test's own: TLS with a
//! private CA and a client certificate the server verifies, an NKey user, a JetStream domain,
//! a store on the service's own JetStream context, and a password of the characters generated
//! passwords hold. Lock URLs carry the same settings.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use async_nats::jetstream;
use common::Server;
use leader_core::{LockError, ResourceLock};
use leader_nats::{LockUrl, NatsStore, NatsStoreBuilder};

const TIMEOUT: Duration = Duration::from_secs(2);

/// A lock on a bucket the store creates: it works when a read answers.
async fn works(store: &NatsStore) -> Result<(), LockError> {
    store.lock("connections", "a").get().await.map(drop)
}

/// A store at `address` that creates its bucket and waits [`TIMEOUT`] for an answer.
fn creating(address: &str) -> NatsStoreBuilder {
    NatsStore::builder(address)
        .create_bucket(true)
        .request_timeout(TIMEOUT)
}

/// The store a lock URL names, creating its bucket and waiting [`TIMEOUT`]: [`works`].
async fn url_works(url: &str) -> Result<(), LockError> {
    let store = LockUrl::parse(url)
        .expect("a lock URL")
        .store()
        .create_bucket(true)
        .request_timeout(TIMEOUT)
        .build()
        .await
        .expect("store");
    works(&store).await
}

/// Runs openssl with `args` in `dir`.
fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl (scripts/setup installs it)");
    assert!(status.success(), "openssl {args:?}");
}

/// A private CA, a server certificate for 127.0.0.1 and a client certificate, all signed by
/// it, in `dir`: `ca.pem`, `server.pem`/`server.key`, `client.pem`/`client.key`; and another
/// CA, `other.pem`.
fn certificates(dir: &Path) {
    let ca = [
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test CA",
    ];
    openssl(
        dir,
        &[&ca[..], &["-keyout", "ca.key", "-out", "ca.pem"]].concat(),
    );
    openssl(
        dir,
        &[&ca[..], &["-keyout", "other.key", "-out", "other.pem"]].concat(),
    );
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .expect("extensions");
    for (name, subject) in [("server", "/CN=localhost"), ("client", "/CN=leader")] {
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                subject,
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
            ],
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "san.ext",
                "-out",
                &format!("{name}.pem"),
            ],
        );
    }
}

#[tokio::test]
async fn tls_with_a_private_ca_and_a_client_certificate() {
    let dir = tempfile::tempdir().expect("dir");
    let path = |file: &str| dir.path().join(file);
    certificates(dir.path());
    let config = format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n}}\n",
        path("server.pem").display(),
        path("server.key").display(),
        path("ca.pem").display()
    );
    let Some(server) = Server::start(Some(&config)) else {
        return;
    };
    let store = |ca: &str, client: bool| {
        let mut builder = creating(&server.url()).tls_root_certificates(path(ca));
        if client {
            builder = builder.tls_client_certificate(path("client.pem"), path("client.key"));
        }
        builder.build()
    };
    works(&store("ca.pem", true).await.expect("store"))
        .await
        .expect("the private CA and the client certificate");
    // The same through a lock URL.
    let url = format!(
        "{}/leader?tls_ca={}&tls_cert={}&tls_key={}",
        server.url(),
        path("ca.pem").display(),
        path("client.pem").display(),
        path("client.key").display()
    );
    url_works(&url).await.expect("the URL's TLS files");
    // Another CA, or no client certificate: no connection, so no answer.
    for (ca, client) in [("other.pem", true), ("ca.pem", false)] {
        let refused = works(&store(ca, client).await.expect("store")).await;
        assert!(
            refused.is_err(),
            "{ca}, client certificate {client}: {refused:?}"
        );
    }
    // A file that is not there is a setting to fix, named.
    let missing = NatsStore::builder(server.url())
        .tls_root_certificates(path("nowhere.pem"))
        .build()
        .await
        .expect_err("no CA file");
    assert!(
        matches!(&missing, LockError::Misconfigured { message, .. } if message.contains("nowhere.pem")),
        "{missing:?}"
    );
}

#[tokio::test]
async fn an_nkey_user_logs_in_with_its_seed() {
    let user = nkeys::KeyPair::new_user();
    let config = format!(
        "authorization {{\n  users = [ {{ nkey: {} }} ]\n}}\n",
        user.public_key()
    );
    let Some(server) = Server::start(Some(&config)) else {
        return;
    };
    let dir = tempfile::tempdir().expect("dir");
    let seed = dir.path().join("user.nk");
    std::fs::write(&seed, user.seed().expect("a seed")).expect("write the seed");
    let store = creating(&server.url())
        .nkey_file(&seed)
        .build()
        .await
        .expect("store");
    works(&store).await.expect("logged in with the NKey");
    let url = format!("{}/leader?nkey_file={}", server.url(), seed.display());
    url_works(&url).await.expect("the URL's NKey");
    // Another user's seed is refused; a file without a seed is a setting to fix.
    std::fs::write(&seed, nkeys::KeyPair::new_user().seed().expect("seed")).expect("write");
    let stranger = NatsStore::builder(server.url())
        .request_timeout(TIMEOUT)
        .nkey_file(&seed)
        .build()
        .await
        .expect("store");
    let refused = works(&stranger).await;
    assert!(
        matches!(
            refused,
            Err(LockError::Forbidden { .. } | LockError::Unavailable { .. })
        ),
        "{refused:?}"
    );
    std::fs::write(&seed, "not a seed").expect("write");
    let bad = NatsStore::builder(server.url())
        .nkey_file(&seed)
        .build()
        .await
        .expect_err("no seed");
    assert!(matches!(bad, LockError::Misconfigured { .. }), "{bad:?}");
}

#[tokio::test]
async fn a_jetstream_domain_and_the_services_own_context() {
    let Some(server) = Server::start(Some("jetstream {\n  domain: hub\n}\n")) else {
        return;
    };
    let in_domain = creating(&server.url())
        .jetstream_domain("hub")
        .build()
        .await
        .expect("store");
    works(&in_domain).await.expect("the bucket in domain hub");
    let url = format!("{}/leader?domain=hub", server.url());
    let lock = LockUrl::parse(&url).expect("a lock URL");
    works(&lock.store().build().await.expect("store"))
        .await
        .expect("the URL's domain");
    // Nobody answers for a domain the server is not.
    let elsewhere = NatsStore::builder(server.url())
        .request_timeout(TIMEOUT)
        .jetstream_domain("elsewhere")
        .build()
        .await
        .expect("store");
    assert!(works(&elsewhere).await.is_err());

    // The service's own connection and context.
    let client = async_nats::connect(server.url()).await.expect("connect");
    let context = jetstream::with_domain(client, "hub");
    let own = NatsStore::builder("unused")
        .build_on(context)
        .expect("a store on the service's context");
    works(&own)
        .await
        .expect("the bucket through the service's context");
}

/// A password of `+`, `&`, `@` and `%`, in a URL as its user-info is written (RFC 3986): `+`
/// and `&` as they are, `@` and `%` percent-encoded, and a `+` as `%2B` too. It logs in through
/// a lock URL and through the store's own address; a wrong one is refused without showing it.
#[tokio::test]
async fn a_password_with_plus_ampersand_and_encoded_characters_logs_in() {
    const PASSWORD: &str = "p4ss+w0rd&x@y+z%";
    const IN_URL: &str = "p4ss+w0rd&x%40y%2Bz%25";
    let config = format!(
        "accounts {{ APP {{ jetstream: enabled, users: [ {{ user: app, password: \"{PASSWORD}\" }} ] }} }}\n"
    );
    let Some(server) = Server::start(Some(&config)) else {
        return;
    };
    let address = format!("nats://app:{IN_URL}@127.0.0.1:{}", server.port);
    url_works(&format!("{address}/leader"))
        .await
        .expect("the URL's password");
    let store = creating(&address).build().await.expect("store");
    works(&store).await.expect("the address's password");

    // The same password with `+` read as a space, as form data reads it, is another one.
    let wrong = format!(
        "nats://app:{}@127.0.0.1:{}",
        IN_URL.replace('+', "%20"),
        server.port
    );
    let refused = works(
        &NatsStore::builder(&wrong)
            .request_timeout(TIMEOUT)
            .build()
            .await
            .expect("store"),
    )
    .await
    .expect_err("a wrong password");
    assert!(
        matches!(refused, LockError::Forbidden { .. }),
        "{refused:?}"
    );
    for shown in [refused.to_string(), format!("{refused:?}")] {
        for part in ["p4ss", "w0rd"] {
            assert!(!shown.contains(part), "{shown}");
        }
    }
}
