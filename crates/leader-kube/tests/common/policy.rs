//! The ValidatingAdmissionPolicy of `deploy/kubernetes/policy-pod-label.yaml`, evaluated as
//! kube-apiserver evaluates one on an UPDATE (`staging/src/k8s.io/apiserver/pkg/admission/
//! plugin/policy/validating`): its match conditions, then its variables in order (each sees
//! those before it), then every validation; with `failurePolicy: Fail` an expression that
//! errors denies. The expressions are the manifest's own, run by the `cel` crate. The
//! binding's namespace selector is not evaluated: the tests' Pods are in `default`, which it
//! selects.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cel::{Context, Program, Value as Cel};
use leader_test_support::kube_api::KubeApiServer;
use serde_json::{Value, json};

/// The manifest, relative to this crate.
const MANIFEST: &str = "../../deploy/kubernetes/policy-pod-label.yaml";

/// The example's service account, which the policy's match condition names.
pub const ELECTION_USER: &str = "system:serviceaccount:default:leader-example";

/// The user info a service account token bound to the Pod `pod` authenticates as.
pub fn election_in(pod: &str) -> Value {
    json!({
        "username": ELECTION_USER,
        "uid": "5b2d4c1e-0000-4000-8000-00000000000a",
        "groups": ["system:serviceaccounts", "system:serviceaccounts:default", "system:authenticated"],
        "extra": {
            "authentication.kubernetes.io/pod-name": [pod],
            "authentication.kubernetes.io/pod-uid": [format!("uid-of-{pod}")],
        },
    })
}

/// The same account from a token bound to no Pod (a legacy Secret token): no `extra`.
pub fn election_unbound() -> Value {
    json!({"username": ELECTION_USER, "groups": ["system:serviceaccounts", "system:authenticated"]})
}

/// The bearer token [`user_of`] reads as [`election_in`]`(pod)`.
pub fn token_of(pod: &str) -> String {
    format!("pod:{pod}")
}

/// Who a request with bearer `token` is: [`election_in`] a Pod for `pod:NAME`, anonymous
/// without a token.
pub fn user_of(token: &str) -> Value {
    match token.strip_prefix("pod:") {
        Some(pod) => election_in(pod),
        None if token.is_empty() => json!({"username": "system:anonymous"}),
        None => election_unbound(),
    }
}

/// What the policy answers a request.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Its match conditions leave the request to others.
    NotMatched,
    /// Every validation holds.
    Allowed,
    /// The message of the first validation that does not hold, or of the expression that
    /// failed.
    Denied(String),
}

/// The policy, its expressions compiled.
pub struct Policy {
    /// Its name (and its binding's).
    pub name: String,
    conditions: Vec<(String, Program)>,
    variables: Vec<(String, Program)>,
    validations: Vec<(String, Program, String)>,
}

impl Policy {
    /// Reads and compiles the manifest's policy; checks that its binding denies.
    ///
    /// # Panics
    /// When the manifest does not read or an expression does not compile.
    pub fn load() -> Self {
        let path = format!("{}/{MANIFEST}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).expect("the manifest");
        let documents: Vec<Value> = serde_saphyr::from_multiple(&text).expect("YAML");
        let of_kind = |kind: &str| {
            documents
                .iter()
                .find(|d| d["kind"] == kind)
                .unwrap_or_else(|| panic!("a {kind}"))
                .clone()
        };
        let policy = of_kind("ValidatingAdmissionPolicy");
        let binding = of_kind("ValidatingAdmissionPolicyBinding");
        let name = policy["metadata"]["name"]
            .as_str()
            .expect("a name")
            .to_owned();
        assert_eq!(binding["spec"]["policyName"], name.as_str());
        assert_eq!(binding["metadata"]["name"], name.as_str());
        assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
        let spec = &policy["spec"];
        assert_eq!(
            spec["failurePolicy"], "Fail",
            "an expression that errors denies"
        );
        assert_eq!(
            spec["matchConstraints"]["resourceRules"],
            json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}])
        );
        let compile = |expression: &Value| {
            let source = expression.as_str().expect("an expression");
            Program::compile(source).unwrap_or_else(|err| panic!("{source}: {err:?}"))
        };
        let named = |list: &Value| {
            list.as_array()
                .expect("a list")
                .iter()
                .map(|item| {
                    let name = item["name"].as_str().expect("a name").to_owned();
                    (name, compile(&item["expression"]))
                })
                .collect()
        };
        let validations = spec["validations"]
            .as_array()
            .expect("validations")
            .iter()
            .map(|v| {
                let source = v["expression"].as_str().expect("an expression").to_owned();
                let message = v["message"].as_str().expect("a message").to_owned();
                (source, compile(&v["expression"]), message)
            })
            .collect();
        Self {
            name,
            conditions: named(&spec["matchConditions"]),
            variables: named(&spec["variables"]),
            validations,
        }
    }

    /// The policy's answer to `user` updating the Pod `old` into `new`.
    pub fn admit(&self, old: &Value, new: &Value, user: &Value) -> Verdict {
        let request = json!({
            "operation": "UPDATE",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": new["metadata"]["name"],
            "namespace": new["metadata"]["namespace"],
            "userInfo": user,
        });
        let mut context = Context::default();
        for (name, value) in [("object", new), ("oldObject", old), ("request", &request)] {
            context.add_variable(name, value).expect("JSON converts");
        }
        for (name, condition) in &self.conditions {
            match condition.execute(&context) {
                Ok(Cel::Bool(true)) => {}
                Ok(Cel::Bool(false)) => return Verdict::NotMatched,
                other => return Verdict::Denied(format!("match condition {name}: {other:?}")),
            }
        }
        let mut variables: HashMap<String, Cel> = HashMap::new();
        for (name, program) in &self.variables {
            let mut scope = context.new_inner_scope();
            scope.add_variable_from_value("variables", variables.clone());
            match program.execute(&scope) {
                Ok(value) => variables.insert(name.clone(), value),
                Err(err) => return Verdict::Denied(format!("variable {name}: {err:?}")),
            };
        }
        context.add_variable_from_value("variables", variables);
        for (source, validation, message) in &self.validations {
            match validation.execute(&context) {
                Ok(Cel::Bool(true)) => {}
                Ok(Cel::Bool(false)) => return Verdict::Denied(message.clone()),
                other => return Verdict::Denied(format!("{source}: {other:?}")),
            }
        }
        Verdict::Allowed
    }

    /// Makes `api` run this policy on every Pod update, its requests' users told apart by
    /// [`user_of`] their bearer tokens; the refusals are kept in the returned list.
    pub fn enforce_on(self, api: &KubeApiServer) -> Arc<Mutex<Vec<String>>> {
        let refused: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&refused);
        let name = self.name.clone();
        api.admit_pod_updates(&name, move |old, new, token| {
            match self.admit(old, new, &user_of(token)) {
                Verdict::Denied(message) => {
                    let pod = new["metadata"]["name"].as_str().unwrap_or_default();
                    log.lock()
                        .unwrap()
                        .push(format!("{pod} by {token:?}: {message}"));
                    Err(message)
                }
                Verdict::Allowed | Verdict::NotMatched => Ok(()),
            }
        });
        refused
    }
}

/// A kube client for `api` whose requests carry the bearer token `token`.
pub fn client_with_token(api: &KubeApiServer, token: &str) -> kube::Client {
    let mut config = kube::Config::new(api.url().parse().expect("url"));
    config.auth_info.token = Some(token.to_owned().into());
    kube::Client::try_from(config).expect("client")
}
