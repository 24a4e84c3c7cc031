//! Where a scenario runs: the test Consul server (the holder on an agent of its own, node
//! `node-a`, and the follower on the first), or a real agent on request (`LEADER_CONSUL_E2E=1
//! CONSUL_HTTP_ADDR=... [CONSUL_HTTP_TOKEN=...]`), where both are on that agent's node. What an
//! operator does goes through the HTTP API in both.

use std::time::Duration;

use leader_consul::ConsulStore;
use serde_json::{Value, json};

use super::{ConsulApiServer, http};

/// A Consul to run a scenario on.
pub enum Cluster {
    /// The test Consul server.
    Test {
        /// Its first agent, the follower's.
        api: ConsulApiServer,
        /// The holder's agent, node `node-a`.
        holder: ConsulApiServer,
    },
    /// A real agent.
    Agent {
        url: String,
        token: Option<String>,
        node: String,
        address: String,
    },
}

impl Cluster {
    /// The test Consul server, with a second agent for the holder.
    pub async fn test() -> Self {
        let api = ConsulApiServer::start().await;
        let holder = api.agent("node-a").await;
        Self::Test { api, holder }
    }

    /// The agent of `CONSUL_HTTP_ADDR` (with `CONSUL_HTTP_TOKEN`), when `LEADER_CONSUL_E2E=1`.
    ///
    /// # Panics
    /// Without them, or when the agent does not say who it is.
    pub async fn agent() -> Self {
        assert_eq!(
            std::env::var("LEADER_CONSUL_E2E").as_deref(),
            Ok("1"),
            "set LEADER_CONSUL_E2E=1 and CONSUL_HTTP_ADDR to run against a real agent"
        );
        let url = std::env::var("CONSUL_HTTP_ADDR").expect("CONSUL_HTTP_ADDR");
        let url = if url.contains("://") {
            url
        } else {
            format!("http://{url}")
        };
        let token = std::env::var("CONSUL_HTTP_TOKEN")
            .ok()
            .filter(|t| !t.is_empty());
        let me = call(&url, token.as_deref(), "GET", "/v1/agent/self", None).await;
        let node = me["Config"]["NodeName"]
            .as_str()
            .expect("NodeName")
            .to_owned();
        let address = me["Member"]["Addr"]
            .as_str()
            .unwrap_or("127.0.0.1")
            .to_owned();
        Self::Agent {
            url,
            token,
            node,
            address,
        }
    }

    /// The test server, for what only it can do (an agent that leaves, a failing check).
    pub fn test_server(&self) -> Option<&ConsulApiServer> {
        match self {
            Self::Test { api, .. } => Some(api),
            Self::Agent { .. } => None,
        }
    }

    fn url(&self, holder: bool) -> String {
        match self {
            Self::Test { api, .. } if !holder => api.url(),
            Self::Test { holder, .. } => holder.url(),
            Self::Agent { url, .. } => url.clone(),
        }
    }

    /// A store with key prefix `prefix` on the holder's agent (or the follower's), whose
    /// requests give up after a second (an agent that left answers nothing).
    pub fn store(&self, holder: bool, prefix: &str) -> ConsulStore {
        let mut builder = ConsulStore::builder(self.url(holder))
            .prefix(prefix)
            .timeout(Duration::from_secs(1));
        if let Self::Agent {
            token: Some(token), ..
        } = self
        {
            builder = builder.token(token);
        }
        builder.build().expect("a store")
    }

    /// The holder's node.
    pub fn holder_node(&self) -> String {
        match self {
            Self::Test { holder, .. } => holder.node().to_owned(),
            Self::Agent { node, .. } => node.clone(),
        }
    }

    /// `method path` on the follower's agent with `body`, as an operator would (with the
    /// token); the answer's JSON (`null` for none).
    pub async fn call(&self, method: &str, path: &str, body: Option<String>) -> Value {
        let token = match self {
            Self::Agent { token, .. } => token.as_deref(),
            Self::Test { .. } => None,
        };
        call(&self.url(false), token, method, path, body).await
    }

    /// The sessions whose name holds `within` (the lock names them `leader KEY IDENTITY`).
    pub async fn sessions(&self, within: &str) -> Vec<Value> {
        let all = self.call("GET", "/v1/session/list", None).await;
        all.as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["Name"].as_str().is_some_and(|n| n.contains(within)))
            .cloned()
            .collect()
    }

    /// An operator's `PUT /v1/session/destroy/ID`.
    pub async fn destroy(&self, id: &str) {
        self.call("PUT", &format!("/v1/session/destroy/{id}"), None)
            .await;
    }

    /// `PUT /v1/catalog/deregister` of `node`, as `consul force-leave -prune` does, which ends
    /// its sessions. A real agent still running registers its node again at its next
    /// anti-entropy sync; this does so at once there, so that its sessions can be created.
    pub async fn deregister(&self, node: &str) {
        self.call(
            "PUT",
            "/v1/catalog/deregister",
            Some(json!({"Node": node}).to_string()),
        )
        .await;
        if let Self::Agent { address, .. } = self {
            self.call(
                "PUT",
                "/v1/catalog/register",
                Some(json!({"Node": node, "Address": address}).to_string()),
            )
            .await;
        }
    }

    /// A plain `PUT` of `value` at `key`, as another client's.
    pub async fn put(&self, key: &str, value: &str) {
        self.call("PUT", &format!("/v1/kv/{key}"), Some(value.to_owned()))
            .await;
    }
}

/// `method url+path` with `body` and `token`: the answer's JSON (`null` for none).
async fn call(
    url: &str,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: Option<String>,
) -> Value {
    let mut request = http().request(method.parse().expect("a method"), format!("{url}{path}"));
    if let Some(token) = token {
        request = request.header("X-Consul-Token", token);
    }
    if let Some(body) = body {
        request = request.body(body);
    }
    let answer = request.send().await.expect("a request");
    let status = answer.status();
    let text = answer.text().await.expect("a body");
    assert!(status.is_success(), "{method} {path}: {status} {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}
