//! No error, description or `Debug` of a Consul lock URL or store shows a password or ACL token
//! put in the URL or the agent address, however it is written (`/`, `?`, `#`, `@`, `:` raw or
//! percent-encoded). No agent is needed: the client sends nothing until a lock asks.

use leader_consul::{ConsulStore, ConsulStoreBuilder, LockUrl};
use leader_test_support::redaction::assert_urls_hidden;
use leader_test_support::secrets::{assert_built_hidden, passwords, tokens};

/// Lock URLs with each password, as user-info or as a parameter, and with each token.
fn urls() -> Vec<String> {
    let mut urls = Vec::new();
    for password in passwords() {
        urls.push(format!("consul://app:{password}@127.0.0.1:8500/locks/"));
        urls.push(format!("consul://127.0.0.1:8500/locks/?token={password}"));
        urls.push(format!(
            "consul://127.0.0.1:8500/locks/?dc=eu1&acl_token={password}"
        ));
    }
    for token in tokens() {
        urls.push(format!("consuls://{token}@consul.internal/locks/"));
    }
    urls
}

/// Agent addresses for the store itself.
fn addresses() -> Vec<String> {
    let mut addresses = Vec::new();
    for password in passwords() {
        addresses.push(format!("http://app:{password}@127.0.0.1:8500"));
    }
    for token in tokens() {
        addresses.push(format!("https://{token}@consul.internal:8501"));
    }
    addresses
}

#[tokio::test]
async fn redact_passwords_and_tokens_of_lock_urls_and_stores() {
    let build = async |b: ConsulStoreBuilder| b.build();
    assert_urls_hidden(urls(), LockUrl::parse, LockUrl::store, &build, None).await;
    for address in addresses() {
        let builder = ConsulStore::builder(&address).token("p4ss-w0rd");
        assert_built_hidden(&address, builder, &build).await;
    }
}
