//! The controller example (`examples/controller.rs`), as users run it: two replicas on the test
//! API server, with a kubeconfig, reconciling the Pods of a label selector. One replica
//! reconciles at a time, and a SIGTERM to the leader lets the reconcile it has in flight finish
//! and be written before the other replica takes the Lease: the server's own order of writes
//! (`resourceVersion`) shows it. `cargo test` builds the example before it runs this.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::TryStreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, WatchEvent, WatchParams};
use kube::{Resource, ResourceExt};
use leader_test_support::kube_api::KubeApiServer;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, timeout};

const NAMESPACE: &str = "default";
const SELECTED: &[(&str, &str)] = &[("app", "demo")];
const RECONCILED_BY: &str = "leader-rs.io/reconciled-by";
const RECONCILED_TOKEN: &str = "leader-rs.io/reconciled-token";

/// The example binary, beside this test's in the target directory.
fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let profile = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/PROFILE/deps");
    profile.join("examples").join("controller")
}

/// A replica of the example: its process and the lines it printed.
struct Replica {
    identity: &'static str,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Replica {
    fn start(identity: &'static str, kubeconfig: &Path) -> Self {
        let mut child = Command::new(example())
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAME", identity)
            .env("POD_NAMESPACE", NAMESPACE)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|err| panic!("the controller example (built by cargo test): {err}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().expect("stdout");
        let seen = lines.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                seen.lock().unwrap().push(line);
            }
        });
        Self {
            identity,
            child,
            lines,
        }
    }

    /// The `reconciling ...` and `reconciled ...` lines, in order.
    fn reconciles(&self) -> Vec<String> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter(|line| line.starts_with("reconcil"))
            .cloned()
            .collect()
    }

    /// Waits for the line `line`.
    async fn printed(&self, line: &str) {
        let started = Instant::now();
        while !self.reconciles().iter().any(|l| l == line) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{} never printed {line:?}: {:?}",
                self.identity,
                self.reconciles()
            );
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, as Kubernetes stops a Pod: it exits 0 within the stop grace.
    async fn stop(&mut self) {
        let pid = self.child.id().expect("running");
        kill(Pid::from_raw(pid.cast_signed()), Signal::SIGTERM).expect("SIGTERM");
        let status = timeout(Duration::from_secs(20), self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .expect("waited");
        assert!(
            status.success(),
            "{} after SIGTERM: {status}",
            self.identity
        );
    }
}

/// A write the server stored, as far as this test follows it.
#[derive(Clone, Debug, PartialEq)]
enum Write {
    /// A Pod stamped by a reconcile, with the fencing token of its term.
    Stamp { pod: String, token: u64 },
    /// The Lease, naming its holder (empty once released).
    Holder(String),
}

/// The writes the server stored, each with its `resourceVersion`: the server's order.
type Writes = Arc<Mutex<Vec<(u64, Write)>>>;

/// Follows every write of `api`'s objects from now on into `writes`, as `says` reads them.
async fn follow<K>(api: Api<K>, writes: &Writes, says: fn(&K) -> Option<Write>)
where
    K: Resource
        + Clone
        + k8s_openapi::serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    // Answered once the server follows the changes: none after this is missed.
    let events = api
        .watch(&WatchParams::default(), "0")
        .await
        .expect("a watch");
    let writes = writes.clone();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Ok(Some(event)) = events.try_next().await {
            if let WatchEvent::Added(object) | WatchEvent::Modified(object) = event
                && let Some(write) = says(&object)
            {
                let version = object.resource_version().expect("a resourceVersion");
                let version = version.parse().expect("a revision");
                writes.lock().unwrap().push((version, write));
            }
        }
    });
}

fn stamp_of(pod: &Pod) -> Option<Write> {
    let token = pod.annotations().get(RECONCILED_TOKEN)?;
    Some(Write::Stamp {
        pod: pod.name_any(),
        token: token.parse().expect("a fencing token"),
    })
}

fn holder_of(lease: &Lease) -> Option<Write> {
    let holder = lease.spec.as_ref()?.holder_identity.clone();
    Some(Write::Holder(holder.unwrap_or_default()))
}

/// Who stamped Pod `name` and under which fencing token, if anyone did.
fn stamp(api: &KubeApiServer, name: &str) -> Option<(String, u64)> {
    let pod = api.pod(NAMESPACE, name).expect("the Pod");
    let annotations = &pod["metadata"]["annotations"];
    let by = annotations[RECONCILED_BY].as_str()?;
    let token = annotations[RECONCILED_TOKEN].as_str()?;
    Some((by.to_owned(), token.parse().expect("a fencing token")))
}

/// Waits until every Pod of `names` carries the stamp of one term, later than the term of
/// `after` if given, and returns it.
async fn stamped_by_one_term(
    api: &KubeApiServer,
    names: &[&str],
    after: Option<u64>,
) -> (String, u64) {
    let started = Instant::now();
    loop {
        let stamps: Vec<_> = names.iter().map(|name| stamp(api, name)).collect();
        if let Some(Some(first)) = stamps.first()
            && after.is_none_or(|after| first.1 > after)
            && stamps.iter().all(|s| s.as_ref() == Some(first))
        {
            return first.clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the Pods were not all reconciled by one term: {stamps:?}"
        );
        sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_reconciles_and_a_stopped_leader_finishes_its_reconcile_first() {
    let api = KubeApiServer::start().await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig(NAMESPACE)).expect("write the kubeconfig");
    api.put_pod(NAMESPACE, "web-0", SELECTED);
    api.put_pod(NAMESPACE, "web-1", SELECTED);
    api.put_pod(NAMESPACE, "other", &[("app", "other")]);
    let client = kube::Client::try_from(kube::Config::new(api.url().parse().expect("a URL")))
        .expect("a client");
    let writes = Writes::default();
    follow(
        Api::<Pod>::namespaced(client.clone(), NAMESPACE),
        &writes,
        stamp_of,
    )
    .await;
    follow(
        Api::<Lease>::namespaced(client, NAMESPACE),
        &writes,
        holder_of,
    )
    .await;

    let mut replicas = [
        Replica::start("replica-a", &kubeconfig),
        Replica::start("replica-b", &kubeconfig),
    ];
    let (leader_id, first_token) = stamped_by_one_term(&api, &["web-0", "web-1"], None).await;
    let leader = replicas
        .iter()
        .position(|r| r.identity == leader_id)
        .expect("a replica stamped the Pods");
    let follower = 1 - leader;
    let follower_id = replicas[follower].identity;
    assert!(
        replicas[follower].reconciles().is_empty(),
        "the follower reconciled: {:?}",
        replicas[follower].reconciles()
    );

    // A new Pod: the leader starts on it, and is stopped in the middle of its work.
    api.put_pod(NAMESPACE, "web-2", SELECTED);
    let started = format!("reconciling web-2 (fencing token {first_token})");
    let finished = format!("reconciled web-2 (fencing token {first_token})");
    replicas[leader].printed(&started).await;
    replicas[leader].stop().await;
    // Printed once its write was answered, the last line of the stopped leader.
    replicas[leader].printed(&finished).await;
    assert_eq!(replicas[leader].reconciles().last(), Some(&finished));

    // The other replica takes over with a later term and reconciles every Pod again.
    let all = ["web-0", "web-1", "web-2"];
    let (next_id, next_token) = stamped_by_one_term(&api, &all, Some(first_token)).await;
    assert_eq!(next_id, follower_id);
    let reconciled = replicas[follower].reconciles();
    let suffix = format!("(fencing token {next_token})");
    assert!(
        reconciled.iter().all(|l| l.ends_with(&suffix)),
        "{reconciled:?}"
    );
    replicas[follower].stop().await;

    // In the server's order: every write of the first term, the stopped leader's last
    // reconcile included, came before the Lease named the other replica, and every write of
    // the next term after it.
    let writes = writes.lock().unwrap().clone();
    let at = |wanted: &Write| writes.iter().find(|(_, w)| w == wanted).map(|(v, _)| *v);
    let last_stamp = Write::Stamp {
        pod: "web-2".into(),
        token: first_token,
    };
    let done = at(&last_stamp).expect("the stopped leader's last reconcile written");
    let taken = at(&Write::Holder(follower_id.into())).expect("the Lease taken over");
    assert!(done < taken, "written at {done}, taken over at {taken}");
    for (version, write) in &writes {
        if let Write::Stamp { token, .. } = write {
            let term_ok = if *token == first_token {
                *version < taken
            } else {
                *token == next_token && *version > taken
            };
            assert!(term_ok, "{write:?} at {version}; taken over at {taken}");
        }
    }
    assert_eq!(stamp(&api, "other"), None, "a Pod the selector leaves out");
}
