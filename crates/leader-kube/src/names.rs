//! The names the API server accepts, checked when a lock is built
//! (`staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go`, as
//! `pkg/apis/coordination/validation/validation.go` applies it).

use leader_core::LockError;

use crate::error::BACKEND;

/// `IsDNS1123Label`, the rule for namespaces (`ValidateNamespaceName`): at most 63 lower-case
/// letters, digits and `-`, starting and ending with a letter or digit.
pub(crate) fn is_dns_label(name: &str) -> bool {
    name.len() <= 63 && is_label_text(name)
}

/// `IsDNS1123Subdomain`, the rule for Lease names (`NameIsDNSSubdomain`): at most 253
/// characters, dot-separated labels of lower-case letters, digits and `-`, each starting and
/// ending with a letter or digit.
pub(crate) fn is_dns_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(is_label_text)
}

fn is_label_text(label: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !label.is_empty()
        && label.chars().all(|c| alnum(c) || c == '-')
        && label.starts_with(alnum)
        && label.ends_with(alnum)
}

/// `IsQualifiedName`: an optional DNS-subdomain prefix and `/`, then a name of at most 63
/// letters, digits, `-`, `_` and `.` that starts and ends with a letter or digit.
pub(crate) fn is_qualified_name(value: &str) -> bool {
    let name = match value.split('/').collect::<Vec<_>>()[..] {
        [name] => name,
        [prefix, name] if is_dns_subdomain(prefix) => name,
        _ => return false,
    };
    let edge = |c: char| c.is_ascii_alphanumeric();
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| edge(c) || matches!(c, '-' | '_' | '.'))
        && name.starts_with(edge)
        && name.ends_with(edge)
}

/// `IsValidLabelValue`: empty, or at most 63 letters, digits, `-`, `_` and `.` that start and
/// end with a letter or digit.
pub(crate) fn is_label_value(value: &str) -> bool {
    let edge = |c: char| c.is_ascii_alphanumeric();
    value.is_empty()
        || (value.len() <= 63
            && value
                .chars()
                .all(|c| edge(c) || matches!(c, '-' | '_' | '.'))
            && value.starts_with(edge)
            && value.ends_with(edge))
}

/// `IsConfigMapKey`, the rule for LeaseCandidate names: at most 253 letters, digits, `-`, `_`
/// and `.`, and neither `.` nor `..`.
pub(crate) fn is_config_map_key(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name != "."
        && name != ".."
}

/// Refuses a namespace or a Lease name the API server would refuse, naming the rule and, where
/// there is one, the nearest name it accepts. Names are never changed silently: two elections
/// whose names map to the same Lease would share it.
pub(crate) fn check_lease(namespace: &str, name: &str) -> Result<(), LockError> {
    let refuse = |what: &str, value: &str, rule: &str| {
        let suggestion = suggest(value);
        let hint = if suggestion.is_empty() || suggestion == value {
            String::new()
        } else {
            format!("; {suggestion:?} would do")
        };
        Err(LockError::Misconfigured {
            backend: BACKEND,
            message: format!("the {what} {value:?} is refused by the Kubernetes API: {rule}{hint}"),
        })
    };
    if !is_dns_label(namespace) {
        return refuse(
            "namespace",
            namespace,
            "a namespace is a DNS-1123 label: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit",
        );
    }
    if !is_dns_subdomain(name) {
        return refuse(
            "Lease name",
            name,
            "a Lease name is a DNS-1123 subdomain: at most 253 characters, labels of lower-case letters, digits and '-' separated by '.', each starting and ending with a letter or digit",
        );
    }
    Ok(())
}

/// A name close to `value` that the rules accept: lower case, other characters as `-`, no
/// empty labels, trimmed to letters or digits at the ends.
fn suggest(value: &str) -> String {
    let mapped: String = value
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    mapped
        .split('.')
        .map(|label| label.trim_matches('-'))
        .filter(|label| !label.is_empty())
        .collect::<Vec<_>>()
        .join(".")
        .chars()
        .take(63)
        .collect::<String>()
        .trim_end_matches(['-', '.'])
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_api_servers_rules() {
        for good in ["a", "a.b-c", "0.9", &"a".repeat(253)] {
            assert!(is_dns_subdomain(good), "{good}");
        }
        for bad in [
            "",
            "a..b",
            "a.-b",
            "a-.b",
            ".a",
            "A",
            "nightly_cleanup",
            &"a".repeat(254),
        ] {
            assert!(!is_dns_subdomain(bad), "{bad}");
        }
        assert!(is_dns_label("kube-system"));
        assert!(!is_dns_label("a.b") && !is_dns_label(&"a".repeat(64)));
        assert!(is_qualified_name("example.com/by-zone_1.x"));
        for bad in [
            "example.com/",
            "/name",
            "Example.com/x",
            "a/b/c",
            "example.com/-x",
        ] {
            assert!(!is_qualified_name(bad), "{bad}");
        }
    }

    #[test]
    fn a_refused_name_names_the_rule_and_a_name_that_would_do() {
        let err = check_lease("default", "nightly_cleanup").expect_err("refused");
        assert!(matches!(err, LockError::Misconfigured { .. }));
        let message = err.to_string();
        assert!(message.contains("DNS-1123 subdomain"), "{message}");
        assert!(message.contains("\"nightly-cleanup\""), "{message}");
        let err = check_lease("Bad_Namespace", "jobs").expect_err("refused");
        assert!(err.to_string().contains("DNS-1123 label"), "{err}");
        assert!(check_lease("default", "nightly-cleanup.v2").is_ok());
    }
}
