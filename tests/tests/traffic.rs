//! End to end, traffic to the leader: real `leader run` processes with `--serve`, asked by a
//! real HTTP client (reqwest) through handovers (a SIGTERM of the leader, a SIGKILL):
//! `/leader` answers 200 on exactly one replica and 503 on the others, every replica's JSON
//! names the same leader, token and start; `/readyz` follows leadership only where
//! `--ready-only-while-leading` asks for it; with `--label-pod`, the leader's Pod carries the
//! label on the test Kubernetes API server, never two Pods at once.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leader_core::LeaderView;
use leader_tests::{TermEvent, on_each_backend};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use tokio::process::Child;
use tokio::time::{sleep, timeout};

const LEADER: &str = env!("CARGO_BIN_EXE_leader-e2e");
const JOB: &str = env!("CARGO_BIN_EXE_job");
const API_SERVER: &str = env!("CARGO_BIN_EXE_kube-api-e2e");

/// One `leader run` replica with `--serve` on a port of its own.
struct Replica {
    identity: &'static str,
    url: String,
    /// Whether it runs with `--ready-only-while-leading`.
    ready_only_while_leading: bool,
    child: Child,
}

impl Replica {
    fn start(
        lock: &str,
        name: &str,
        identity: &'static str,
        log: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let serve = format!("127.0.0.1:{port}");
        let child = leader_tests::candidate_command(LEADER, "run", lock, name, identity)
            .args(["--lease-duration", "4s", "--renew-deadline", "3s"])
            .args(["--retry-period", "1s", "--serve", &serve])
            .args(extra)
            .args(["--", JOB])
            .envs(env.iter().copied())
            .env("JOB_LOG", log)
            .env(
                "RUST_LOG",
                std::env::var("E2E_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .spawn()
            .expect("spawn leader");
        Self {
            identity,
            url: format!("http://{serve}"),
            ready_only_while_leading: extra.contains(&"--ready-only-while-leading"),
            child,
        }
    }

    fn signal(&self, signal: Signal) {
        let pid = self.child.id().expect("running").cast_signed();
        kill(Pid::from_raw(pid), signal).expect("signal");
    }

    async fn stop(mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal(Signal::SIGTERM);
            let _ = timeout(Duration::from_secs(10), self.child.wait()).await;
        }
    }
}

fn http() -> reqwest::Client {
    // reqwest is built without a TLS provider of its own; plain HTTP still builds one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client")
}

/// What one replica's `/leader` and `/readyz` answer.
#[derive(Debug)]
struct Answer {
    leader_status: u16,
    view: LeaderView,
    ready: u16,
}

async fn ask(http: &reqwest::Client, replica: &Replica) -> Option<Answer> {
    let response = http
        .get(format!("{}/leader", replica.url))
        .send()
        .await
        .ok()?;
    let leader_status = response.status().as_u16();
    assert_eq!(
        response.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/json"[..])
    );
    let view = serde_json::from_str(&response.text().await.ok()?).expect("the JSON view");
    let ready = http
        .get(format!("{}/readyz", replica.url))
        .send()
        .await
        .ok()?
        .status()
        .as_u16();
    Some(Answer {
        leader_status,
        view,
        ready,
    })
}

/// The last job started (its identity and token), once the log holds `n` starts.
async fn nth_start(log: &Path, n: usize) -> TermEvent {
    leader_tests::nth_start(log, n, Duration::from_secs(20)).await
}

/// Takes the replica that runs `job` out of `replicas`.
fn take_leader(replicas: &mut Vec<Replica>, job: &TermEvent) -> Replica {
    let at = replicas
        .iter()
        .position(|r| r.identity == job.identity)
        .expect("the leader");
    replicas.remove(at)
}

/// Asks every replica until each agrees that `job.identity` leads with `job.token`; checks
/// what each answers then: 200 on the leader only, the same view everywhere, readiness as
/// configured.
async fn every_replica_names(http: &reqwest::Client, replicas: &[Replica], job: &TermEvent) {
    let answers = timeout(Duration::from_secs(10), async {
        loop {
            let mut answers = Vec::new();
            for replica in replicas {
                answers.push(ask(http, replica).await);
            }
            let agreed = answers.iter().all(|a| {
                a.as_ref().is_some_and(|a| {
                    a.view.leader.as_deref() == Some(job.identity.as_str())
                        && a.view.fencing_token == Some(job.token)
                })
            });
            if agreed {
                return answers.into_iter().flatten().collect::<Vec<_>>();
            }
            sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the replicas do not agree that {job:?} leads"));
    let leaders: Vec<&str> = replicas
        .iter()
        .zip(&answers)
        .filter(|(_, a)| a.leader_status == 200)
        .map(|(r, _)| r.identity)
        .collect();
    assert_eq!(leaders, [job.identity.as_str()], "{answers:?}");
    let since = answers[0].view.since;
    assert!(since.is_some(), "{answers:?}");
    for (replica, answer) in replicas.iter().zip(&answers) {
        let leads = replica.identity == job.identity;
        let view = &answer.view;
        assert_eq!(answer.leader_status, if leads { 200 } else { 503 });
        assert_eq!(view.identity, replica.identity);
        assert_eq!(view.leading, leads);
        assert_eq!(view.since, since, "one start time on every replica");
        assert!(view.elapsed.is_some_and(|e| e < Duration::from_secs(60)));
        let ready = leads || !replica.ready_only_while_leading;
        assert_eq!(
            answer.ready,
            if ready { 200 } else { 503 },
            "{} /readyz ({})",
            replica.identity,
            if replica.ready_only_while_leading {
                "--ready-only-while-leading"
            } else {
                "ready while it could take over"
            }
        );
    }
}

/// Three replicas, two of them ready only while leading; the leader is stopped by SIGTERM,
/// then the next one.
async fn endpoints_through_handovers(lock: &str) {
    let http = http();
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let name = format!("traffic-{:08x}", fastrand::u32(..));
    let only_leading = ["--ready-only-while-leading"];
    let mut replicas: Vec<Replica> = [
        ("one", &only_leading[..]),
        ("two", &only_leading),
        ("three", &[]),
    ]
    .into_iter()
    .map(|(identity, extra)| Replica::start(lock, &name, identity, &log, extra, &[]))
    .collect();
    let mut job = nth_start(&log, 1).await;
    every_replica_names(&http, &replicas, &job).await;
    for n in 2..=3 {
        let stopped = take_leader(&mut replicas, &job);
        stopped.signal(Signal::SIGTERM);
        let next = nth_start(&log, n).await;
        assert!(next.token > job.token);
        job = next;
        every_replica_names(&http, &replicas, &job).await;
        let gone = ask(&http, &stopped).await;
        assert!(
            gone.is_none(),
            "a replica that exited answers no more: {gone:?}"
        );
        stopped.stop().await;
    }
    for replica in replicas {
        replica.stop().await;
    }
}

on_each_backend!(endpoints_through_handovers:
    file_lock_leader_and_readiness_through_handovers => Some(leader_tests::FileLock::in_temp_dir()),
    redis_lock_leader_and_readiness_through_handovers => leader_test_support::redis_lock_or_skip(),
);

/// The test Kubernetes API server as a process, its URL and a kubeconfig for it in `dir`.
async fn kube_api_server(dir: &Path) -> (Child, String, std::path::PathBuf) {
    let server = leader_tests::KubeApiProcess::start(API_SERVER, dir, &[]).await;
    (server.child, server.url, server.kubeconfig)
}

/// Every change of the set of labelled Pods, from a label-selector watch on the API server.
#[derive(Clone, Default)]
struct Labelled(Arc<Mutex<Vec<BTreeSet<String>>>>);

impl Labelled {
    async fn watch(api: &str, selector: &str) -> Self {
        let labelled = Self::default();
        let history = labelled.clone();
        // A client without a timeout: the watch lasts the whole test.
        let mut response = reqwest::Client::new()
            .get(format!("{api}/api/v1/namespaces/default/pods"))
            .query(&[("watch", "true"), ("labelSelector", selector)])
            .send()
            .await
            .expect("watch");
        tokio::spawn(async move {
            let (mut pending, mut current) = (String::new(), BTreeSet::new());
            while let Ok(Some(chunk)) = response.chunk().await {
                pending.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(at) = pending.find('\n') {
                    let line: String = pending.drain(..=at).collect();
                    let event: Value = serde_json::from_str(&line).expect("a watch event");
                    let pod = event["object"]["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    match event["type"].as_str() {
                        Some("ADDED" | "MODIFIED") => current.insert(pod),
                        Some("DELETED") => current.remove(&pod),
                        _ => continue,
                    };
                    history.0.lock().unwrap().push(current.clone());
                }
            }
        });
        labelled
    }

    fn history(&self) -> Vec<BTreeSet<String>> {
        self.0.lock().unwrap().clone()
    }

    async fn wait_for(&self, pod: &str) {
        let expected = BTreeSet::from([pod.to_owned()]);
        timeout(Duration::from_secs(20), async {
            while self.history().last() != Some(&expected) {
                sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{pod} labelled: {:?}", self.history()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_the_leaders_pod_is_labelled_never_two() {
    let http = http();
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("jobs.log");
    let (_server, api, kubeconfig) = kube_api_server(dir.path()).await;
    let kubeconfig = kubeconfig.display().to_string();
    let identities = ["pod-one", "pod-two", "pod-three"];
    for pod in identities {
        let created = reqwest::Client::new()
            .post(format!("{api}/api/v1/namespaces/default/pods"))
            .header("content-type", "application/json")
            .body(
                json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": pod, "labels": {"app": "jobs"}},
                    "spec": {"containers": [{"name": "job", "image": "job:1"}]}})
                .to_string(),
            )
            .send()
            .await
            .expect("create a Pod");
        assert_eq!(created.status(), 201);
    }
    let labelled = Labelled::watch(&api, "leader-rs.io/leader=jobs").await;
    let mut replicas: Vec<Replica> = identities
        .into_iter()
        .map(|pod| {
            let env = [
                ("KUBECONFIG", kubeconfig.as_str()),
                ("POD_NAME", pod),
                ("POD_NAMESPACE", "default"),
            ];
            Replica::start(
                "kubernetes://default",
                "jobs",
                pod,
                &log,
                &["--label-pod"],
                &env,
            )
        })
        .collect();
    let first = nth_start(&log, 1).await;
    labelled.wait_for(&first.identity).await;
    every_replica_names(&http, &replicas, &first).await;

    // SIGTERM: the label is removed before the release, and the next leader labels its Pod.
    let stopped = take_leader(&mut replicas, &first);
    stopped.signal(Signal::SIGTERM);
    let second = nth_start(&log, 2).await;
    labelled.wait_for(&second.identity).await;
    stopped.stop().await;

    // SIGKILL: the label stays on the dead leader's Pod until the next leader, once the lease
    // ran out, removes it before it labels its own.
    let mut killed = take_leader(&mut replicas, &second);
    killed.signal(Signal::SIGKILL);
    let _ = killed.child.wait().await;
    let third = nth_start(&log, 3).await;
    labelled.wait_for(&third.identity).await;
    every_replica_names(&http, &replicas, &third).await;

    for replica in replicas {
        replica.stop().await;
    }
    sleep(Duration::from_millis(200)).await;
    let history = labelled.history();
    assert!(
        history.iter().all(|set| set.len() <= 1),
        "two Pods labelled at once: {history:?}"
    );
    assert_eq!(
        history.last(),
        Some(&BTreeSet::new()),
        "the last leader removed its label on its way out: {history:?}"
    );
    assert!(
        history.iter().any(|set| set.contains(&second.identity)),
        "{history:?}"
    );
}
