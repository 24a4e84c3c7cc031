//! No error, description or `Debug` of a NATS lock URL or store shows the password or token,
//! however it is written (`/`, `?`, `#`, `@`, `:` raw or percent-encoded). No server is needed:
//! the client connects in the background.

use leader_nats::{LockUrl, NatsStore, NatsStoreBuilder};
use leader_test_support::redaction::assert_urls_hidden;
use leader_test_support::secrets::{assert_built_hidden, passwords, tokens};

/// `value` as a URL parameter's value.
fn encoded(value: &str) -> String {
    value
        .replace('%', "%25")
        .replace('@', "%40")
        .replace('#', "%23")
        .replace('/', "%2F")
        .replace('?', "%3F")
        .replace(':', "%3A")
        .replace('&', "%26")
}

/// Lock URLs with each password, also in another server's address, and with each token.
fn urls() -> Vec<String> {
    let mut urls = Vec::new();
    for password in passwords() {
        urls.push(format!("nats://app:{password}@127.0.0.1:1/locks"));
        urls.push(format!("nats://app:{password}@h/locks?replicas=0"));
        urls.push(format!(
            "nats://127.0.0.1:1/locks?server={}",
            encoded(&format!("app:{password}@127.0.0.1:2"))
        ));
    }
    for token in tokens() {
        urls.push(format!("nats://{token}@127.0.0.1:1"));
        urls.push(format!("nats://{token}@h/locks?tls=maybe"));
    }
    urls
}

/// Server addresses for the store itself, with a scheme or without.
fn servers() -> Vec<String> {
    let mut servers = Vec::new();
    for password in passwords() {
        servers.push(format!("nats://app:{password}@127.0.0.1:1"));
        servers.push(format!("app:{password}@127.0.0.1:1"));
    }
    for token in tokens() {
        servers.push(format!("127.0.0.1:1,{token}@127.0.0.1:2"));
    }
    servers
}

#[tokio::test]
async fn redact_passwords_and_tokens_of_lock_urls_and_stores() {
    let build = async |b: NatsStoreBuilder| b.build().await;
    assert_urls_hidden(urls(), LockUrl::parse, LockUrl::store, &build, None).await;
    for servers in servers() {
        let builder = NatsStore::builder(&servers);
        assert_built_hidden(&servers, builder, &build).await;
    }
}
