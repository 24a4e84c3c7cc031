//! Settings the command reads from the environment mean what they mean everywhere else in the
//! project (the examples, the manifests): a value that reads as another kind of setting is
//! refused in one line at start, not taken as it is.

use std::process::{Command, Stdio};

const LEADER: &str = env!("CARGO_BIN_EXE_leader");

/// `LEADER_LABEL_POD` names the label's key: `true`, copied from an on/off setting, would label
/// Pods `true=NAME`, which no Service selects.
#[cfg(feature = "kubernetes")]
#[test]
fn a_label_pod_setting_that_is_a_switch_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    for switch in ["true", "1"] {
        let output = Command::new(LEADER)
            .args(["run", "--name", "switch", "--", "true"])
            .env(
                "LEADER_LOCK",
                format!("file://{}", dir.path().join("lock").display()),
            )
            .env("LEADER_LABEL_POD", switch)
            .env("POD_NAME", "web-1")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .output()
            .expect("run leader");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{switch}: {stderr}");
        assert!(
            stderr.contains("is a switch, not a label key")
                && stderr.contains("leader-rs.io/leader"),
            "{switch}: {stderr}"
        );
    }
}
