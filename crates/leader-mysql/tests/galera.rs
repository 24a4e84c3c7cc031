//! A Galera node: a single-node cluster of the test's own (`mariadbd` with the `galera-4`
//! provider, which Debian's MariaDB server depends on). The `GET_LOCK` lock is refused once,
//! when it is opened from a URL or checked at start, as `Misconfigured` naming `wsrep_on`
//! (what makes the `leader` command exit with 3), whether or not the node would refuse
//! `GET_LOCK` itself; the table lock works there. Skipped without `mariadbd` or the provider, a
//! failure under `CI=true`.

mod common;

use std::path::Path;

use common::LEASE;
use common::private::{PrivateServer, free_port, server_dir};
use leader_core::conformance::record;
use leader_core::{LockError, LockTarget, ResourceLock};
use leader_mysql::mysql_async::prelude::Queryable;
use leader_mysql::{LockUrl, MysqlStore};

/// Debian's path of the Galera provider, or `None` (outside CI) without it.
fn provider() -> Option<&'static str> {
    let path = "/usr/lib/galera/libgalera_smm.so";
    if Path::new(path).exists() {
        return Some(path);
    }
    assert!(
        !common::in_ci(),
        "CI=true and no Galera provider at {path} (Debian's galera-4, which mariadb-server depends on)"
    );
    eprintln!("skipping: no Galera provider at {path}");
    None
}

fn refused(err: &LockError) -> &str {
    let LockError::Misconfigured { message, .. } = err else {
        panic!("not Misconfigured: {err:?}");
    };
    assert!(
        message.contains("wsrep_on=ON") && message.contains("table lock"),
        "{message}"
    );
    assert!(!message.contains('\n'), "one line: {message}");
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_get_lock_lock_is_refused_at_open_on_a_galera_node() {
    let Some(provider) = provider() else {
        return;
    };
    let gcomm = free_port();
    let args = [
        "--binlog-format=ROW".to_owned(),
        "--innodb-autoinc-lock-mode=2".to_owned(),
        "--wsrep-on=ON".to_owned(),
        format!("--wsrep-provider={provider}"),
        "--wsrep-cluster-address=gcomm://".to_owned(),
        "--wsrep-new-cluster".to_owned(),
        "--wsrep-node-address=127.0.0.1".to_owned(),
        format!(
            "--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{gcomm};base_port={gcomm};gcache.size=16M"
        ),
    ];
    let Some(mut server) = PrivateServer::start(server_dir("galera"), &args) else {
        return;
    };
    let mut admin = server.admin("").await;
    // A new cluster's node accepts connections before it takes queries ("WSREP has not yet
    // prepared node for application use"): wait for `wsrep_ready`, as a deployment's readiness
    // check does.
    let started = std::time::Instant::now();
    loop {
        let ready: Option<(String, String)> = admin
            .query_first("SHOW GLOBAL STATUS LIKE 'wsrep_ready'")
            .await
            .expect("wsrep_ready");
        if ready.is_some_and(|(_, value)| value == "ON") {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the Galera node never became ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let wsrep_on: Option<(String, String)> = admin
        .query_first("SHOW GLOBAL VARIABLES LIKE 'wsrep_on'")
        .await
        .expect("wsrep_on");
    assert_eq!(
        wsrep_on.map(|(_, value)| value).as_deref(),
        Some("ON"),
        "the case at hand"
    );
    admin
        .query_drop("CREATE DATABASE leader")
        .await
        .expect("database");

    // From a URL, as the `leader` command opens it: refused before any attempt.
    let Err(err) = LockUrl::parse(&server.url("root", "leader", "lock=named"))
        .expect("a lock URL")
        .open("jobs", "a")
        .await
    else {
        panic!("the GET_LOCK lock opened on a Galera node");
    };
    eprintln!("refused at open: {}", refused(&err));

    // Made from a store: its start check refuses it.
    let store = MysqlStore::builder(server.url("root", "leader", ""))
        .create_table(true)
        .build()
        .await
        .expect("store");
    let err = store
        .named_lock("jobs", "a")
        .check_lease(LEASE)
        .await
        .expect_err("the start check refuses it");
    refused(&err);

    // The table lock works on the same node.
    let lock = LockUrl::parse(&server.url("root", "leader", ""))
        .expect("a lock URL")
        .open("jobs", "a")
        .await
        .expect("the table lock opens");
    lock.check_lease(LEASE).await.expect("and passes its check");
    let acquired = lock
        .try_acquire(&record("a", 0))
        .await
        .expect("try_acquire")
        .expect("one statement");
    assert!(acquired.acquired().is_some(), "{acquired:?}");
}
